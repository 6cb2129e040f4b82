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

from drafters.training.families import TRAINING_FAMILIES, load_recipe
from drafters.training.recipe import run_main
from drafters.training.store import make_store


def main(argv: list[str]) -> dict:
    if not argv:
        raise SystemExit("usage: python train/features.py RECIPE.yaml features.dir=DIR [key=value ...]")
    recipe = load_recipe(argv)
    return make_store(recipe, TRAINING_FAMILIES[recipe.drafter], where=argv[0])


if __name__ == "__main__":
    run_main(main)
