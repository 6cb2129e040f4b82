import json

import pytest
import torch

from drafters.decode.tree import (
    EAGLE1_PATHS,
    MEDUSA_PATHS,
    ChainSpec,
    DynamicSpec,
    StaticSpec,
    Tree,
    TreeShape,
    build_dynamic_tree,
    build_static_tree,
    parse_tree_spec,
)


def test_chain_derived_data():
    tree = Tree.chain(torch.tensor([5, 6, 7, 8]))
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depths.tolist() == [0, 1, 2, 3]
    assert torch.equal(tree.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.paths == [[0, 1, 2, 3]] and tree.max_depth == 3


def test_static_shape_derived_data():
    shape = TreeShape.from_paths([[1], [0], [0, 1], [0, 0], [1, 0]])
    # sorted by depth then ranks: nodes 1=[0] 2=[1] 3=[0,0] 4=[0,1] 5=[1,0]
    assert shape.parents == (-1, 0, 0, 1, 1, 2) and shape.ranks == (-1, 0, 1, 0, 1, 0)
    candidates = torch.tensor([[10, 11], [20, 21], [30, 31], [0, 0], [0, 0], [0, 0]])  # (N, K)
    tree = shape.fill(99, candidates)
    assert tree.tokens.tolist() == [99, 10, 11, 20, 21, 30]
    assert tree.paths == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert tree.ancestor_mask[5].tolist() == [True, False, True, False, False, True]
    assert [tree.children[i] for i in range(3)] == [[1, 2], [3, 4], [5]]


def test_named_shapes():
    eagle1 = TreeShape.from_paths(EAGLE1_PATHS)
    assert eagle1.num_nodes == 26 and eagle1.max_depth == 5
    assert TreeShape.from_paths(MEDUSA_PATHS).num_nodes == 64


@pytest.mark.parametrize("paths, message", [
    ([[0], [0, 1, 0]], "prefix"),
    ([[0], [0]], "duplicate"),
    ([[0], [-1]], "ranks >= 0"),
    ([[]], "non-empty"),
    ([], "empty path list"),
])
def test_bad_paths_raise(paths, message):
    with pytest.raises(ValueError, match=message):
        TreeShape.from_paths(paths)


def test_bad_trees_raise():
    with pytest.raises(ValueError, match="topological"):
        Tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="one row per node"):
        Tree.chain(torch.tensor([1, 2, 3]), torch.rand(2, 10))
    with pytest.raises(ValueError, match="without replacement"):
        Tree(torch.tensor([1, 4, 4]), torch.tensor([-1, 0, 0]), torch.rand(3, 10))
    Tree(torch.tensor([1, 4, 4]), torch.tensor([-1, 0, 0]))  # deterministic duplicates are only wasteful


def test_parse_tree_specs(tmp_path):
    assert parse_tree_spec("chain:4") == ChainSpec(4)
    assert parse_tree_spec("dynamic:total=60,depth=6,topk=10") == DynamicSpec(60, 6, 10)
    spec = parse_tree_spec("static:eagle1")
    assert isinstance(spec, StaticSpec) and spec.shape.num_nodes == 26
    assert parse_tree_spec("static:[[0],[1],[0,0]]").shape.parents == (-1, 0, 0, 1)
    path = tmp_path / "paths.json"
    path.write_text(json.dumps([[0], [0, 0]]))
    assert parse_tree_spec(f"static:{path}").shape.parents == (-1, 0, 1)


@pytest.mark.parametrize("spec", [
    "chain", "chain:0", "chain:x", "tree:4", "static:", "static:nope", "static:missing.json",
    "static:[[0],[0,0,0]]", "static:[[0]", "dynamic:total=0", "dynamic:width=3", "dynamic:total=5,depth",
])
def test_bad_tree_specs_raise_with_grammar(spec):
    with pytest.raises(ValueError, match="tree spec grammar"):
        parse_tree_spec(spec)


def _table_expand(vocab=12, seed=0, calls=None):
    # draft log-probs that depend on (depth, token): a deterministic fake drafter
    table = torch.randn(8, vocab, vocab, generator=torch.Generator().manual_seed(seed)).log_softmax(-1)

    def expand(frontier):
        if calls is not None:
            calls.append(frontier)
        return table[frontier.depth, frontier.tokens]  # (F, V)

    return expand, table


def _reference_dynamic(root, table, depth, topk, total):
    # plain-python EAGLE-2: pool of (score, id, parent, token, depth); ties -> lower id
    pool = [(0.0, 0, -1, root, 0)]
    frontier = [0]
    for d in range(depth):
        new = []
        for node in frontier:
            row = table[d, pool[node][3]]
            for token in row.topk(topk).indices.tolist():
                new.append((pool[node][0] + float(row[token]), len(pool) + len(new), node, token, d + 1))
        pool += new
        frontier = [n[1] for n in sorted(new, key=lambda n: (-n[0], n[1]))[:topk]]
    kept = sorted(n[1] for n in sorted(pool[1:], key=lambda n: (-n[0], n[1]))[:total])
    return [(pool[i][3], pool[i][4]) for i in [0] + kept], pool


def test_dynamic_tree_matches_reference_and_is_closed():
    calls = []
    expand, table = _table_expand(calls=calls)
    tree = build_dynamic_tree(3, expand, depth=4, topk=3, total=10)
    expected, pool = _reference_dynamic(3, table, 4, 3, 10)
    assert list(zip(tree.tokens.tolist(), tree.depth_list)) == expected
    assert tree.num_nodes == 11 and len(pool) == 1 + 3 + 3 * 9
    assert [len(f.nodes) for f in calls] == [1, 3, 3, 3]  # topk frontier nodes after the root
    assert [f.depth for f in calls] == [0, 1, 2, 3]


def test_dynamic_tree_ties_keep_ancestors():
    flat = lambda frontier: torch.zeros(len(frontier.nodes), 6)  # every score ties
    tree = build_dynamic_tree(1, flat, depth=5, topk=2, total=7)
    assert tree.num_nodes == 8  # Tree() validates that every parent precedes its child
    assert tree.depth_list == [0, 1, 1, 2, 2, 2, 2, 3]


def test_build_static_tree_uses_ranks():
    expand, table = _table_expand()
    shape = TreeShape.from_paths([[0], [1], [0, 0], [0, 2], [1, 0]])
    tree = build_static_tree(shape, 4, expand)
    top = lambda depth, token, rank: int(table[depth, token].topk(3).indices[rank])
    t = tree.tokens.tolist()
    assert t[1] == top(0, 4, 0) and t[2] == top(0, 4, 1)
    assert t[3] == top(1, t[1], 0) and t[4] == top(1, t[1], 2) and t[5] == top(1, t[2], 0)
