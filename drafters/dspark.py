"""DSpark drafter: DFlash (drafters.dflash) plus a semi-autoregressive Markov head. One drafter pass still
drafts the whole block; a low-rank bias keyed on the previous block token is then added to each slot's logits,
so the block is drafted left to right at the cost of one (R -> Vd) product per slot. An optional confidence head
scores each slot's draft, so an engine can stop verifying the block where the drafter expects a rejection.

Module names are speculators' `dspark` and llama.cpp's DSpark converter's (`markov_head.markov_w1`,
`markov_head.markov_w2`, `confidence_head.proj`, and DFlash's backbone names), so export is a rename at most.

The slots (docs/conventions.md "DSpark"): DFlash's block [x_a, M, ..., M] at positions a .. a+B-1; slot j
(1 <= j <= B-1) drafts token a+j (speculators' and llama.cpp's `sample_from_anchor: false`). With
prev_j = the token before slot j's (x_a for j = 1; the token drafted at slot j-1 otherwise; while training, the
true token a+j-1) and normed_j the block stream after the final norm (h):
    e_j        = W1[prev_j]                           W1 (V, R): an embedding over the TARGET vocabulary
    logits_j   = head(normed_j) + W2 e_j              W2 (Vd, R), no bias: a rank-R bias over the draft vocabulary
    conf_j     = sigmoid(proj([normed_j ; e_j]))      proj (H+R -> 1) with bias: P(slot j's draft is accepted)
Variant `vanilla` (the only one llama.cpp runs) is exactly this: linear, no gate. W2 starts at zero, so a
DSpark drafter starts as the DFlash drafter of the same seed.

What differs from DFlash: the slots are no longer independent given the context. A tree node at depth d-1
holding token t proposes its children from softmax(head(normed_d) + W2 W1[t]): siblings' subtrees differ, and a
chain is drafted greedily slot by slot (prev = the previous slot's argmax), as llama.cpp does in its graph.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafters.dflash import DFlashConfig, DFlashDrafter

VARIANTS = ("vanilla",)  # llama.cpp's converter refuses any other markov_head_type


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 64  # R; speculators' default is 256 (for 4k-wide Qwen3 targets)
    markov_head_type: str = "vanilla"
    confidence_head: bool = False  # proj over [normed ; W1[prev]] (speculators' confidence_head_with_markov)

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 1:
            problems.append(f"markov_rank={self.markov_rank!r} must be an integer >= 1 (a DSpark drafter without a "
                            "Markov head is a DFlash drafter: train drafter: dflash)")
        if self.markov_head_type not in VARIANTS:
            problems.append(f"markov_head_type={self.markov_head_type!r} must be one of {', '.join(VARIANTS)}")
        if not isinstance(self.confidence_head, bool):
            problems.append(f"confidence_head={self.confidence_head!r} must be true or false")
        if problems:
            raise ValueError("DSpark config: " + "; ".join(problems))

    @classmethod
    def from_target_config(cls, config, draft_vocab_size: int, *, markov_rank: int = 64,
                           markov_head_type: str = "vanilla", confidence_head: bool = False,
                           **dflash) -> "DSparkConfig":
        base = DFlashConfig.from_target_config(config, draft_vocab_size, **dflash)
        fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
        return cls(**fields, markov_rank=markov_rank, markov_head_type=markov_head_type,
                   confidence_head=confidence_head)


class MarkovHead(nn.Module):
    """bias(prev) = W2 W1[prev]: (...,) target ids -> (..., Vd)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' initialisation
        nn.init.zeros_(self.markov_w2.weight)  # the bias starts at 0: DSpark starts as DFlash

    def forward(self, prev: Tensor) -> tuple[Tensor, Tensor]:
        e = self.markov_w1(prev)  # (..., R)
        return self.markov_w2(e), e  # (..., Vd), (..., R)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, normed: Tensor, e: Tensor) -> Tensor:
        return self.proj(torch.cat([normed, e.to(normed.dtype)], -1)).squeeze(-1)  # (...,) logits


class DSparkDrafter(DFlashDrafter):
    def __init__(self, config: DSparkConfig, draft_vocab=None):
        super().__init__(config, draft_vocab)
        c = config
        self.markov_head = MarkovHead(c.vocab_size, c.draft_vocab_size, c.markov_rank)
        self.confidence_head = ConfidenceHead(c.hidden_size, c.markov_rank) if c.confidence_head else None

    fused_loss = False  # the Markov bias joins the head's logits: the loss needs them (no fused head + CE)

    def slot_logits(self, normed: Tensor, prev: Tensor) -> Tensor:
        """normed (..., h) slots' outputs, prev (...,) the target id before each slot -> (..., Vd)."""
        bias, _ = self.markov_head(prev)
        return self.compute_logits(normed) + bias.to(normed.dtype)

    def confidence_logits(self, normed: Tensor, prev: Tensor) -> Tensor:
        """-> (...,) logit of P(the slot's draft is accepted); sigmoid gives llama.cpp's confidence."""
        _, e = self.markov_head(prev)
        return self.confidence_head(normed, e)
