"""Train Medusa-1 or Blockwise heads on a frozen target, online: target features are computed per batch.

    accelerate launch train/heads.py recipes/medusa_smollm2.yaml [key=value ...]
    python train/heads.py recipes/blockwise_tiny.yaml max_steps=3 output_dir=/tmp/run

What is trained and how (flow, losses, the held-out calibration of the draft tree): drafters.training.heads.

Writes to output_dir (relative paths in the recipe are relative to the current directory):
    metrics.jsonl       one row per optimizer step; step_loss / step_acc / step_acc_top5 are per head
    eval.jsonl          one row per held-out evaluation (per-head top-1 / top-5, tree, tau_pred)
    checkpoint-{step}/  every save_every steps (resumable), and checkpoint-final/ (drafters.checkpoint
                        format, family medusa | blockwise); evaluated checkpoints hold the calibrated
                        tree in drafter.json (extra.tree) and as tree.json (rank paths, usable as
                        `--tree static:CHECKPOINT/tree.json`)
Metrics come from the main process's batches; tokens/s counts real (non-pad) tokens of all
processes. The library is drafters.training.heads; the run is drafters.training.families.train.
"""

from drafters.training.families import load_recipe, train
from drafters.training.heads import HeadsRecipe
from drafters.training.loop import Summary
from drafters.training.recipe import run_main

Recipe = HeadsRecipe  # this script's schema (tests/test_recipes.py reads each script's `Recipe`)


def main(argv: list[str]) -> Summary:
    if not argv:
        raise SystemExit("usage: python train/heads.py RECIPE.yaml [key=value ...]")
    return train(load_recipe(argv, "train/heads.py"), "heads")


if __name__ == "__main__":
    run_main(main)
