"""Every drafter family the trainers train, and the one run they share.

    recipe = load_recipe(argv, "train/eagle.py")   # YAML + key=value -> the family's recipe, checked
    summary = train(recipe)                        # target, split, drafter, loop, checkpoint-final

TRAINING_FAMILIES holds one drafters.training.family.TrainingFamily per family, keyed as drafters.registry.FAMILIES
(tests/test_families.py keeps the tables in step). train() reads only the entry: adding a family is its modules
(model, training, proposer, export) plus one entry in each table.
"""

from accelerate.utils import set_seed

from drafters.training.batches import length_sorted_batches, pad_id, train_loader
from drafters.training.data import collate
from drafters.training.dflash import build_dflash, evaluate_dflash, format_dflash_eval
from drafters.training.eagle1 import build_eagle1, eagle1_inputs_fn, eagle1_layer_spec, evaluate_eagle1
from drafters.training.eagle3 import (
    EagleRecipe,
    EagleRun,
    build_eagle3,
    choose_draft_vocab,
    eagle3_layer_spec,
    dflash_problems,
    dspark_problems,
    peagle_problems,
    eagle1_problems,
    eagle_problems,
    evaluate_eagle3,
    format_eval,
    target_inputs_fn,
)
from drafters.training.dspark import build_dspark
from drafters.training.family import TrainingFamily
from drafters.training.peagle import build_peagle, evaluate_peagle, format_peagle_eval
from drafters.training.features import FeatureStore, offline_batches, offline_loader
from drafters.training.heads import (
    HeadsRecipe,
    HeadsRun,
    build_blockwise,
    build_medusa,
    check_heads_have_labels,
    heads_problems,
)
from drafters.training.loop import Summary, fit, start_run
from drafters.training.recipe import RecipeError, read_recipe
from drafters.training.schema import load_train_recipe

_EAGLE = dict(script="train/eagle.py", recipe=EagleRecipe, run=EagleRun)
_HEADS = dict(script="train/heads.py", recipe=HeadsRecipe, problems=heads_problems, run=HeadsRun,
              loss_parts="per head", check_rows=check_heads_have_labels)
TRAINING_FAMILIES: dict[str, TrainingFamily] = {
    "eagle3": TrainingFamily("eagle3", **_EAGLE, problems=eagle_problems, build=build_eagle3,
                             loss_parts="per TTT step", draft_vocab=True, store_layout="eagle3",
                             layer_spec=eagle3_layer_spec, inputs=target_inputs_fn,
                             evaluate=evaluate_eagle3, describe=format_eval),
    # DFlash reads EAGLE-3's stored layout: one store serves both at the same layers
    "dflash": TrainingFamily("dflash", **_EAGLE, problems=dflash_problems, build=build_dflash,
                             loss_parts="per block slot", draft_vocab=True, store_layout="eagle3",
                             layer_spec=eagle3_layer_spec, inputs=target_inputs_fn,
                             evaluate=evaluate_dflash, describe=format_dflash_eval),
    # DSpark is DFlash plus its Markov head: DFlash's objective, evaluation and store
    "dspark": TrainingFamily("dspark", **_EAGLE, problems=dspark_problems, build=build_dspark,
                             loss_parts="per block slot", draft_vocab=True, store_layout="eagle3",
                             layer_spec=eagle3_layer_spec, inputs=target_inputs_fn,
                             evaluate=evaluate_dflash, describe=format_dflash_eval),
    "peagle": TrainingFamily("peagle", **_EAGLE, problems=peagle_problems, build=build_peagle,
                             loss_parts="per depth", draft_vocab=True, store_layout="eagle3",
                             layer_spec=eagle3_layer_spec, inputs=target_inputs_fn,
                             evaluate=evaluate_peagle, describe=format_peagle_eval),
    "eagle1": TrainingFamily("eagle1", **_EAGLE, problems=eagle1_problems, build=build_eagle1,
                             loss_parts="feature, token", store_layout="eagle1",
                             layer_spec=eagle1_layer_spec, inputs=eagle1_inputs_fn,
                             evaluate=evaluate_eagle1, describe=format_eval),
    "medusa": TrainingFamily("medusa", **_HEADS, build=build_medusa),
    "blockwise": TrainingFamily("blockwise", **_HEADS, build=build_blockwise),
}
# Each script's default family, when a recipe names none (the schema's default `drafter`).
SCRIPT_DEFAULTS = {"train/eagle.py": "eagle3", "train/heads.py": "medusa"}


def load_recipe(argv: list[str], script: str):
    """The recipe of argv (RECIPE.yaml [key=value ...]) in its family's schema, every problem named at once. A
    recipe of a family another script trains is sent there, instead of failing on the first key of its family
    (medusa's num_heads: 'did you mean threads?')."""
    raw = read_recipe(argv[0], argv[1:])
    drafter = raw.get("drafter", SCRIPT_DEFAULTS[script])
    family = TRAINING_FAMILIES.get(drafter) if isinstance(drafter, str) else None
    if family is not None and family.script != script:
        raise RecipeError(f"recipe {argv[0]} trains drafter={drafter}: run it with {family.script}")
    if family is None:  # an unknown or mistyped drafter: the script's schema names the choices
        family = TRAINING_FAMILIES[SCRIPT_DEFAULTS[script]]
    return load_train_recipe(argv, family.recipe, family.problems, raw=raw)


def train(recipe, tag: str) -> Summary:
    """One training run of recipe.drafter's family; `tag` prefixes its printed lines."""
    family = TRAINING_FAMILIES[recipe.drafter]
    accelerator, target, resume, train_rows, held_out = start_run(recipe, tag)
    say = accelerator.print
    store = None
    if family.offline and recipe.features.dir:  # refuses features computed for other data, target or feature
        store = FeatureStore.open(recipe.features.dir)
        store.check(recipe, target, family)
        say(store.summary())
    family.check_rows(recipe, train_rows)
    vocab = choose_draft_vocab(recipe, target, train_rows, say) if family.draft_vocab else None
    set_seed(recipe.seed)  # the drafter's initialisation and nothing before it
    objective = family.build(recipe, target, train_rows, vocab, say)
    pad = pad_id(target)
    loader = train_loader(recipe, train_rows, pad) if store is None else offline_loader(recipe, store, train_rows, pad)
    eval_batches = length_sorted_batches(held_out, recipe.batch_size)
    eval_batches = [collate(batch, pad) for batch in eval_batches] if store is None else \
        offline_batches(store, eval_batches, pad)
    if not eval_batches:
        say(f"{tag}: no held-out rows (data.eval_rows / eval_fraction): no held-out evaluation will run")
    return fit(recipe, accelerator, target, objective, loader, eval_batches, train_rows, resume, family, tag)
