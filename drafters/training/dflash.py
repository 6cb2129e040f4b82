"""DFlash pieces of train/eagle.py (drafter: dflash): its recipe section, the mask token, the objective
accelerate prepares (anchors drawn from a generator whose state is checkpointed), the held-out evaluation.
The loop, logging, checkpointing and target inputs (fused aux layers + soft labels, online or from the
EAGLE-3 feature store) are train/eagle.py's and drafters.training.loop's, shared with EAGLE-3.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from drafters.dflash import LABELS, BlockOutput, DFlashConfig, DFlashDrafter, sample_anchors
from drafters.draft_vocab import DraftVocab


@dataclass
class DFlashOptions:
    block_size: int = 8  # B slots per block: the anchor + B-1 masks, B-1 drafts per drafter pass
    num_layers: int = 1  # drafter layers (the paper: 5 on Qwen3-8B)
    anchors: int = 32  # blocks per row and step, at random eligible anchors (fewer if the row has fewer)
    gamma: float = 4.0  # slot weight w_j = exp(-(j-1) / gamma); the paper: 4 at B = 8, 5 at B = 10, 7 at B = 16
    labels: Literal["soft", "argmax"] = "soft"  # CE against the target distribution or its argmax
    mask_token_id: int | None = None  # null: the lowest target id that no training row contains


def check_dflash(recipe) -> list[str]:
    """Problems with the dflash section of a train/eagle.py recipe (drafter: dflash only)."""
    if recipe.drafter != "dflash":
        return []
    o, problems = recipe.dflash, []
    if o.block_size < 2:
        problems.append(f"dflash.block_size={o.block_size} must be >= 2 (the anchor and at least one mask slot)")
    for name in ("num_layers", "anchors"):
        if getattr(o, name) < 1:
            problems.append(f"dflash.{name}={getattr(o, name)} must be >= 1")
    if not o.gamma > 0:
        problems.append(f"dflash.gamma={o.gamma} must be > 0")
    if o.labels not in LABELS:
        problems.append(f"dflash.labels={o.labels!r} must be one of {', '.join(LABELS)}")
    if o.mask_token_id is not None and (isinstance(o.mask_token_id, bool) or o.mask_token_id < 0):
        problems.append(f"dflash.mask_token_id={o.mask_token_id} must be a token id >= 0, or null")
    return problems


def choose_mask_token(rows, vocab_size: int, requested: int | None) -> int:
    """The mask token: `requested`, or the lowest id no training row contains (so the frozen embedding the
    drafter learns to read as "unknown" never stands for a real token of its data)."""
    if requested is not None:
        if requested >= vocab_size:
            raise ValueError(f"dflash.mask_token_id={requested} is not a token id of the target (vocab {vocab_size})")
        return requested
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for e in rows:
        seen[torch.as_tensor(e.input_ids, dtype=torch.long)] = True
    unseen = (~seen).nonzero()
    if not len(unseen):
        raise ValueError(f"dflash.mask_token_id: every one of the target's {vocab_size} ids occurs in the training "
                         "rows; set dflash.mask_token_id to a rare id explicitly")
    return int(unseen[0])


def build_dflash_drafter(recipe, target, vocab: DraftVocab, mask_token_id: int) -> DFlashDrafter:
    o = recipe.dflash
    config = DFlashConfig.from_target_config(target.config, vocab.size, mask_token_id=mask_token_id,
                                             layers=recipe.layers, num_layers=o.num_layers, block_size=o.block_size)
    drafter = DFlashDrafter(config, vocab).to(target.device)  # float32 master weights
    return drafter.attach_head(target.lm_head.weight.float())


class DFlashObjective(nn.Module):
    """What accelerate prepares: the anchored-block loss of `drafter` on one batch (same call signature as
    Eagle3Objective). Anchors come from a CPU generator seeded with the recipe's seed whose state is a
    buffer of this module, so accelerate's save_state / load_state carry it: a resumed run draws the
    anchors an uninterrupted run would."""

    def __init__(self, drafter: DFlashDrafter, options: DFlashOptions, seed: int = 0):
        super().__init__()
        self.drafter, self.options = drafter, options
        self.register_buffer("anchor_generator", torch.Generator().manual_seed(seed).get_state())  # uint8

    def forward(self, features, input_ids, target_logits, loss_mask, embed) -> BlockOutput:
        generator = torch.Generator()
        generator.set_state(self.anchor_generator.cpu())
        anchors, keep = sample_anchors(loss_mask, self.options.anchors, generator)
        self.anchor_generator.copy_(generator.get_state())
        o = self.options
        return self.drafter.block_forward(features, input_ids, target_logits, loss_mask, embed, anchors, keep,
                                          gamma=o.gamma, labels=o.labels)


@torch.no_grad()
def evaluate_dflash(drafter: DFlashDrafter, inputs, embed, batches: list[dict], recipe, accelerator) -> dict:
    """On the held-out rows, at anchors drawn from a generator seeded with recipe.seed afresh at every
    evaluation (the same blocks each time), per block slot k = 1 .. B-1 (slot k drafts the k-th token):
        acc_k          = correct top-1 / supervised slots (a target argmax outside the draft vocab is a miss)
        acc_in_vocab_k = correct top-1 / supervised slots whose target argmax is in the draft vocab
        tau_pred       = 1 + mean over blocks of the number of leading correct slots
    A block's slots are drafted together, so tau_pred is measured per block (not a product of acc_k, which
    would assume independent slots): the mean accepted length (bonus included) of a greedy chain of B-1
    drafts when the target's own argmax continues the data (as on regenerated data)."""
    drafter.eval()
    o, slots = recipe.dflash, recipe.dflash.block_size - 1
    generator = torch.Generator().manual_seed(recipe.seed)
    correct, counted, supervised = (torch.zeros(slots, device=accelerator.device) for _ in range(3))
    runs, blocks, loss = 0.0, 0, 0.0
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        features, target_logits = inputs(batch)
        anchors, keep = sample_anchors(batch["loss_mask"], o.anchors, generator)
        with accelerator.autocast():
            out = drafter.block_forward(features, batch["input_ids"], target_logits, batch["loss_mask"], embed,
                                        anchors, keep, gamma=o.gamma, labels=o.labels, return_logits=True)
        hit = (out.logits.argmax(-1) == out.labels) & (out.labels >= 0)  # (B, N, B-1)
        correct += hit.sum(dim=(0, 1))
        counted += out.step_counts
        supervised += out.step_supervised
        runs += float(hit.int().cumprod(-1).sum(-1)[keep].sum())  # leading correct slots per block
        blocks += int(keep.sum())
        loss += float(out.loss)
    return {"loss": loss / max(len(batches), 1), "step_acc": (correct / supervised.clamp(min=1)).tolist(),
            "step_acc_in_vocab": (correct / counted.clamp(min=1)).tolist(), "supervised": int(supervised[0]),
            "blocks": blocks, "tau_pred": 1 + runs / max(blocks, 1)}


def format_dflash_eval(result: dict) -> str:
    accuracy = " ".join(f"{a:.3f}" for a in result["step_acc"])
    return (f"eval @ step {result['step']}: loss {result['loss']:.4f}, per-slot top-1 accuracy [{accuracy}] over "
            f"{result['supervised']} supervised tokens; tau_pred (blocks of {len(result['step_acc'])} drafts, 1 + mean "
            f"leading correct slots over {result['blocks']} blocks) = {result['tau_pred']:.3f}")
