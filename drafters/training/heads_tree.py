"""Draft trees for multi-head drafters, built from measured per-head top-k accuracies.

A heads drafter drafts depth d of the tree with head d-1 alone: every node at depth d takes head
d-1's candidate of its rank, whatever its parent (drafters.decode.proposers.heads). A tree is a set of
rank paths (r_1, ..., r_d) (drafters.decode.tree.TreeShape). On a held-out calibration set,

    acc[k][r] = P(head k's rank-r candidate is the true token)        (drafters.heads.rank_hits)

Assumption (Medusa's, when it built its trees by simulation): heads are right or wrong
independently of each other, so a node is accepted with probability

    P(r_1 .. r_d) = prod_{i=1..d} acc[i-1][r_i]

Siblings hold distinct tokens, so at most one node per depth is on the true path and the mean
accepted length, bonus token included, is

    E[tau] = 1 + sum over the tree's nodes of P(node)

P never grows along a path (acc <= 1), so the B nodes of highest P form a valid tree (every
node's prefix scores at least as high and is taken first) and maximise E[tau] for a budget of B
draft nodes: the greedy construction below (a best-first search over children) finds them.
Nodes with P = 0 are never added: they cost verification and add nothing. Node budgets exclude
the root, as everywhere in drafters.decode.tree. Knows nothing about models.
"""

import heapq
import itertools
from dataclasses import dataclass

from drafters.acceptance import tree_tau
from drafters.decode.tree import TreeShape


@dataclass(frozen=True)
class HeadsTree:
    paths: list[list[int]]  # rank paths, sorted by (depth, ranks): TreeShape.from_paths(paths)
    expected_tau: float  # 1 + sum of the nodes' acceptance probabilities (independent heads)
    kind: str  # greedy | cartesian | chain

    @property
    def shape(self) -> TreeShape:
        return TreeShape.from_paths(self.paths)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "paths": self.paths, "expected_tau": self.expected_tau,
                "draft_nodes": len(self.paths)}


def accuracy_table(hits, counts) -> list[list[float]]:
    # hits (K, R) rank hits, counts (K,) rows per head (tensors or nested lists) -> acc[k][r]
    hits, counts = _as_list(hits), _as_list(counts)
    return [[h / c if c else 0.0 for h in row] for row, c in zip(hits, counts)]


def expected_tau(paths, acc: list[list[float]]) -> float:
    _check_depth(paths, acc)
    return tree_tau(paths, acc)


def greedy_tree(acc: list[list[float]], budget: int) -> HeadsTree:
    """The <= budget nodes of highest acceptance probability (ties: shallower, then lower ranks)."""
    if budget < 1:
        raise ValueError(f"tree budget {budget} must be >= 1 draft node")
    if not acc or not acc[0]:
        raise ValueError("greedy_tree: empty accuracy table; measure at least one head and one rank")
    heap = [(-acc[0][r], 1, (r,)) for r in range(len(acc[0]))]  # the root's children
    heapq.heapify(heap)
    paths = []
    while heap and len(paths) < budget:
        negative_p, depth, path = heapq.heappop(heap)  # highest P first, then shallower, then lower ranks
        if negative_p == 0:
            break  # every node left has P = 0
        paths.append(list(path))
        if depth < len(acc):
            for r, a in enumerate(acc[depth]):
                heapq.heappush(heap, (negative_p * a, depth + 1, path + (r,)))
    if not paths:  # no head was ever right: a single draft node, the cheapest tree there is
        paths = [[0]]
    paths.sort(key=lambda p: (len(p), p))
    return HeadsTree(paths, expected_tau(paths, acc), "greedy")


def cartesian_tree(acc: list[list[float]], topk: list[int]) -> HeadsTree:
    """Every combination of the top topk[d] candidates at depth d+1 (the first Medusa trees)."""
    if not topk or any(k < 1 for k in topk):
        raise ValueError(f"cartesian tree: topk per depth {topk} must be a non-empty list of ints >= 1")
    paths = [list(p) for d in range(1, len(topk) + 1) for p in itertools.product(*(range(k) for k in topk[:d]))]
    return HeadsTree(paths, expected_tau(paths, acc), "cartesian")


def chain_tree(acc: list[list[float]], depth: int) -> HeadsTree:
    """Each head's top-1: a chain of `depth` drafts."""
    paths = [[0] * d for d in range(1, depth + 1)]
    return HeadsTree(paths, expected_tau(paths, acc), "chain")


def _check_depth(paths, acc) -> None:
    deepest = max((len(p) for p in paths), default=0)
    if deepest > len(acc):
        raise ValueError(f"tree depth {deepest} exceeds the {len(acc)} heads measured: depth d is drafted by "
                         f"head d-1")


def _as_list(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)
