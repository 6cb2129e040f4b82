"""Drafter losses as pure functions of tensors.

Knows nothing about models, positions or label shifting: callers align `draft_logits[:, t]`
with the target row that is its label (see `drafters.eagle3.ttt_label_rows`) before calling.
Metrics stay tensors (no host sync); call `.item()` at log steps only.
"""

import torch
from torch import Tensor


class HeadRows:
    """The target's logits at chosen rows only, computed on demand: the label side of a loss without the
    (B, T, V) tensor (V = 49k for SmolLM2, 262k for Gemma-3) that a full LM head pass materialises.
        hidden (B, T, h): the final-normed last hidden state (HF hidden_states index L)
        head: (N, h) -> (N, V), the target's frozen head (lm_head, then its logit softcap if any)
    rows[mask] (mask (B, T) bool) = head(hidden[mask]) (N, V) = full_logits[mask], as a tensor would be
    indexed: code written for a (B, T, V) logits tensor that only reads it at masked rows takes either.
    Online and offline training build it the same way, so their labels are computed identically."""

    def __init__(self, hidden: Tensor, head):
        self.hidden, self.head = hidden, head

    def __getitem__(self, mask: Tensor) -> Tensor:
        return self.head(self.hidden[mask])


def draft_vocab_ids(t2d: Tensor, draft_vocab_size: int) -> Tensor:
    """(N,) target ids kept by the draft vocab, ascending (= arange(N) + d2t); no host sync."""
    return torch.argsort((~t2d).to(torch.int8), stable=True)[:draft_vocab_size]


@torch.no_grad()
def draft_vocab_targets(target_logits: Tensor, t2d: Tensor, draft_vocab_size: int):
    """target_logits (B, T, V) (or any leading shape, e.g. (N, V) gathered rows) -> what the
    EAGLE-3 loss needs from the target, per position:
        target_p (B, T, Vd) float32 = softmax(target_logits[..., used])  renormalised over the vocab
        in_vocab (B, T) bool        = t2d[argmax_V target_logits]        FULL-vocab argmax is kept
        argmax_draft (B, T) long    = draft id of that argmax (meaningful where in_vocab)"""
    used = draft_vocab_ids(t2d, draft_vocab_size)
    target_argmax = target_logits.argmax(-1)  # (B, T) over the full target vocab
    draft_index = t2d.long().cumsum(0) - 1  # (V,) target id -> draft id where t2d
    target_p = torch.softmax(target_logits.index_select(-1, used).float(), dim=-1)
    return target_p, t2d[target_argmax], draft_index[target_argmax]


def soft_cross_entropy(draft_logits: Tensor, target_p: Tensor, in_vocab: Tensor,
                       argmax_draft: Tensor, loss_mask: Tensor, *,
                       num_positions: int | Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """draft_logits (B, T, Vd); the other inputs from `draft_vocab_targets`; loss_mask (B, T) 0/1.
    Any leading shape works, e.g. (M, Vd) rows gathered at the counted positions only (with an
    all-ones mask): the sums, hence loss, accuracy and gradients, are the same.
        counted_t = loss_mask_t and in_vocab_t
        loss = sum_t counted_t * (-sum_d target_p_td log_softmax(draft_logits_t)_d) / num_positions
               (num_positions defaults to count = sum_t counted_t: the mean over counted positions)
        accuracy = mean over counted t of [argmax draft_logits_t == argmax_draft_t]
    Returns (loss, accuracy, count), 0-dim tensors; loss and accuracy are 0 when count is 0."""
    counted = loss_mask.bool() & in_vocab  # (B, T)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)  # (B, T, Vd)
    ce = -(target_p * log_q).sum(-1)  # (B, T)
    count = counted.sum()
    denominator = count.clamp(min=1) if num_positions is None else num_positions
    loss = torch.where(counted, ce, 0.0).sum() / denominator
    with torch.no_grad():
        correct = (draft_logits.argmax(-1) == argmax_draft) & counted
        accuracy = correct.sum() / count.clamp(min=1)
    return loss, accuracy, count


def soft_cross_entropy_draft_vocab(draft_logits: Tensor, target_logits: Tensor, t2d: Tensor,
                                   loss_mask: Tensor, *, num_positions: int | Tensor | None = None
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    """EAGLE-3 token loss against the target distribution renormalised over the draft vocab.

    draft_logits (B, T, Vd), target_logits (B, T, V) = the label rows, t2d (V,) bool,
    loss_mask (B, T). Positions whose full-vocab target argmax is outside the draft vocab are
    masked; accuracy compares the draft argmax, mapped to a target id, with the target argmax.
    -> (loss, accuracy, count) as in `soft_cross_entropy`."""
    targets = draft_vocab_targets(target_logits, t2d, draft_logits.shape[-1])
    return soft_cross_entropy(draft_logits, *targets, loss_mask, num_positions=num_positions)
