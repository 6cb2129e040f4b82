"""A drafter family as the trainers see it. Each family is one TrainingFamily entry in
drafters.training.families.TRAINING_FAMILIES, made of the functions in its own training module
(drafters.training.eagle3 / eagle1 / dflash / heads); the shared run (drafters.training.families.train)
reads only this, so no code outside the entries asks which family it trains.

The other layers have their own table, keyed by the same names: drafters.registry.FAMILIES (config and
module, how a stored drafter is rebuilt), drafters.export.dispatch (export formats) and
drafters.decode.proposers (drafting). tests/test_families.py checks that every table names the same families.
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingFamily:
    name: str  # the recipe's `drafter` value and drafters.registry's key
    # its recipe schema: a drafters.training.schema.TrainRecipe subclass in the family's training module, holding the
    # family's own fields (and no other family's) and naming their problems in problems()
    recipe: type
    # (recipe, target, train_rows, vocab, say) -> the objective (an nn.Module whose .drafter is trained), called
    # right after set_seed(recipe.seed); vocab is the draft vocabulary when draft_vocab is set, else None
    build: Callable
    run: type  # its drafters.training.loop.RunBase subclass: micro_step, held_out, describe
    loss_parts: str  # what metrics.jsonl's step_loss / step_acc list: "per TTT step", "per head", ...
    draft_vocab: bool = False  # counts a reduced draft vocabulary on the training rows (drafters.draft_vocab)
    # offline features (features.dir, drafters.training.features): the stored layout it reads (a family may read
    # another's: DFlash reads EAGLE-3's) and (recipe, target) -> what the stored tensors hold; None = online only
    store_layout: str | None = None
    layer_spec: Callable | None = None
    # (recipe, target, drafter) -> batch -> the objective's target-side inputs (online or from the store)
    inputs: Callable | None = None
    # (drafter, inputs, embed, batches, recipe, accelerator) -> the held-out metrics, and their one-line summary
    evaluate: Callable | None = None
    describe: Callable | None = None
    check_rows: Callable = lambda recipe, rows: None  # (recipe, train rows) -> raises RecipeError if unusable

    @property
    def offline(self) -> bool:
        return self.layer_spec is not None
