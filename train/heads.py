"""Train Medusa-1 or Blockwise heads on a frozen target, online: target features are computed per batch.

    accelerate launch train/heads.py recipes/medusa_smollm2.yaml [key=value ...]
    python train/heads.py recipes/blockwise_tiny.yaml max_steps=3 output_dir=/tmp/run

Flow: recipe -> frozen target -> examples (chat template + assistant loss mask) -> deterministic
train / held-out split -> heads (drafters.medusa: K heads of residual blocks + an LM head copied
from the target's, or the target's own with medusa.share_lm_head; drafters.blockwise: one hidden
layer d -> K*f -> K*d, residual per head, the frozen target LM head) -> AdamW with linear warmup then
cosine or constant lr -> loop: the target's last hidden state (and its logits when distilling; no
grad) -> per-head cross-entropy, head k on token t+k+2 (drafters.heads) -> backward -> clip -> step.

Losses: medusa  sum_k medusa.step_weight^k CE_k (0.8: Medusa's decay; 1.0: the plain sum)
        blockwise  mean_k CE_k, or (blockwise.loss=sample_one, the paper's memory-saving rule) the
                CE of one head drawn uniformly per micro-batch (the same head on every process)
        distill=true: CE against the target's own distribution for token t+k+2 (self-distillation)
                instead of the data token.
Held-out evaluation = calibration: per head, how often its rank-r candidate is the target's greedy
token; from these, the draft tree (tree.kind greedy: the tree.budget nodes of highest acceptance
probability, drafters.training.heads_tree) and its predicted mean accepted length tau_pred.

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
