"""The one base of the errors a user fixes (a recipe key, a data file, a target name, a checkpoint): entry
scripts print their message, not a traceback (drafters.training.recipe.run_main). Knows nothing else."""


class UserError(ValueError):
    pass
