"""Prompt-lookup decoding: draft the tokens that followed an earlier occurrence of the last n-gram.

As Hugging Face `prompt_lookup_num_tokens` (and vLLM's `ngram` method): match the last n tokens
(n = max_ngram down to min_ngram) against the sequence so far and propose what came next. Chain
variant: the longest n that matches; among its matches, the one with the most tokens after it
(up to the draft length), the most recent on ties (the most recent match alone often overlaps
the end of the sequence and leaves one token to draft). Tree variant: a trie of up to `branches`
distinct continuations in that order (longest n first). Drafts are deterministic (`draft_probs`
None). No match -> a tree of just the root; the decoder still commits the bonus token.

The proposer knows nothing about the target model: it reads only token ids.
"""

import torch
from torch import Tensor

from drafters.decode.proposers import TargetNeeds
from drafters.decode.tree import Tree, merge_trees

MAX_MATCHES_PER_NGRAM = 64  # matches examined per n-gram size, best first


def find_continuations(
    sequence: Tensor,
    *,
    length: int,
    max_ngram: int = 3,
    min_ngram: int = 1,
    branches: int = 1,
    eos_token_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """Up to `branches` continuations of `sequence` (L,), each <= `length` tokens, best first.

    A continuation is kept only when it is not a prefix of one already kept; it is cut after the
    first eos token (nothing is drafted past the end of a reply).
    """
    kept: list[list[int]] = []
    total = sequence.numel()
    for n in range(max_ngram, min_ngram - 1, -1):
        if total <= n:
            continue
        suffix = sequence[-n:]  # (n,)
        windows = sequence[:-1].unfold(0, n, 1)  # (L-n, n): window i = seq[i:i+n]
        starts = (windows == suffix).all(dim=1).nonzero().flatten()  # (M,) match starts
        # Prefer the longest available continuation (a match overlapping the end of the sequence
        # has fewer tokens after it), then the most recent match.
        available = (total - starts - n).clamp(max=length)  # (M,)
        order = torch.sort(available * total + starts, descending=True).indices
        for start in starts[order][:MAX_MATCHES_PER_NGRAM].tolist():
            continuation = _cut_after_eos(sequence[start + n:start + n + length].tolist(),
                                          eos_token_ids)
            if not any(old[:len(continuation)] == continuation for old in kept):
                kept.append(continuation)
                if len(kept) == branches:
                    return kept
    return kept


def _cut_after_eos(tokens: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[:i + 1]
    return tokens


def trie_tree(root: int, continuations: list[list[int]], max_nodes: int | None = None) -> Tree:
    """Merge continuations into one tree rooted at `root`; at most `max_nodes` nodes besides it."""
    tree = Tree.chain(torch.tensor([root]))
    for continuation in continuations:
        room = None if max_nodes is None else max_nodes - (tree.num_nodes - 1)
        tree = merge_trees(tree, Tree.chain(torch.tensor([root, *continuation])), room)
    return tree


class PromptLookupProposer:
    needs = TargetNeeds()

    def __init__(
        self,
        *,
        depth: int = 4,
        branches: int = 1,
        max_nodes: int | None = None,
        max_ngram: int = 3,
        min_ngram: int = 1,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ):
        if depth < 1 or branches < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"prompt lookup needs depth >= 1, branches >= 1 and 1 <= min_ngram <= max_ngram; "
                f"got depth={depth}, branches={branches}, min_ngram={min_ngram}, "
                f"max_ngram={max_ngram}"
            )
        self.depth, self.branches, self.max_nodes = depth, branches, max_nodes
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.eos_token_ids = frozenset(eos_token_ids)

    def reset(self, prompt_ids: Tensor, features=None) -> None:
        pass  # stateless: every round searches the context it is given

    def propose(self, context: Tensor, pending: int, sampling=None) -> Tree:
        sequence = torch.cat([context.cpu(), torch.tensor([pending], dtype=torch.long)])  # (T+1,)
        continuations = find_continuations(
            sequence,
            length=self.depth,  # the harness may change depth between rounds (adaptive)
            max_ngram=self.max_ngram,
            min_ngram=self.min_ngram,
            branches=self.branches,
            eos_token_ids=self.eos_token_ids,
        )
        return trie_tree(pending, continuations, self.max_nodes)

    def update(self, new_tokens: Tensor, features=None, pending: int | None = None) -> None:
        pass
