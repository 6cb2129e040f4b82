"""Reduced draft vocabulary for EAGLE-3: which target ids the drafter's LM head can emit.

Convention (docs/conventions.md, read by SGLang / vLLM / SpecForge checkpoints): the N kept target ids
`used` are sorted ascending; draft id i stands for target id `used[i]`;
    d2t[i] = used[i] - i   (int64, (N,))     target id = draft id + d2t[draft id]
    t2d[v] = v in used     (bool,  (V,))
Knows nothing about drafters, datasets or tokenizers: it counts ids it is handed.
"""

import logging
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor
from drafters.errors import UserError

logger = logging.getLogger(__name__)


class DraftVocabError(UserError):
    pass


@dataclass(frozen=True)
class DraftVocab:
    """The one owner of the draft <-> target id mapping; the two functions below are its sync-free forms
    for code that holds only the t2d buffer (the training loss)."""

    d2t: Tensor  # (N,) int64
    t2d: Tensor  # (V,) bool

    def __post_init__(self):
        _validate(self.d2t, self.t2d, source="DraftVocab")

    @property
    def size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def used(self) -> Tensor:  # (N,) target ids, ascending
        return torch.arange(self.size, device=self.d2t.device) + self.d2t

    @classmethod
    def from_used(cls, used: Tensor, target_vocab_size: int) -> "DraftVocab":
        used = torch.as_tensor(used, dtype=torch.long).sort().values
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[used] = True
        return cls(d2t=used - torch.arange(used.numel()), t2d=t2d)

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: Tensor) -> tuple[Tensor, Tensor]:
        """-> (draft ids, in-vocab mask); draft id is 0 where the target id is not in the vocab."""
        t2d = self.t2d.to(target_ids.device)
        in_vocab = t2d[target_ids]
        return torch.where(in_vocab, draft_rank(t2d)[target_ids], 0), in_vocab

    def state_dict(self) -> dict[str, Tensor]:
        return {"d2t": self.d2t, "t2d": self.t2d}

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor], *, source: str = "checkpoint",
                        draft_vocab_size: int | None = None,
                        target_vocab_size: int | None = None) -> "DraftVocab":
        for key in ("d2t", "t2d"):
            if key not in state:
                raise DraftVocabError(f"{source}: no {key!r} tensor; an EAGLE-3 checkpoint "
                                      "stores both d2t and t2d (rebuild it with build_draft_vocab)")
        d2t, t2d = state["d2t"].long(), state["t2d"].bool()
        if draft_vocab_size is not None and d2t.numel() != draft_vocab_size:
            raise DraftVocabError(f"{source}: d2t has {d2t.numel()} entries but the config says "
                                  f"draft_vocab_size={draft_vocab_size}")
        if target_vocab_size is not None and t2d.numel() != target_vocab_size:
            raise DraftVocabError(f"{source}: t2d has {t2d.numel()} entries but the target vocab "
                                  f"has {target_vocab_size}; was it built for another target?")
        _validate(d2t, t2d, source=source)
        return cls(d2t=d2t, t2d=t2d)


def kept_target_ids(t2d: Tensor, size: int) -> Tensor:
    """(N,) target ids kept by the draft vocab, ascending (= DraftVocab.used = arange(N) + d2t), from t2d
    alone and without a host sync."""
    return torch.argsort((~t2d).to(torch.int8), stable=True)[:size]


def scatter_to_target(x: Tensor, used: Tensor, target_vocab_size: int, fill: float) -> Tensor:
    """(F, Vd) scores over draft ids -> (F, V) over target ids: out[:, used[d]] = x[:, d] (target id = draft id
    + d2t[draft id]), `fill` at the target ids the draft vocab lacks (-inf for log-probs, 0 for probs)."""
    out = x.new_full((x.shape[0], target_vocab_size), fill)
    out[:, used] = x
    return out


def draft_rank(t2d: Tensor) -> Tensor:
    """(V,) target id -> its draft id (its rank among the kept ids); meaningful where t2d."""
    return t2d.long().cumsum(0) - 1


