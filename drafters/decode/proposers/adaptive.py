"""Adaptive chain length, as Hugging Face assisted generation's "heuristic" schedule: after a round
whose drafts were all accepted the chain grows by 2, otherwise it shrinks by 1 (never below 1).

Wraps any chain proposer that reads its chain length from a `depth` attribute each round. The
length restarts from its initial value at every `reset` (each prompt), and is capped at
`max_depth`. This module knows nothing about how drafts are made.
"""

from torch import Tensor


class AdaptiveChain:
    max_depth = 32

    def __init__(self, proposer):
        if getattr(proposer, "depth", None) is None:
            raise ValueError(f"--adaptive needs a chain proposer (tree spec chain:K); "
                             f"{type(proposer).__name__} was not built for a chain")
        self.proposer = proposer
        self.initial_depth = proposer.depth
        self.needs = proposer.needs

    def reset(self, prompt_ids: Tensor, features=None) -> None:
        self.proposer.depth = self.initial_depth
        self.proposer.reset(prompt_ids, features)

    def propose(self, context: Tensor, pending: int, sampling):
        return self.proposer.propose(context, pending, sampling)

    def update(self, new_tokens: Tensor, features=None, pending: int | None = None) -> None:
        accepted = new_tokens.numel() - 1  # new_tokens = old pending + accepted drafts
        depth = self.proposer.depth
        # "all accepted" means the drafted chain reached the requested length and was kept whole
        self.proposer.depth = min(depth + 2, self.max_depth) if accepted >= depth else max(depth - 1, 1)
        self.proposer.update(new_tokens, features, pending)
