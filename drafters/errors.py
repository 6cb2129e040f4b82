"""The one base of what the library raises for a user to act on (a recipe key, a data file, a target name, a
checkpoint, a full disk, a run stopped by a signal): entry scripts print `label: message` and exit with the
class's exit_code, never a traceback (drafters.training.recipe.run_main). Knows nothing else."""


class UserError(ValueError):
    exit_code = 2  # what an entry script exits with (drafters.training.recipe.run_main), after `label: message`
    label = "error"


class Stopped(UserError):
    """A run stopped on request (SIGINT / SIGTERM) after saving what resumes it; the message says where."""
    exit_code = 130
    label = "stopped"
