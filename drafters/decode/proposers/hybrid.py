"""A trained drafter's tree plus prompt-lookup continuations as extra branches, verified together.

Where an answer copies its prompt (summaries, retrieval-augmented QA, code edits) prompt lookup out-drafts
a small trained drafter; elsewhere the drafter wins. Both trees share the root (the pending token), so
`merge_trees` inserts the lookup's paths into the drafter's tree (a path the drafter already proposed
adds no node) and one target forward verifies all of them: each round keeps whichever branch the target
accepts further. Greedy verification only: the lookup's drafts are deterministic while a sampling
drafter's siblings are draws from its q, and mixing the two breaks the rejection-sampling correction.
Knows nothing about the target: it forwards the decoder's calls to both proposers.
"""

from torch import Tensor

from drafters.decode.proposers.prompt_lookup import PromptLookupProposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import Tree, merge_trees


class HybridProposer:
    greedy_only = True  # eval/tau.py refuses --temperature > 0 before any generation

    def __init__(self, drafter, lookup: PromptLookupProposer, max_lookup_nodes: int | None = None):
        self.drafter, self.lookup, self.max_lookup_nodes = drafter, lookup, max_lookup_nodes
        self.needs = drafter.needs  # prompt lookup needs no target features

    def reset(self, prompt_ids: Tensor, features) -> None:
        self.drafter.reset(prompt_ids, features)
        self.lookup.reset(prompt_ids)

    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        if not sampling.greedy:
            raise ValueError("the hybrid proposer (DRAFTER+prompt-lookup) verifies greedily only: use temperature 0")
        tree = self.drafter.propose(context, pending, sampling)
        return merge_trees(tree, self.lookup.propose(context, pending), self.max_lookup_nodes)

    def update(self, new_tokens: Tensor, features, pending: int) -> None:
        # the accepted path may come from either branch: both proposers only read the committed tokens
        self.drafter.update(new_tokens, features, pending)
        self.lookup.update(new_tokens)
