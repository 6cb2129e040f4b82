"""A trained drafter's tree plus prompt-lookup continuations as extra branches, verified together.

Where an answer copies its prompt (summaries, retrieval-augmented QA, code edits) prompt lookup out-drafts
a small trained drafter; elsewhere the drafter wins. Both trees share the root (the pending token), so
`merge_trees` inserts the lookup's paths into the drafter's tree (a path the drafter already proposed
adds no node) and one target forward verifies all of them: each round keeps whichever branch the target
accepts further. On a CPU the drafter's steps cost about half a target forward, so merging still loses to
lookup alone where answers copy (code edits: tau 3.73 at 0.99x against lookup's 3.84 at 1.55x): with
`copy_lookup` set, a round where it finds a full-depth continuation (a long n-gram of the context
recurs: the answer is copying) verifies the lookup's own tree and skips the drafter. The drafter still
reads every accepted token, but lazily: the rounds' tokens and features wait until it next drafts and
are then committed in one update() (every proposer's update is additive: two calls equal one over the
concatenation), one drafter forward for a whole copying streak. Greedy verification only: the lookup's
drafts are deterministic while a sampling drafter's siblings are draws from its q, and mixing the two
breaks the rejection-sampling correction.
Knows nothing about the target: it forwards the decoder's calls to both proposers.
"""

import torch
from torch import Tensor

from drafters.decode.proposers.prompt_lookup import PromptLookupProposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import Tree, merge_trees
from drafters.targets import TargetFeatures


class HybridProposer:
    greedy_only = True  # eval/tau.py refuses --temperature > 0 before any generation

    def __init__(self, drafter, lookup: PromptLookupProposer, max_lookup_nodes: int | None = None,
                 copy_lookup: PromptLookupProposer | None = None):
        self.drafter, self.lookup, self.max_lookup_nodes = drafter, lookup, max_lookup_nodes
        self.copy_lookup = copy_lookup
        self.needs = drafter.needs  # prompt lookup needs no target features
        self.copy_rounds = self.rounds = 0  # rounds, and those verified from copy_lookup alone
        self.waiting: list[tuple[Tensor, TargetFeatures | None]] = []  # updates the drafter has not read yet

    def reset(self, prompt_ids: Tensor, features) -> None:
        self.drafter.reset(prompt_ids, features)
        self.lookup.reset(prompt_ids)
        self.waiting = []

    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        if not sampling.greedy:
            raise ValueError("the hybrid proposer (DRAFTER+prompt-lookup) verifies greedily only: use temperature 0")
        self.rounds += 1
        if self.copy_lookup is not None:
            copied = self.copy_lookup.propose(context, pending)
            if copied.max_depth >= self.copy_lookup.depth:  # a full-depth continuation: a copying round
                self.copy_rounds += 1
                return copied
        self._catch_up(pending)
        tree = self.drafter.propose(context, pending, sampling)
        return merge_trees(tree, self.lookup.propose(context, pending), self.max_lookup_nodes)

    def update(self, new_tokens: Tensor, features, pending: int) -> None:
        # the accepted path may come from either branch: both proposers only read the committed tokens
        self.lookup.update(new_tokens)
        self.waiting.append((new_tokens, features))
        if self.copy_lookup is None:
            self._catch_up(pending)

    def _catch_up(self, pending: int) -> None:
        # commit the waiting rounds in one drafter update: tokens (a1 + a2 + ...,), features along T
        if not self.waiting:
            return
        tokens, features = zip(*self.waiting)
        self.waiting = []
        joined = None if features[0] is None else TargetFeatures.cat(list(features))
        self.drafter.update(torch.cat(tokens), joined, pending)
