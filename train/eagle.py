"""Train an EAGLE-3, EAGLE-1 or DFlash drafter on a frozen target (target features online per batch, or offline).

    accelerate launch train/eagle.py recipes/eagle3_smollm2.yaml [key=value ...]
    python train/eagle.py recipes/eagle3_tiny.yaml max_steps=3 output_dir=/tmp/run

Flow: recipe -> frozen target -> examples (chat template + assistant loss mask) -> deterministic
train / held-out split -> draft vocabulary counted on the TRAIN examples under the loss mask ->
Eagle3Drafter (lm_head = the target LM head's rows of the draft vocabulary) -> AdamW with linear
warmup then cosine or constant lr -> loop: target features (aux layers + logits, no grad) ->
training-time test unroll -> backward -> clip -> step.
EAGLE-1 (`drafter: eagle1`, drafters.eagle1 / drafters.training.eagle1): Eagle1Drafter on the target's
frozen head and embedding, no draft vocabulary; features = the last hidden state (eagle1.feature) +
logits; loss = eagle1.feature_weight * SmoothL1(feature_{t+1}) + eagle1.token_weight * soft CE(token
t+2), U(-eagle1.noise, eagle1.noise) on the input features while training; metrics.jsonl step_loss =
[feature, token] loss, step_acc = its top-1.
DFlash (`drafter: dflash`, drafters.dflash / drafters.training.dflash): the same fused aux layers, soft labels
and draft vocabulary as EAGLE-3; per row dflash.anchors blocks of dflash.block_size slots at random eligible
anchors, loss weights exp(-(j-1) / dflash.gamma) per slot j; metrics.jsonl step_loss / step_acc = per slot.
With features.dir set (EAGLE-3, DFlash or EAGLE-1) the features are streamed from
what `python train/features.py RECIPE` precomputed (drafters.training.features) instead of running the target;
EAGLE-3's soft labels come from the stored final hidden state through the frozen head, at supervised rows.
optim.clip_value (null = off) clips each gradient element before max_grad_norm clips the norm.

Writes to output_dir (relative paths in the recipe are relative to the current directory):
    metrics.jsonl       one row per optimizer step (rewritten by each run), flushed at log steps
    eval.jsonl          one row per held-out evaluation
    checkpoint-{step}/  every save_every steps, and checkpoint-final/ (drafters.checkpoint format)
Metrics come from the main process's batches; tokens/s counts real (non-pad) tokens of all
processes. The run is drafters.training.families.train over the family's TrainingFamily entry.
"""

from drafters.training.eagle3 import EagleRecipe
from drafters.training.families import load_recipe, train
from drafters.training.loop import Summary
from drafters.training.recipe import run_main

Recipe = EagleRecipe  # this script's schema (tests/test_recipes.py reads each script's `Recipe`)


def main(argv: list[str]) -> Summary:
    if not argv:
        raise SystemExit("usage: python train/eagle.py RECIPE.yaml [key=value ...]")
    return train(load_recipe(argv, "train/eagle.py"), "eagle")


if __name__ == "__main__":
    run_main(main)