def _validate(d2t: Tensor, t2d: Tensor, *, source: str) -> None:
    if d2t.dtype != torch.long or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        raise DraftVocabError(f"{source}: want d2t (N,) int64 and t2d (V,) bool, got "
                              f"d2t {tuple(d2t.shape)} {d2t.dtype}, t2d {tuple(t2d.shape)} {t2d.dtype}")
    n, v = d2t.numel(), t2d.numel()
    if n == 0 or n > v or int(t2d.sum()) != n:
        raise DraftVocabError(f"{source}: t2d marks {int(t2d.sum())} ids but d2t has {n} entries "
                              f"(target vocab {v}); the two tensors come from different vocabs")
    used = torch.arange(n, device=d2t.device) + d2t
    if bool((used[1:] <= used[:-1]).any()) or int(used[0]) < 0 or int(used[-1]) >= v:
        raise DraftVocabError(f"{source}: arange(N) + d2t is not strictly ascending inside "
                              f"[0, {v}); d2t must be used[i] - i with used sorted")
    if not bool(t2d.to(used.device)[used].all()):
        raise DraftVocabError(f"{source}: t2d and d2t disagree on which target ids are kept")


def count_tokens(examples: Iterable[tuple], target_vocab_size: int) -> Tensor:
    """Histogram (V,) int64 of target ids at loss-masked positions over (input_ids, loss_mask)."""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for row, (input_ids, loss_mask) in enumerate(examples):
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        mask = torch.as_tensor(loss_mask).reshape(-1).bool()
        if ids.shape != mask.shape:
            raise DraftVocabError(f"example {row}: input_ids has {ids.numel()} tokens but "
                                  f"loss_mask has {mask.numel()}")
        ids = ids[mask]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size):
            raise DraftVocabError(f"example {row}: token id outside [0, {target_vocab_size}); "
                                  "was the data tokenized with another target's tokenizer?")
        counts += torch.bincount(ids, minlength=target_vocab_size)
    return counts


def coverage(counts: Tensor, vocab: "DraftVocab") -> float:
    """The fraction of the counted (loss-masked) tokens whose id the vocabulary holds: how often the target's
    next token is one the drafter can propose at all (an upper bound on its first-step acceptance). counts (V,)
    from count_tokens."""
    total = int(counts.sum())
    return int(counts[vocab.used.to(counts.device)].sum()) / total if total else 0.0


def size_for_coverage(counts: Tensor, fraction: float) -> int:
    """The smallest N whose N most frequent ids cover at least `fraction` (0 < fraction <= 1) of the
    counted tokens: N = 1 + #{n : cumsum of sorted counts up to n < ceil(fraction * total)}."""
    if not 0 < fraction <= 1:
        raise DraftVocabError(f"coverage {fraction} must be in (0, 1]")
    need = math.ceil(fraction * int(counts.sum()))
    running = torch.sort(counts, descending=True).values.cumsum(0)  # (V,)
    return min(int((running < need).sum()) + 1, counts.numel())


def build_draft_vocab(token_counts_or_examples: Tensor | Iterable[tuple], target_vocab_size: int,
                      size: int = 32000, keep: DraftVocab | None = None) -> DraftVocab:
    """Keep the N = min(size, V) most frequent loss-masked target ids (ties: lower id first).
    keep: a vocabulary whose ids all stay (a checkpoint's, widened); the other N - keep.size ids are the most
    frequent of the rest.

    If fewer than N distinct ids were seen, the vocabulary is filled up with the LOWEST unseen
    ids (all have count 0, so this is the same tie rule; SpecForge does the same). N is kept
    exact because the exported lm_head / d2t shapes must match `draft_vocab_size`.
    """
    if isinstance(token_counts_or_examples, Tensor):
        counts = token_counts_or_examples.long().cpu()
        if counts.shape != (target_vocab_size,):
            raise DraftVocabError(f"token counts have shape {tuple(counts.shape)}, want "
                                  f"({target_vocab_size},) = the target vocab size")
    else:
        counts = count_tokens(token_counts_or_examples, target_vocab_size)
    if size <= 0:
        raise DraftVocabError(f"draft vocab size must be positive, got {size}")
    n = min(size, target_vocab_size)
    if keep is not None and keep.size > n:
        raise DraftVocabError(f"draft vocab of {n} ids cannot hold the {keep.size} ids it must keep")
    rank = counts if keep is None else torch.where(keep.t2d.cpu(), counts.max() + 1, counts)  # kept ids first
    order = torch.argsort(-rank, stable=True)  # by count descending, ties by id ascending
    seen = int((counts > 0).sum())
    if seen < n:
        logger.warning("draft vocab: only %d distinct loss-masked ids seen, %d lowest unseen "
                       "ids fill it up to %d", seen, n - seen, n)
    return DraftVocab.from_used(order[:n], target_vocab_size)
