"""Draft trees from per-head top-k accuracies: E[tau] = 1 + sum of node probabilities (checked by
simulation), the greedy tree is optimal for its budget (checked by brute force), other shapes."""

import itertools
import random

import pytest

from drafters.training.heads_tree import accuracy_table, cartesian_tree, chain_tree, expected_tau, greedy_tree
from drafters.decode.tree import TreeShape

ACC = [[0.5, 0.2, 0.1], [0.4, 0.3, 0.05], [0.3, 0.1, 0.1]]  # acc[head][rank]


def test_expected_tau_by_hand():
    assert expected_tau([[0], [0, 0]], ACC) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    assert expected_tau([[0], [1], [1, 2]], ACC) == pytest.approx(1 + 0.5 + 0.2 + 0.2 * 0.05)
    assert chain_tree(ACC, 3).expected_tau == pytest.approx(1 + 0.5 + 0.2 + 0.2 * 0.3)


def accepted_length(paths, truth_ranks) -> int:
    # truth_ranks[d] = the rank of head d's candidate that is the true token (None: not in the top-k)
    nodes = {tuple(p) for p in paths}
    depth = 0
    while depth < len(truth_ranks) and truth_ranks[depth] is not None and \
            tuple(truth_ranks[: depth + 1]) in nodes:
        depth += 1
    return depth + 1  # + the bonus token


def test_expected_tau_matches_a_simulation_of_independent_heads():
    # heads right or wrong independently, head d's rank r holding the truth with probability ACC[d][r]
    tree = greedy_tree(ACC, budget=8)
    rng, n, total = random.Random(0), 40000, 0
    for _ in range(n):
        truth = []
        for row in ACC:
            u, rank = rng.random(), None
            for r, a in enumerate(row):
                if u < a:
                    rank = r
                    break
                u -= a
            truth.append(rank)
        total += accepted_length(tree.paths, truth)
    assert total / n == pytest.approx(tree.expected_tau, abs=0.02)


def all_trees(acc, budget):
    nodes = [p for d in range(1, len(acc) + 1) for p in itertools.product(range(len(acc[0])), repeat=d)]
    for size in range(1, budget + 1):
        for subset in itertools.combinations(nodes, size):
            chosen = set(subset)
            if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
                yield [list(p) for p in subset]


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_greedy_tree_is_optimal_for_its_budget(budget):
    acc = [[0.6, 0.25, 0.1], [0.5, 0.3, 0.1]]
    best = max(expected_tau(paths, acc) for paths in all_trees(acc, budget))
    tree = greedy_tree(acc, budget)
    assert len(tree.paths) == budget
    assert tree.expected_tau == pytest.approx(best)
    TreeShape.from_paths(tree.paths)  # prefix-closed, no duplicates


def test_greedy_tree_order_and_zero_probability_nodes():
    tree = greedy_tree(ACC, budget=6)
    assert tree.paths == [[0], [1], [2], [0, 0], [0, 1], [1, 0]]  # P .5 .2 .1 .2 .15 .08 > [0, 0, 0] .06
    assert tree.paths == [list(p) for p in TreeShape.from_paths(tree.paths).paths]  # sorted as TreeShape
    never = [[0.5, 0.0], [0.0, 0.0]]  # head 1 is never right: no depth-2 node is worth verifying
    assert greedy_tree(never, budget=10).paths == [[0]]
    assert greedy_tree([[0.0], [0.0]], budget=5).paths == [[0]]  # the cheapest tree when nothing is ever right
    assert greedy_tree(ACC, budget=200).paths[-1] == [2, 2, 2]  # every non-zero node fits


def test_other_shapes_and_errors():
    assert cartesian_tree(ACC, [2, 1]).paths == [[0], [1], [0, 0], [1, 0]]
    assert chain_tree(ACC, 2).paths == [[0], [0, 0]]
    assert accuracy_table([[3, 1], [0, 0]], [4, 0]) == [[0.75, 0.25], [0.0, 0.0]]
    with pytest.raises(ValueError, match="budget 0 must be >= 1"):
        greedy_tree(ACC, 0)
    with pytest.raises(ValueError, match="tree depth 4 exceeds the 3 heads"):
        expected_tau([[0, 0, 0, 0]], ACC)
    with pytest.raises(ValueError, match="tree depth 4 exceeds the 3 heads"):
        chain_tree(ACC, 4)
