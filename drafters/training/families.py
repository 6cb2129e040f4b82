"""Every drafter family the trainer trains, and the one run they share.

    recipe = load_recipe(argv)      # YAML + key=value -> the schema of the recipe's `drafter`, checked
    summary = train(recipe)         # target, split, drafter, loop, checkpoint-final

TRAINING_FAMILIES holds one TrainingFamily per family, keyed as drafters.registry.FAMILIES, made of the functions in
the family's own training module (drafters.training.eagle3 / eagle1 / dflash / dspark / peagle / heads). load_recipe
and train() read only the entry, so no code outside the entries asks which family it trains; adding a family is its
modules (model, training, proposer, export) plus one entry in each layer's table: drafters.registry.FAMILIES (how a
stored drafter is rebuilt), drafters.export.dispatch (export formats), drafters.decode.proposers.loading (drafting)
and this one. tests/test_families.py checks that every table names the same families.
"""

import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from accelerate.utils import set_seed

from drafters.checkpoint import load_checkpoint
from drafters.training.batches import length_sorted_batches, pad_id, train_loader
from drafters.training.data import collate
from drafters.training.dflash import DFlashRecipe, build_dflash, evaluate_dflash, format_dflash_eval
from drafters.training.dflash2 import DFlash2Recipe, build_dflash2
from drafters.training.dspark import DSparkRecipe, build_dspark
from drafters.training.eagle1 import Eagle1Recipe, build_eagle1, eagle1_inputs_fn, eagle1_layer_spec, evaluate_eagle1
from drafters.training.eagle3 import (
    Eagle3Recipe,
    build_eagle3,
    choose_draft_vocab,
    eagle3_layer_spec,
    evaluate_eagle3,
    format_eval,
    target_inputs_fn,
)
from drafters.training.eagle4 import Eagle4Recipe, Eagle4Run, build_eagle4, evaluate_eagle4, format_eagle4_eval
from drafters.training.features import FeatureStore, offline_batches, offline_loader
from drafters.training.heads import (
    BlockwiseRecipe,
    HeadsRun,
    MedusaRecipe,
    build_blockwise,
    build_medusa,
    check_heads_have_labels,
)
from drafters.errors import Stopped
from drafters.training.loop import FeatureRun, Summary, fit, start_run
from drafters.training.mtp import MtpRecipe, build_mtp, evaluate_mtp, mtp_inputs_fn
from drafters.training.measure import measure_trained
from drafters.training.memory import block_shape, ttt_shape
from drafters.training.peagle import PEagleRecipe, build_peagle, evaluate_peagle, format_peagle_eval
from drafters.training.recipe import RecipeError, apply_override, read_recipe, to_dict
from drafters.training.resume import (
    Finished,
    field_default,
    recipe_diff,
    init_from_gone,
    initial_checkpoint,
    initial_vocab,
    load_initial_weights,
    load_resumed_weights,
)
from drafters.training.schema import deprecation, load_train_recipe, move_old_keys, moved_override
from drafters.training.stages import (
    Stage,
    check_output_dir,
    finished,
    link_final,
    missing_input,
    plan_stages,
    stage_argv,
)
from drafters.training.store import make_store, store_finished


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
    # (recipe, drafter) -> drafters.training.memory.StepShape: what a step holds, for the memory check before the
    # first step; None = not estimated (not checked)
    memory_shape: Callable | None = None
    # (recipe) -> the target decoder layer the drafter starts as (EAGLE-3's eagle3.init_layer), or None: with one,
    # the target's decoder layers are loaded even where the features come from a store
    init_layer: Callable = lambda recipe: None
    # (recipe) -> whether init_from's drafter is stacked deeper (EAGLE-3's eagle3.grow_layers)
    grow_layers: Callable = lambda recipe: False

    @property
    def offline(self) -> bool:
        return self.layer_spec is not None


