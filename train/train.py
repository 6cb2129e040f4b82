"""Train a drafter of any family on a frozen target: the recipe's `drafter` picks it.

    accelerate launch train/train.py recipes/eagle3_smollm2.yaml [key=value ...]
    python train/train.py recipes/dflash_tiny.yaml max_steps=3 output_dir=/tmp/run

Families (drafters.training.families.TRAINING_FAMILIES; each one's recipe fields and checks are its schema in its
own training module): eagle3 (drafters.training.eagle3), eagle1, dflash, dspark, peagle, medusa and blockwise
(drafters.training.heads). What every family shares (target, data, optim, batches, steps, checkpoints) sits at the
recipe's top level, each family's own options in its section (eagle3:, dflash:, medusa:, ...). A recipe that names
no `drafter` trains eagle3. Every recipe's first line names this script; train/eagle.py is its documented alias and
train/heads.py another (whose default family is medusa).

Flow: recipe -> frozen target -> examples (chat template + assistant loss mask) -> deterministic train / held-out
split -> the family's drafter (draft vocabulary counted on the TRAIN examples under the loss mask, where the family
drafts over one) -> AdamW with linear warmup then cosine or constant lr -> loop: the target's features (online, or
from what `python train/features.py RECIPE` stored: features.dir) -> the family's loss -> backward -> clip -> step.
optim.clip_value (null = off) clips each gradient element before max_grad_norm clips the norm.

Writes to output_dir (relative paths in the recipe are relative to the current directory):
    metrics.jsonl       one row per optimizer step (rewritten by each run), flushed at log steps; step_loss /
                        step_acc list the family's loss parts (per TTT step, block slot, depth or head)
    eval.jsonl          one row per held-out evaluation
    checkpoint-{step}/  every save_every steps, and checkpoint-final/ (drafters.checkpoint format); both resume:
                        resume_from=latest with a higher max_steps continues a finished run from its end
Metrics come from the main process's batches; tokens/s counts real (non-pad) tokens of all processes.
"""

from drafters.training.families import train_main
from drafters.training.loop import Summary
from drafters.training.recipe import run_main



def main(argv: list[str]) -> Summary:
    return train_main(argv, "train/train.py")


if __name__ == "__main__":
    run_main(main)
