"""What the shared tree decoder asks of a proposer (prompt lookup, a draft model, a drafter head).

A proposer owns its own drafter state (n-gram tables, a draft model's cache, head weights); it
never runs the target. The decoder calls, per generation:
    reset(prompt_ids, features)                  once, after the target prefill
    propose(context, pending, sampling) -> Tree  each round; the root (node 0) must be `pending`
    update(new_tokens, features, pending)        after verification, with the committed tokens
`features` are the target features (drafters.targets.TargetFeatures) at exactly the positions of
the tokens given, restricted to what `needs` asks for; None when `needs` asks for nothing.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import Tree

if TYPE_CHECKING:
    from drafters.targets import TargetFeatures


@dataclass(frozen=True)
class TargetNeeds:
    layers: tuple[int, ...] = ()  # HF hidden-state indices (0 = embeddings, k = output of layer k-1)
    pre_norm_last: bool = False  # output of the last decoder layer before the final norm
    last_hidden: bool = False  # final-normed last hidden state (HF index L)

    @property
    def any(self) -> bool:
        return bool(self.layers) or self.pre_norm_last or self.last_hidden


class Proposer(Protocol):
    needs: TargetNeeds

    def reset(self, prompt_ids: Tensor, features: "TargetFeatures | None") -> None:
        # prompt_ids (T,) = everything in the target cache after prefill; features over those positions
        ...

    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        # context (T,) committed tokens (the target cache contents); the tree's root = pending
        ...

    def update(self, new_tokens: Tensor, features: "TargetFeatures | None", pending: int) -> None:
        # new_tokens (a,) just committed (old pending + accepted drafts); pending = the next root
        ...