# the feature-level families read the target's fused aux layers (EAGLE-3's inputs and store) unless they say not
_FUSED = dict(run=FeatureRun, store_layout="eagle3", layer_spec=eagle3_layer_spec, inputs=target_inputs_fn,
              draft_vocab=True)
_HEADS = dict(run=HeadsRun, loss_parts="per head", check_rows=check_heads_have_labels)
TRAINING_FAMILIES: dict[str, TrainingFamily] = {
    "eagle3": TrainingFamily("eagle3", recipe=Eagle3Recipe, build=build_eagle3, loss_parts="per TTT step",
                             evaluate=evaluate_eagle3, describe=format_eval, memory_shape=ttt_shape,
                             init_layer=lambda recipe: recipe.eagle3.init_layer,
                             grow_layers=lambda recipe: recipe.eagle3.grow_layers, **_FUSED),
    # DFlash reads EAGLE-3's stored layout: one store serves both at the same layers
    "dflash": TrainingFamily("dflash", recipe=DFlashRecipe, build=build_dflash, loss_parts="per block slot",
                             evaluate=evaluate_dflash, describe=format_dflash_eval, memory_shape=block_shape,
                             **_FUSED),
    # DSpark is DFlash plus its Markov head: DFlash's objective, evaluation and store
    "dspark": TrainingFamily("dspark", recipe=DSparkRecipe, build=build_dspark, loss_parts="per block slot",
                             evaluate=evaluate_dflash, describe=format_dflash_eval, memory_shape=block_shape,
                             **_FUSED),
    # DFlash2 is DFlash plus its convolutions and path selector: DFlash's objective (+ the selector's term), evaluation
    # and store
    "dflash2": TrainingFamily("dflash2", recipe=DFlash2Recipe, build=build_dflash2, loss_parts="per block slot",
                              evaluate=evaluate_dflash, describe=format_dflash_eval, memory_shape=block_shape,
                              **_FUSED),
    "peagle": TrainingFamily("peagle", recipe=PEagleRecipe, build=build_peagle, loss_parts="per depth",
                             evaluate=evaluate_peagle, describe=format_peagle_eval, **_FUSED),
    # EAGLE-3's training-time test (stage 1), then the candidate head alone (stage 2, Eagle4Run); online only
    "eagle4": TrainingFamily("eagle4", recipe=Eagle4Recipe, build=build_eagle4, loss_parts="per TTT step",
                             run=Eagle4Run, inputs=target_inputs_fn, draft_vocab=True, evaluate=evaluate_eagle4,
                             describe=format_eagle4_eval, init_layer=lambda recipe: recipe.eagle3.init_layer,
                             grow_layers=lambda recipe: recipe.eagle3.grow_layers),
    "eagle1": TrainingFamily("eagle1", recipe=Eagle1Recipe, build=build_eagle1, loss_parts="feature, token",
                             run=FeatureRun, store_layout="eagle1", layer_spec=eagle1_layer_spec,
                             inputs=eagle1_inputs_fn, evaluate=evaluate_eagle1, describe=format_eval),
    "medusa": TrainingFamily("medusa", recipe=MedusaRecipe, build=build_medusa, **_HEADS),
    "blockwise": TrainingFamily("blockwise", recipe=BlockwiseRecipe, build=build_blockwise, **_HEADS),
    # the target's own MTP layer, read from its checkpoint; hard CE on the data's tokens; online only
    "mtp": TrainingFamily("mtp", recipe=MtpRecipe, build=build_mtp, loss_parts="per chain step", run=FeatureRun,
                          inputs=mtp_inputs_fn, evaluate=evaluate_mtp, describe=format_eval),
}
DEFAULT_FAMILY = "eagle3"  # a recipe that names no `drafter`


