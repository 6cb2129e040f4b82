"""What the two multi-head drafter families (drafters.medusa, drafters.blockwise) share: the interface
the trainer, the calibration and the proposer are written against, the label alignment, the loss.

A heads drafter reads one feature, the target's final-normed last hidden state x_t (HF hidden-state
index L), and has K heads. Head k (counted from 0) predicts token t+k+2 from x_t: the target's own
LM head predicts t+1, so at decoding time the target's prediction is the tree's root (the pending
token) and head k drafts depth k+1. Both families implement (as an nn.Module):

    config.num_heads
    states(x, heads)          x (..., d) -> (..., len(heads), d): the selected heads' hidden states
    project(h, k, lm_head)    h (..., d) -> (..., V): head k's vocabulary projection, its own weight
                              or the frozen target LM head weight `lm_head` (V, d) handed in

The target's weights are never a submodule of a drafter: they arrive as arguments. This module knows
nothing about the families' insides, the target model, data files or trees.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from drafters.losses import in_row_chunks

TOPK_METRIC = 5  # the "top-5" of the per-head metrics


def head_label_mask(loss_mask: Tensor, k: int) -> Tensor:
    # (B, T) -> (B, T) bool: position t trains head k iff token t+k+2 exists and is a target
    # (loss_mask[t+k+2] = 1); the last k+2 positions never do.
    shift = k + 2
    out = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    out[:, : max(loss_mask.shape[1] - shift, 0)] = loss_mask[:, shift:].bool()
    return out


@dataclass
class HeadRows:
    """The positions of a batch that train at least one head, gathered once (one host sync)."""

    batch: Tensor  # (M,) batch index b of each row
    position: Tensor  # (M,) position t of each row
    mask: Tensor  # (K, M) bool: row m trains head k (token t+k+2 is a target)

    @staticmethod
    def of(loss_mask: Tensor, num_heads: int) -> "HeadRows":
        masks = torch.stack([head_label_mask(loss_mask, k) for k in range(num_heads)])  # (K, B, T)
        batch, position = masks.any(0).nonzero(as_tuple=True)  # (M,), (M,)
        return HeadRows(batch, position, masks[:, batch, position])

    def shifted(self, x: Tensor, shift: int, part: slice = slice(None)) -> Tensor:
        # x (B, T, ...) -> (M, ...) = x[b, t + shift] (rows `part` of them: (c, ...)); clamped past the end (those
        # rows are masked)
        return x[self.batch[part], (self.position[part] + shift).clamp(max=x.shape[1] - 1)]


@dataclass
class HeadsOutput:
    loss: Tensor  # () weighted sum of the selected heads' losses
    head_losses: Tensor  # (K,) mean CE of each head over its rows (0 for heads not selected)
    correct: Tensor  # (K,) rows whose top-1 is the label
    correct_top5: Tensor  # (K,) rows whose top-5 holds the label
    counts: Tensor  # (K,) rows each head was trained on (0 for heads not selected)


def heads_loss(drafter, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, lm_head: Tensor, *,
               weights: dict[int, float], teacher_logits: Tensor | None = None) -> HeadsOutput:
    """hidden (B, T, d) the target's last hidden state; input_ids, loss_mask (B, T); lm_head (V, d)
    the frozen target LM head weight; weights {head k: w_k} selects the heads to train; teacher_logits (B, T, V)
    or a drafters.losses.LabelLogits (read at one head's rows at a time).
        label of head k at t = input_ids[t+k+2]                       (data tokens), or
                               softmax(teacher_logits[t+k+1])         (distill: the target's own
                               distribution for token t+k+2, its argmax for the accuracies)
        CE_k = mean over the rows of head k of -sum_v label_v log softmax(project(state_k))_v
        loss = sum_k w_k CE_k
    Only rows that train some head are projected onto the vocabulary (the LM head dominates), a chunk of rows at a
    time (drafters.losses.in_row_chunks): the step never holds an (M, V) tensor per head."""
    num_heads = drafter.config.num_heads
    rows = HeadRows.of(loss_mask, num_heads)
    selected = sorted(weights)
    states = drafter.states(hidden[rows.batch, rows.position], selected)  # (M, S, d)
    zeros = hidden.new_zeros(num_heads, dtype=torch.float32)
    head_losses, correct, correct_top5, counts = zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone()
    loss = hidden.new_zeros((), dtype=torch.float32)
    for i, k in enumerate(selected):

        def head_rows(part: slice, i=i, k=k) -> tuple[Tensor, Tensor, Tensor]:
            # rows `part` (c of them) of head k -> (CE summed over its counted rows, top-1 hits, top-5 hits)
            logits = drafter.project(states[part, i], k, lm_head)  # (c, V)
            teacher = None if teacher_logits is None else rows.shifted(teacher_logits, k + 1, part)  # (c, V)
            labels = rows.shifted(input_ids, k + 2, part) if teacher is None else teacher.argmax(-1)  # (c,)
            mask = rows.mask[k, part]
            ce_sum = torch.where(mask, cross_entropy(logits, labels, teacher), 0.0).sum()
            with torch.no_grad():
                hits = logits.topk(min(TOPK_METRIC, logits.shape[-1]), dim=-1).indices == labels[:, None]  # (c, 5)
                return ce_sum, (hits[:, 0] & mask).sum(), (hits.any(-1) & mask).sum()

        # (M, V) logits a chunk of rows at a time, recomputed in backward (drafters.losses.in_row_chunks); every
        # head projects onto the target's V = lm_head.shape[0], its own weight or the target's
        ce_sum, correct[k], correct_top5[k] = in_row_chunks(head_rows, len(rows.batch), lm_head.shape[0])
        count = rows.mask[k].sum()
        head_loss = ce_sum / count.clamp(min=1)
        loss = loss + weights[k] * head_loss
        head_losses[k], counts[k] = head_loss.detach(), count
    return HeadsOutput(loss, head_losses, correct, correct_top5, counts)


def cross_entropy(logits: Tensor, labels: Tensor, teacher_logits: Tensor | None) -> Tensor:
    # logits (M, V); hard labels (M,) or the teacher's logits (M, V) -> (M,) float32 per-row CE
    if teacher_logits is None:
        return F.cross_entropy(logits.float(), labels, reduction="none")
    teacher = teacher_logits.float().softmax(-1)
    return -(teacher * logits.float().log_softmax(-1)).sum(-1)


@torch.no_grad()
def rank_hits(drafter, hidden: Tensor, target_logits: Tensor, loss_mask: Tensor, lm_head: Tensor,
              topk: int) -> tuple[Tensor, Tensor]:
    """Held-out calibration counts: for head k, the truth at t is the target's greedy token for
    t+k+2 (argmax of target_logits[t+k+1], what greedy verification accepts after a correct prefix).
        hits (K, topk): rows where head k's rank-r candidate is the truth
        counts (K,):    rows of head k"""
    num_heads = drafter.config.num_heads
    rows = HeadRows.of(loss_mask, num_heads)
    states = drafter.states(hidden[rows.batch, rows.position], list(range(num_heads)))  # (M, K, d)
    hits = torch.zeros(num_heads, topk, device=hidden.device)
    for k in range(num_heads):

        def head_rows(part: slice, k=k) -> tuple[Tensor]:
            logits = drafter.project(states[part, k], k, lm_head)  # (c, V)
            truth = rows.shifted(target_logits, k + 1, part).argmax(-1)  # (c,)
            ranked = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # (c, r)
            found = ((ranked == truth[:, None]) & rows.mask[k, part, None]).sum(0).float()  # (r,)
            return (torch.nn.functional.pad(found, (0, topk - len(found))),)

        hits[k] = in_row_chunks(head_rows, len(rows.batch), lm_head.shape[0])[0]
    return hits, rows.mask.sum(1).float()
