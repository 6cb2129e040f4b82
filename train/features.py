"""Precompute a drafter family's target features once, to disk, for offline training (drafters.training.features).

    python train/features.py recipes/eagle3_smollm2.yaml features.dir=outputs/features/smollm2 [key=value ...]
    python train/train.py recipes/eagle3_smollm2.yaml features.dir=outputs/features/smollm2

Reads the same recipe (and overrides) as train/train.py: target, dtype, data, drafter, layers (EAGLE-3) or
eagle1.feature (EAGLE-1) and
the `features` section: dir (required here: where to write; training streams from it when set), dtype
(bfloat16 | float16 | float32 storage), shard_rows; batch_size is the target's forward batch. Runs the
target over ALL usable examples (the train / held-out split is made at training time, so eval_rows /
eval_fraction / data.seed may change afterwards) and writes index.json + safetensors shards. Rerunning
with the same recipe resumes: finished shards are skipped. After the data file grows or changes, rerunning with
features.update=true keeps every shard whose rows are unchanged and computes the rest (appended rows: only the last
shard and the new ones); without it such a store is refused. Prints the storage in bytes per token. Under
`accelerate launch` or torchrun with N processes, each process computes every N-th shard on its own device and
the store is the one a single process writes (drafters.training.features).
EAGLE-3 stores the fused aux layers and the final-normed hidden state (for the soft labels); EAGLE-1 its
one feature.
"""

import torch

from drafters.files import check_writable
from drafters.targets import load_target
from drafters.training.batches import max_length_for
from drafters.training.data import build_examples
from drafters.training.families import TRAINING_FAMILIES, load_recipe
from drafters.training.features import Processes, features_header, write_features
from drafters.training.recipe import RecipeError, run_main

def main(argv: list[str]) -> dict:
    if not argv:
        raise SystemExit("usage: python train/features.py RECIPE.yaml features.dir=DIR [key=value ...]")
    recipe = load_recipe(argv)
    family = TRAINING_FAMILIES[recipe.drafter]
    if not family.offline:
        raise RecipeError(f"{argv[0]}: drafter={recipe.drafter} trains online only (a target forward per batch); "
                          "there are no features to store for it")
    if not recipe.features.dir:
        raise RecipeError("features.dir is not set: pass features.dir=DIR (where to write the features; "
                          "train/train.py streams from it when the recipe sets it)")
    if recipe.split_target:
        raise RecipeError("split_target=true is for training: train/features.py gives each process its own shards "
                          "and the whole target; set split_target=false here (the store then trains a run that "
                          "loads no decoder layer at all)")
    check_writable(recipe.features.dir, "features.dir=", directory=True)  # before the target loads
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    processes, device = launched_processes()
    target = load_target(recipe.target, dtype=recipe.dtype)
    target.model.to(device)
    header = features_header(recipe, target, family)
    data = recipe.data
    say = print if processes.rank == 0 else lambda line: None
    max_length = max_length_for(target, data.max_length, say)
    examples, report = build_examples(target.tokenizer, data.path, max_length=max_length, fmt=data.fmt,
                                      split=data.split, limit=data.limit, reasoning=data.reasoning,
                                      template_kwargs=data.chat_template_kwargs)
    say(report.summary())
    return write_features(recipe.features.dir, target, examples, header, batch_size=recipe.batch_size,
                          processes=processes, update=recipe.features.update)


def launched_processes() -> tuple[Processes, torch.device]:
    """One process, or the processes `accelerate launch` / torchrun started (gloo on CPUs): each writes its share
    of the shards on its own device."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.accelerator.is_available())
    return Processes(state.process_index, state.num_processes, state.wait_for_everyone), state.device


if __name__ == "__main__":
    run_main(main)
