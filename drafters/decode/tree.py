"""Draft trees: the typed data a proposer hands to the decoder, and the ways to build them.

Node 0 is the root (the pending token); every other node is a draft token whose parent has a
smaller index (topological order). Three ways to build one:
  - `Tree.chain(tokens)`                      a single path (prompt lookup, a draft model, Medusa top-1);
  - `TreeShape.from_paths(paths)` + `build_static_tree`  Medusa / EAGLE-1 sparse trees of top-k ranks;
  - `build_dynamic_tree`                      EAGLE-2: expand by cumulative draft log-prob, rerank to a budget.
`parse_tree_spec` reads the CLI grammar (`chain:K`, `static:eagle1`, `dynamic:total=60,...`); `build_tree`
builds what a spec asks for from a proposer's expand callback, the one dispatch every drafter proposer uses.

This module knows nothing about models: the proposer's `expand` callback runs its own drafter, and
the decoder alone talks to the target. Node budgets (`chain:K`, `total`) exclude the root.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import torch
from torch import Tensor

from drafters.decode.sampling import sample_without_replacement, warp
from drafters.errors import UserError

# EAGLE-1 default tree (SafeAILab/EAGLE, eagle/model/choices.py `mc_sim_7b_63`): 25 draft nodes, depth 5.
EAGLE1_PATHS = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]  # fmt: skip
# Medusa-1 default tree (FasterDecoding/Medusa, medusa_choices.py `mc_sim_7b_63`): 63 draft nodes, depth 4.
MEDUSA_PATHS = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0],
    [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5],
    [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9],
    [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0],
    [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip
NAMED_SHAPES = {"eagle1": EAGLE1_PATHS, "medusa": MEDUSA_PATHS}


class TreeSpecError(UserError):
    """A tree spec (--tree, a static paths file) that cannot be read; the message shows the grammar."""


@dataclass(frozen=True, eq=False)
class Tree:
    tokens: Tensor  # (N,) long, node 0 = root = pending token
    parents: Tensor  # (N,) long, parents[0] = -1, parents[i] < i
    # (N, V) row i = the draft distribution node i was drawn from (row 0 unused); siblings are drawn
    # without replacement in child order (row i may already exclude earlier siblings' tokens).
    # None = deterministic drafts (top-k, lookups): verified as one-hot proposals.
    draft_probs: Tensor | None = None

    def __post_init__(self):
        n = self.tokens.numel()
        if self.tokens.ndim != 1 or self.parents.shape != self.tokens.shape or n == 0:
            raise ValueError(f"Tree: tokens and parents must be 1-D of the same length >= 1, got "
                             f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}")
        parents = self.parent_list
        if parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i > 0):
            raise ValueError(f"Tree: parents must be -1 for the root and p < i for node i (topological), got {parents}")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError(f"Tree: draft_probs needs one row per node ({n}, V), row 0 unused; "
                             f"got {tuple(self.draft_probs.shape)}")
        if self.draft_probs is not None and self._repeated_siblings():
            raise ValueError("Tree: sampled siblings must have distinct tokens: draw them without replacement "
                             "(drafters.decode.sampling.sample_without_replacement), as the verifier assumes")

    def _repeated_siblings(self) -> bool:
        tokens = self.tokens.tolist()
        return any(len({tokens[c] for c in kids}) < len(kids) for kids in self.children)

    @staticmethod
    def chain(tokens: Tensor, draft_probs: Tensor | None = None) -> "Tree":
        # tokens (K+1,) = [root, d_1, ..., d_K]; draft_probs (K+1, V) with row 0 unused, or None
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parents = torch.arange(-1, tokens.numel() - 1, device=tokens.device)
        return Tree(tokens, parents, draft_probs)

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @cached_property
    def depth_list(self) -> list[int]:
        depths = [0] * self.num_nodes
        for i, p in enumerate(self.parent_list[1:], start=1):
            depths[i] = depths[p] + 1
        return depths

    @cached_property
    def depths(self) -> Tensor:  # (N,) long; position offset of each node from the root
        return torch.tensor(self.depth_list, device=self.tokens.device)

    @property
    def max_depth(self) -> int:
        return max(self.depth_list)

    @cached_property
    def ancestor_mask(self) -> Tensor:  # (N, N) bool, row i: ancestors of i and i itself
        mask = torch.eye(self.num_nodes, dtype=torch.bool)
        for i, p in enumerate(self.parent_list[1:], start=1):
            mask[i] |= mask[p]  # parents come first, so row p is already complete
        return mask.to(self.tokens.device)

    @cached_property
    def children(self) -> list[list[int]]:
        kids = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parent_list[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def paths(self) -> list[list[int]]:  # root-to-leaf node indices, one per leaf
        return [self.path_to(i) for i in range(self.num_nodes) if not self.children[i]]

    def path_to(self, node: int) -> list[int]:
        return [0, *reversed(ancestors(node, self.parent_list))] if node else [0]


def ancestors(node: int, parents) -> list[int]:
    # node, its parent, its grandparent, ... up to but excluding the root (0); parents[i] < i
    walk = []
    while node > 0:
        walk.append(node)
        node = parents[node]
    return walk


# ---------------------------------------------------------------- static trees (top-k rank paths)


@dataclass(frozen=True)
class TreeShape:
    paths: tuple[tuple[int, ...], ...]  # sorted by (depth, ranks); node i+1 <-> paths[i], node 0 = root
    parents: tuple[int, ...]  # (N,) parent node of each node, -1 for the root
    ranks: tuple[int, ...]  # (N,) rank of each node among the candidates of its parent; -1 for the root

    @staticmethod
    def from_paths(paths) -> "TreeShape":
        paths = [tuple(p) for p in paths]
        _check_paths(paths)
        paths = sorted(paths, key=lambda p: (len(p), p))
        node_of = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
        parents = (-1,) + tuple(node_of[p[:-1]] for p in paths)
        ranks = (-1,) + tuple(p[-1] for p in paths)
        return TreeShape(tuple(paths), parents, ranks)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        return (0,) + tuple(len(p) for p in self.paths)

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    def fill(self, root_token: int, candidates: Tensor) -> Tree:
        # candidates (N, K) long: row i = ranked candidate tokens for the children of node i
        tokens = [int(root_token)] + [int(candidates[p, r]) for p, r in zip(self.parents[1:], self.ranks[1:])]
        device = candidates.device
        return Tree(torch.tensor(tokens, device=device), torch.tensor(self.parents, device=device))


def _check_paths(paths: list[tuple[int, ...]]) -> None:
    if not paths:
        raise TreeSpecError("tree shape: empty path list; give e.g. [[0], [1], [0, 0]]")
    seen = set()
    for p in paths:
        if not p or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in p):
            raise TreeSpecError(f"tree shape: path {list(p)} must be a non-empty list of ranks >= 0")
        if p in seen:
            raise TreeSpecError(f"tree shape: duplicate path {list(p)}")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeSpecError(f"tree shape: path {list(p)} needs its prefix {list(p[:-1])} in the list too")


@dataclass(frozen=True)
class Frontier:
    depth: int  # depth of these nodes (root = 0)
    nodes: Tensor  # (F,) ids of the nodes to expand, in the candidate pool built so far
    tokens: Tensor  # (F,) their tokens
    pool_parents: Tensor  # (M,) parent id of every pool node so far (-1 for the root): gives ancestor masks
    pool_tokens: Tensor  # (M,) token of every pool node so far


Expand = Callable[[Frontier], Tensor]  # Frontier -> (F, V) draft log-probs (or any scores: higher = better)


def frontier_mask(frontier: Frontier, columns: dict[int, int], prefix: int, start: int) -> Tensor:
    # (F, start + F) bool, for a drafter that appends the frontier's KV at cache columns start .. start+F-1:
    # node i sees the first `prefix` columns (committed tokens and the root) and its ancestors-or-self below
    # the root, at the columns earlier levels were given. Records columns[node] = start + i.
    nodes, parents = frontier.nodes.tolist(), frontier.pool_parents.tolist()
    mask = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)
    mask[:, :prefix] = True
    for i, node in enumerate(nodes):
        columns[node] = start + i
        mask[i, [columns[a] for a in ancestors(node, parents)]] = True
    return mask


def build_static_tree(shape: TreeShape, root_token: int, expand: Expand) -> Tree:
    # Level by level (nodes are sorted by depth): expand the nodes of depth d that have children,
    # give each child of rank r its parent's r-th best token. Pool ids are the shape's node ids.
    tokens, candidates = [int(root_token)], {}
    for d in range(shape.max_depth):
        nodes = sorted({p for p, depth in zip(shape.parents, shape.depths) if depth == d + 1})
        pool = torch.tensor(tokens)
        scores = expand(Frontier(d, torch.tensor(nodes), pool[nodes], torch.tensor(shape.parents[: len(tokens)]), pool))
        k = 1 + max(r for p, r in zip(shape.parents, shape.ranks) if p in nodes)
        candidates |= dict(zip(nodes, scores.topk(k, dim=-1).indices.tolist()))  # node -> ranked tokens
        tokens += [candidates[shape.parents[i]][shape.ranks[i]] for i in range(len(tokens), shape.num_nodes)
                   if shape.depths[i] == d + 1]
    device = scores.device
    return Tree(torch.tensor(tokens, device=device), torch.tensor(shape.parents, device=device))


# ---------------------------------------------------------------- dynamic trees (EAGLE-2)


def build_dynamic_tree(root_token: int, expand: Expand, *, depth: int, topk: int, total: int) -> Tree:
    # Expansion: at each depth, every frontier node proposes its topk children, scored by
    # cumulative log-prob (parent score + child log-prob); the topk best new nodes form the next
    # frontier. Rerank: keep the `total` best nodes of the whole pool (root excluded). Child log-probs
    # are clamped to <= 0, so a child never outscores its parent; ties go to the lower pool id and
    # parents have lower ids than their children, so the kept set always contains its ancestors.
    pool_tokens, pool_parents = [int(root_token)], [-1]
    scores = torch.zeros(1)  # (M,) cumulative log-prob of each pool node
    frontier, device = [0], None
    for d in range(depth):
        logp = expand(Frontier(d, torch.tensor(frontier), torch.tensor(pool_tokens)[frontier],
                               torch.tensor(pool_parents), torch.tensor(pool_tokens)))  # (F, V)
        device = logp.device
        if torch.isnan(logp).any():
            raise ValueError(f"build_dynamic_tree: expand returned NaN log-probs at depth {d}")
        top = logp.float().clamp(max=0).topk(min(topk, logp.shape[-1]), dim=-1)  # (F, k)
        child_scores = (scores[frontier, None] + top.values.cpu()).flatten()  # (F*k,)
        first_new = len(pool_tokens)
        pool_parents += [p for p in frontier for _ in range(top.indices.shape[1])]
        pool_tokens += top.indices.flatten().tolist()
        scores = torch.cat([scores, child_scores])
        order = torch.sort(child_scores, descending=True, stable=True).indices[:topk]  # ties: lower id first
        frontier = (order + first_new).tolist()
    return _rerank(pool_tokens, pool_parents, scores, total, device)


def _rerank(pool_tokens, pool_parents, scores: Tensor, total: int, device) -> Tree:
    order = torch.sort(scores[1:], descending=True, stable=True).indices[:total] + 1
    keep = [0] + sorted(order.tolist())  # pool order is topological (levels are appended in order)
    new_id = {old: new for new, old in enumerate(keep)}
    if any(pool_parents[i] not in new_id for i in keep[1:]):  # cannot happen, see build_dynamic_tree
        raise AssertionError("build_dynamic_tree: a kept node lost its parent; scores must not increase along a path")
    tokens = torch.tensor([pool_tokens[i] for i in keep], device=device)
    parents = torch.tensor([-1] + [new_id[pool_parents[i]] for i in keep[1:]], device=device)
    return Tree(tokens, parents)


# ---------------------------------------------------------------- CLI specs

TREE_SPEC_GRAMMAR = """tree spec grammar:
  chain:K                               a chain of K draft tokens (K >= 1)
  static:eagle1 | static:medusa         named sparse trees (25 / 63 draft nodes)
  static:PATHS.json | static:[[0],[1],[0,0]]   top-k rank paths from a JSON file or inline
  dynamic:total=60,depth=6,topk=10      EAGLE-2 dynamic tree (total draft nodes, root excluded;
                                        all three keys required)"""


# Each spec knows its budget (draft nodes per round, root excluded: the root is the pending token, not a
# draft) and its depth (the deepest draft).


@dataclass(frozen=True)
class ChainSpec:
    length: int

    @property
    def budget(self) -> int:
        return self.length

    @property
    def depth(self) -> int:
        return self.length


@dataclass(frozen=True)
class StaticSpec:
    shape: TreeShape
    name: str

    @property
    def budget(self) -> int:
        return self.shape.num_nodes - 1

    @property
    def depth(self) -> int:
        return self.shape.max_depth


@dataclass(frozen=True)
class DynamicSpec:
    total: int = 60
    depth: int = 6
    topk: int = 10

    @property
    def budget(self) -> int:
        return self.total


TreeSpec = ChainSpec | StaticSpec | DynamicSpec
# (depth, draws) -> (expand, probs); see build_tree
MakeExpand = Callable[[int, int], tuple[Expand, dict[int, Tensor]]]


def build_tree(spec: TreeSpec, root_token: int, make_expand: MakeExpand, *, sampled: bool,
               chain_depth: int | None = None) -> Tree:
    """The tree `spec` asks for, rooted at `root_token`, drafted by the proposer's make_expand(depth, draws)
    -> (expand, probs): depth = the deepest level the tree reaches; draws = 0: expand scores candidates
    (draft log-probs, top-k taken); draws = n > 0: expand returns `ranked_draws` of n draws without
    replacement per node, and fills probs[node] = the (V,) q that node's children were drawn from.
    sampled (temperature > 0): chain and static trees draw their nodes and carry q as `draft_probs`;
    dynamic (EAGLE-2) trees take top-k drafts at every temperature, since their rerank keeps or drops a
    node by its drawn value, which would bias sampled siblings. chain_depth: a chain's current length
    (adaptive chains change it between rounds), default spec.length."""
    if isinstance(spec, DynamicSpec):
        expand, _ = make_expand(spec.depth, 0)
        return build_dynamic_tree(root_token, expand, depth=spec.depth, topk=spec.topk, total=spec.total)
    if isinstance(spec, ChainSpec):
        shape = chain_shape(spec.length if chain_depth is None else chain_depth)
    elif isinstance(spec, StaticSpec):
        shape = spec.shape
    else:
        raise TypeError(f"build_tree: unsupported tree spec {spec!r}")
    if not sampled:
        expand, _ = make_expand(shape.max_depth, 0)
        return build_static_tree(shape, root_token, expand)
    shape = sibling_order(shape)  # child rank r = its parent's draw r
    expand, probs = make_expand(shape.max_depth, 1 + max(shape.ranks))
    return with_draft_probs(build_static_tree(shape, root_token, expand), probs)


def parse_tree_spec(spec: str) -> TreeSpec:
    kind, _, arg = spec.strip().partition(":")
    try:
        if kind == "chain" and re.fullmatch(r"\d+", arg) and int(arg) >= 1:
            return ChainSpec(int(arg))
        if kind == "static" and arg:
            return StaticSpec(TreeShape.from_paths(_load_paths(arg)), arg)
        if kind == "dynamic":
            return _parse_dynamic(arg)
    except (ValueError, json.JSONDecodeError) as e:
        raise TreeSpecError(f"bad tree spec {spec!r}: {e}\n{TREE_SPEC_GRAMMAR}") from e
    raise TreeSpecError(f"bad tree spec {spec!r}\n{TREE_SPEC_GRAMMAR}")


def _load_paths(arg: str):
    if arg in NAMED_SHAPES:
        return NAMED_SHAPES[arg]
    if arg.lstrip().startswith("["):
        return json.loads(arg)
    if arg.endswith(".json"):
        if not Path(arg).is_file():
            raise TreeSpecError(f"no such paths file {arg}")
        return json.loads(Path(arg).read_text())
    raise TreeSpecError(f"unknown static tree {arg!r}: use {' / '.join(NAMED_SHAPES)}, a .json file or inline JSON")


DYNAMIC_KEYS = ("total", "depth", "topk")


def _parse_dynamic(arg: str) -> DynamicSpec:
    # every key once, no defaults: a missing topk used to default to 10, more than a small total,
    # which silently spent the whole budget at depth 1
    fields = {}
    for item in filter(None, arg.split(",")):
        key, eq, value = item.partition("=")
        if key not in DYNAMIC_KEYS or key in fields or not eq or not re.fullmatch(r"\d+", value) or int(value) < 1:
            raise TreeSpecError(f"bad field {item!r}: expected each of {', '.join(k + '=N' for k in DYNAMIC_KEYS)} "
                             "once, with N >= 1")
        fields[key] = int(value)
    missing = [k for k in DYNAMIC_KEYS if k not in fields]
    if missing:
        raise TreeSpecError(f"missing {', '.join(missing)}: a dynamic tree needs all of {', '.join(DYNAMIC_KEYS)}")
    return DynamicSpec(**fields)


def merge_trees(tree: Tree, extra: Tree, max_new: int | None = None) -> Tree:
    """`tree` plus the paths of `extra` (same root token) as a trie: extra node i lands on the node of `tree`
    with the same parent and token if there is one, else on a new node appended after `tree`'s (parents
    still precede children). At most `max_new` new nodes (None = all); deterministic drafts only."""
    if tree.draft_probs is not None or extra.draft_probs is not None:
        raise ValueError("merge_trees: sampled trees carry draft distributions that a merge would invalidate; "
                         "merge deterministic (greedy) trees only")
    if int(tree.tokens[0]) != int(extra.tokens[0]):
        raise ValueError(f"merge_trees: roots differ ({int(tree.tokens[0])} vs {int(extra.tokens[0])})")
    tokens, parents = tree.tokens.tolist(), tree.parent_list.copy()
    node_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}  # (parent, token) -> node
    where, extra_tokens = {0: 0}, extra.tokens.tolist()  # extra node -> merged node
    for i, p in enumerate(extra.parent_list[1:], start=1):
        if p not in where:
            continue  # its parent was cut by max_new
        key = (where[p], extra_tokens[i])
        if key not in node_of:
            if max_new is not None and len(tokens) - tree.num_nodes >= max_new:
                continue
            node_of[key] = len(tokens)
            tokens.append(key[1])
            parents.append(key[0])
        where[i] = node_of[key]
    return Tree(torch.tensor(tokens, dtype=torch.long, device=tree.tokens.device),
                torch.tensor(parents, dtype=torch.long, device=tree.tokens.device))


# ---------------------------------------------------------------- helpers for proposers that sample


def with_draft_probs(tree: Tree, probs: dict[int, Tensor]) -> Tree:
    # draft_probs row i = q of node i's parent (row 0 unused). Nodes q cannot draw (its support ran
    # out before the shape's siblings did: they come last among their siblings) go, with their
    # subtrees; which ones depends on q alone, never on the draws, so the rest stays lossless.
    parents, tokens = tree.parent_list, tree.tokens.tolist()
    drawable = torch.stack([probs[p][t] for p, t in zip(parents[1:], tokens[1:])]).gt(0).tolist()
    new_id = {0: 0}
    for i, ok in enumerate(drawable, start=1):
        if ok and parents[i] in new_id:
            new_id[i] = len(new_id)
    keep = list(new_id)  # ascending: still topological
    rows = torch.stack([torch.zeros_like(probs[0])] + [probs[parents[i]] for i in keep[1:]])  # (N', V)
    new_parents = torch.tensor([-1] + [new_id[parents[i]] for i in keep[1:]], device=tree.tokens.device)
    return Tree(tree.tokens[keep], new_parents, rows)


def ranked_draws(q: Tensor, draws: int, generator: torch.Generator | None = None) -> Tensor:
    # q (F, V) -> scores (F, V) whose top-k are `draws` draws without replacement per row (fewer where q's
    # support is smaller), in draw order: what `expand` returns for sampled trees (build_tree)
    scores = torch.full(q.shape, float("-inf"), dtype=q.dtype, device=q.device)
    for row in range(q.shape[0]):
        drawn = sample_without_replacement(q[row], draws, generator)  # (<= draws,)
        scores[row, drawn] = -torch.arange(drawn.numel(), dtype=q.dtype, device=q.device)
    return scores


def rows_expander(rows: Tensor, to_target: Callable[[Tensor, float], Tensor], sampling, draws: int,
                  generator: torch.Generator | None = None):
    # -> (expand, probs) for build_tree when one drafter pass gave each depth its own row (DFlash's block slots,
    # P-EAGLE's rows; rows (K, Vd)): row d ranks the children of every depth-d node, whatever was drafted above it.
    # expand(Frontier at depth d) -> (F, V) scores over target ids (to_target(x (F, Vd), fill) scatters a draft
    # vocabulary): draft log-probs (top-k drafts) or, with draws > 0, `draws` samples per node without replacement
    # ranked in draw order; probs[node] = (V,) the warped q its children were drawn from.
    return node_rows_expander(lambda frontier: rows[frontier.depth][None].expand(len(frontier.nodes), -1),
                              to_target, sampling, draws, generator)


def node_rows_expander(rows_of: Callable[[Frontier], Tensor], to_target: Callable[[Tensor, float], Tensor], sampling,
                       draws: int, generator: torch.Generator | None = None):
    # rows_expander where each frontier node has a row of its own: rows_of(frontier) -> (F, Vd) draft logits of the
    # nodes' children (DFlash2's q_d(. | node token)); -inf where a node proposes nothing
    probs = {}

    def expand(frontier: Frontier) -> Tensor:
        row = rows_of(frontier)  # (F, Vd)
        if not draws:
            return to_target(row.float().log_softmax(-1), float("-inf"))
        q = to_target(warp(row, sampling), 0.0)  # (F, V) float32, identical rows
        probs.update(zip(frontier.nodes.tolist(), q))
        return ranked_draws(q, draws, generator)  # independent draws per node

    return expand, probs


@lru_cache
def chain_shape(depth: int) -> TreeShape:
    return TreeShape.from_paths([[0] * d for d in range(1, depth + 1)])


@lru_cache
def sibling_order(shape: TreeShape) -> TreeShape:
    # Same topology, rank = index among siblings: sampled child r is its parent's draw r, so a
    # gap such as [[0], [2]] must not skip a draw (the verifier assumes consecutive draws).
    renamed, count = {(): ()}, {}
    for path in shape.paths:  # sorted by (depth, ranks): siblings in rank order
        parent = renamed[path[:-1]]
        count[parent] = count.get(parent, -1) + 1
        renamed[path] = parent + (count[parent],)
    return TreeShape.from_paths([renamed[p] for p in shape.paths])