def load_recipe(argv: list[str], default: str = DEFAULT_FAMILY):
    """The recipe of argv (RECIPE.yaml [key=value ...]) in the schema of its `drafter`'s family, every problem
    named at once. Each family's own options sit in its section (`eagle3:`, `dflash:`, ...); keys an earlier
    release read at the top level (EAGLE-3's) are moved there with a deprecation line. A field another family reads
    is refused with the families that read it, unless it holds that family's default (a recipe copied from another
    family's keeps working; nothing it says is lost)."""
    raw, overrides = read_moved(argv)
    name = raw.get("drafter", default)
    if not isinstance(name, str) or name not in TRAINING_FAMILIES:
        close = difflib.get_close_matches(str(name), TRAINING_FAMILIES, n=1)
        raise RecipeError(f"{argv[0]}: drafter={name!r} is not a family this trainer trains; choose one of "
                          f"{', '.join(TRAINING_FAMILIES)}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    foreign, dropped = drop_foreign(raw, name)
    overrides = [o for o in overrides if o.partition("=")[0].strip().split(".")[0] not in dropped]
    recipe = load_train_recipe([argv[0], *overrides], TRAINING_FAMILIES[name].recipe, lambda recipe: foreign, raw=raw)
    if recipe.stages is not None:  # every stage's keys and values checked here, before any stage trains
        stage_recipes(argv, recipe, default)
    return recipe


def stage_recipes(argv: list[str], recipe, default: str = DEFAULT_FAMILY) -> list[tuple[Stage, object]]:
    """recipe.stages (drafters.training.stages) -> (stage, its recipe) in order; a stage's unknown key or wrong
    value is refused naming the stage."""
    stages = plan_stages(argv[0], recipe.stages, recipe.output_dir, type(recipe))
    planned = []
    for previous, stage in zip([None, *stages], stages):
        try:
            planned.append((stage, load_recipe(stage_argv(argv, stage, previous), default)))
        except RecipeError as err:
            raise RecipeError(f"{argv[0]}: {stage.label}: {err}") from None
    return planned


def read_moved(argv: list[str]) -> tuple[dict, list[str]]:
    """The recipe file with its overrides applied, every key an earlier release read at the top level moved into its
    section (the file's and the overrides', which still win over the file) and said once -> (raw, the overrides)."""
    moved = {key: section for entry in TRAINING_FAMILIES.values() for key, section in entry.recipe.moved_keys.items()}
    raw = read_recipe(argv[0])
    old = move_old_keys(raw, moved, argv[0])
    old += [key for key in (o.partition("=")[0].strip() for o in argv[1:]) if key in moved and key not in old]
    overrides = [moved_override(override, moved) for override in argv[1:]]
    for override in overrides:
        apply_override(raw, override)
    if old and os.environ.get("RANK", "0") == "0":  # once per launch, not once per process
        print(deprecation(argv[0], old, moved), file=sys.stderr)
    return raw, overrides


def drop_foreign(raw: dict, name: str) -> tuple[list[str], set[str]]:
    """Removes from `raw` the fields only other families read -> (the refusals of those not at their defaults, the
    fields removed)."""
    # family -> field -> its default, for every family's schema
    defaults = {other: fields_of(entry.recipe) for other, entry in TRAINING_FAMILIES.items()}
    foreign, dropped = [], set()
    for key in [k for k in raw if k not in defaults[name]]:
        readers = [other for other, fields in defaults.items() if key in fields]
        if not readers:
            continue  # not a field of any family: the schema names it (with a close match)
        # another family's default says nothing this family could read; any other value is refused
        value = raw.pop(key)
        dropped.add(key)
        said = next((lines for reader in readers if (lines := changed(key, value, defaults[reader][key]))), [])
        if said:
            foreign.append(f"{', '.join(said)} {'is' if len(said) == 1 else 'are'} read by drafter: "
                           f"{', '.join(readers)} only, not {name}; remove {'it' if len(said) == 1 else 'them'}")
    return foreign, dropped


def fields_of(schema: type) -> dict:
    """{field name: its default as plain data} of a recipe schema."""
    return {f.name: field_default(f) for f in dataclasses.fields(schema)}


_ABSENT = object()  # a key the default does not hold


def changed(key: str, value, default) -> list[str]:
    """key=value for each value a recipe sets away from its default (a section's, dotted: eagle3.ttt_steps=3); null
    says nothing, a key the default lacks is always said."""
    if isinstance(value, dict) and isinstance(default, dict):
        return [line for k, v in value.items() for line in changed(f"{key}.{k}", v, default.get(k, _ABSENT))]
    return [] if default is not _ABSENT and (value is None or value == default) else [f"{key}={value}"]


def train_main(argv: list[str], script: str, default: str = DEFAULT_FAMILY) -> Summary:
    """The training entry point (train/train.py, and its aliases train/eagle.py and train/heads.py)."""
    if not argv:
        raise SystemExit(f"usage: python {script} RECIPE.yaml [key=value ...]   (any family: the recipe's `drafter`)")
    recipe = load_recipe(argv, default)
    try:
        summary = train(recipe) if recipe.stages is None else train_stages(argv, recipe, default)
    except Finished as done:  # run again for its measure (one that stopped there): nothing to train, measure it
        if recipe.measure is None:
            raise
        print(f"{recipe.drafter}: {recipe.output_dir} finished training at this recipe's last step; measuring "
              f"its checkpoint-final ({done})")
        summary = None
    if recipe.measure is not None and os.environ.get("RANK", "0") == "0":
        if summary is not None:  # its target and drafter go before the decoder loads them again
            summary.target = summary.drafter = None
        measure_trained(recipe.target, Path(recipe.output_dir) / "checkpoint-final", Path(recipe.output_dir),
                        recipe.measure, recipe.threads, print)
    return summary


def train_stages(argv: list[str], recipe, default: str = DEFAULT_FAMILY) -> Summary | None:
    """A recipe's stages (drafters.training.stages), trained in order into output_dir/stage-<i>-<name>/, each from
    the previous one's checkpoint-final; finished stages are skipped, an interrupted one resumes, and
    output_dir/checkpoint-final ends as a link to the last stage's. Every stage's input is checked before the first
    trains. -> the last trained stage's Summary (None when every stage had finished before)."""
    if recipe.overwrite_output_dir:
        raise RecipeError("overwrite_output_dir=true with stages: a recipe with stages continues its stages when run "
                          "again; to train a stage again, remove its folder (output_dir/stage-<i>-<name>) and those "
                          "of the stages after it")
    check_output_dir(recipe.output_dir)
    planned = stage_recipes(argv, recipe, default)
    offline = TRAINING_FAMILIES[recipe.drafter].offline
    for stage, stage_recipe in planned:  # before any work: hours of early stages never end on a later one's input
        problem = check_finished_stage(stage, stage_recipe) if finished(stage) else \
            missing_input(argv, stage, stage_recipe, offline)
        if problem:
            raise RecipeError(problem)
    say = print if os.environ.get("RANK", "0") == "0" else (lambda line: None)
    summary = None
    for stage, stage_recipe in planned:
        if finished(stage):
            say(f"{stage.label}: finished ({stage.final}), skipped")
            continue
        say(f"{stage.label}: training into {stage.directory}"
            + (f" from {stage_recipe.init_from}" if stage_recipe.init_from else ""))
        summary = None  # the previous stage's target and drafter go before the next stage loads its own
        summary = train_stage(stage, stage_recipe)
    link = link_final(recipe.output_dir, planned[-1][0])
    say(f"stages: {len(planned)} done; {link} -> {planned[-1][0].final}")
    return summary


def train_stage(stage: Stage, recipe) -> Summary:
    try:
        return train(recipe, tag=f"{recipe.drafter} stage {stage.index}")
    except Stopped as err:
        raise Stopped(f"{stage.label}: {err}; or run the same command again: finished stages are skipped and this "
                      "one resumes") from None
    except RecipeError as err:
        raise type(err)(f"{stage.label}: {err}") from None


def check_finished_stage(stage: Stage, recipe) -> str | None:
    """A finished stage is skipped only when its checkpoint was trained by the stage as the recipe says it now."""
    saved = json.loads((stage.final / "drafter.json").read_text()).get("extra", {}).get("recipe", {})
    move_old_keys(saved, type(recipe).moved_keys, str(stage.final))
    # init_from is the previous stage's checkpoint-final, however output_dir was spelled
    diff = [line for line in recipe_diff(saved, to_dict(recipe), schema=type(recipe))
            if not line.startswith("init_from:")]
    if not diff:
        return None
    return (f"{stage.label} finished with another recipe than it has now ({'; '.join(diff[:3])}); remove "
            f"{stage.directory} and the later stages' folders to train them again with this one, or restore the "
            "values")


def train(recipe, tag: str | None = None) -> Summary:
    """One training run of recipe.drafter's family; `tag` (default: the family's name) prefixes its printed lines."""
    family = TRAINING_FAMILIES[recipe.drafter]
    tag = tag or recipe.drafter
    # from a store, the target's forward never runs: its decoder layers stay on disk (unless a layer initialises
    # the drafter: EAGLE-3's eagle3.init_layer)
    from_store = family.offline and bool(recipe.features.dir) and family.init_layer(recipe) is None
    if family.offline and recipe.features.dir and recipe.features.make and not store_finished(recipe.features.dir):
        if os.environ.get("RANK", "0") == "0":
            print(f"{tag}: features.make: making the store in {recipe.features.dir} first (resumable: an interrupted "
                  "store continues when the command is run again)")
        make_store(recipe, family, where=f"{tag}: features.make")
    accelerator, target, resume, train_rows, held_out = start_run(recipe, tag, decoder=not from_store)
    say = accelerator.print
    store = None
    if family.offline and recipe.features.dir:  # refuses features computed for other data, target or feature
        store = FeatureStore.open(recipe.features.dir)
        store.check(recipe, target, family)
        say(store.summary())
    family.check_rows(recipe, train_rows)
    # init_from: refused here, before any work, when it cannot start this run. A resumed run whose init_from is gone
    # takes its weights and vocabulary from its own checkpoint instead, which is grown already (init_from_gone)
    gone = init_from_gone(recipe, resume)
    start = load_checkpoint(resume) if gone else initial_checkpoint(recipe, target)
    grow_vocab = family.draft_vocab and recipe.grow_vocab and not gone  # only a draft vocabulary grows
    vocab = None
    if family.draft_vocab:  # init_from's vocabulary as it is, or (grow_vocab, or a fresh run) counted on this data
        kept = initial_vocab(start) if start is not None else None
        vocab = kept if kept is not None and not grow_vocab else \
            choose_draft_vocab(recipe, target, train_rows, say, keep=kept)
    set_seed(recipe.seed)  # the drafter's initialisation and nothing before it
    objective = family.build(recipe, target, train_rows, vocab, say)
    if gone:
        load_resumed_weights(objective.drafter, start, recipe.init_from, say)
    elif start is not None:  # (a resumed run then loads its own on top)
        load_initial_weights(objective.drafter, start, say, grow_vocab=grow_vocab,
                             grow_layers=family.grow_layers(recipe))
    pad = pad_id(target)
    loader = train_loader(recipe, train_rows, pad) if store is None else offline_loader(recipe, store, train_rows, pad)
    eval_batches = length_sorted_batches(held_out, recipe.batch_size)
    eval_batches = [collate(batch, pad) for batch in eval_batches] if store is None else \
        offline_batches(store, eval_batches, pad)
    if not eval_batches:
        say(f"{tag}: no held-out rows (data.eval_rows / eval_fraction): no held-out evaluation will run")
    return fit(recipe, accelerator, target, objective, loader, eval_batches, train_rows, resume, family, tag)
