"""Mean accepted length (tau) of a greedy chain of drafts from its per-step acceptance rates: the one
formula the held-out evaluations predict tau_pred with (drafters.training.eagle3 / eagle1, train/heads.py)
and eval/tau.py's speedup model inverts (drafters.decode.evaluate).

    tau = 1 + sum_{k=1..K} prod_{j<=k} acc_j

acc_k = P(draft k accepted | drafts 1..k-1 accepted); the 1 is the bonus token every round commits. With
one rate a at every step, tau = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a), a closed form that also
reads for a real K (a mean drafted depth). Trees generalise it: `tree_tau`, with rates by depth and rank.
`depth_acceptance` is the measured side: per depth, the rounds that accepted it over those that drafted it.
"""

import math
from collections.abc import Sequence


def chain_tau(accuracy: Sequence[float]) -> float:
    # accuracy[k - 1] = acc_k, k = 1 .. K
    return 1 + sum(math.prod(accuracy[:k + 1]) for k in range(len(accuracy)))


def geometric_chain_tau(a: float, k: float) -> float:
    # chain_tau([a] * k) for a in [0, 1], any real k >= 0: (1 - a^(k+1)) / (1 - a), k + 1 at a = 1
    return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def path_probability(path: Sequence[int], rates: Sequence[Sequence[float]]) -> float:
    # path = the ranks of a node's ancestors-or-self among their siblings, root's child first;
    # P(node accepted) = prod_d rates[d][rank_d]; 0 where the table has no such depth or rank
    return math.prod(rates[d][r] if d < len(rates) and r < len(rates[d]) else 0.0 for d, r in enumerate(path))


def tree_tau(paths, rates: Sequence[Sequence[float]]) -> float:
    """Expected tau of a draft tree given as its nodes' rank paths: 1 + sum over nodes of P(node accepted),
    with independent acceptance by depth and rank (rates[d][r]: the rank-r child at depth d + 1)."""
    return 1.0 + sum(path_probability(p, rates) for p in paths)


def position_acceptance(accepted: Sequence[int], depths: Sequence[int], rounds_per_answer: Sequence[int],
                        bucket: int = 32) -> list[dict]:
    """Rounds grouped by where in its answer each one starts. accepted[i], depths[i]: round i's accepted drafts and
    its tree's depth, the rounds of answer 0 first, then answer 1's, ... (rounds_per_answer[j] of answer j). A round
    that starts after p committed tokens of its answer (p = sum over the answer's earlier rounds of accepted + 1)
    falls in [b * bucket, (b + 1) * bucket) with b = p // bucket. -> per non-empty bucket, in order:
    {"start": b * bucket, "rounds", "tau", "per_depth_acceptance"}."""
    if sum(rounds_per_answer) != len(accepted) or len(depths) != len(accepted):
        raise ValueError(f"{len(accepted)} rounds, {len(depths)} depths, but the answers hold "
                         f"{sum(rounds_per_answer)} rounds")
    groups: dict[int, list[int]] = {}  # bucket -> round indices
    i = 0
    for rounds in rounds_per_answer:
        position = 0
        for _ in range(rounds):
            groups.setdefault(position // bucket, []).append(i)
            position += accepted[i] + 1
            i += 1
    return [{"start": b * bucket, "rounds": len(idx), "tau": sum(accepted[i] + 1 for i in idx) / len(idx),
             "per_depth_acceptance": depth_acceptance([accepted[i] for i in idx], [depths[i] for i in idx])}
            for b, idx in sorted(groups.items())]


def depth_acceptance(accepted: Sequence[int], depths: Sequence[int]) -> list[float]:
    """[d - 1] = rounds that accepted depth d / rounds whose tree reached depth d, d = 1 .. deepest;
    accepted[i], depths[i]: round i's accepted drafts and its tree's depth."""
    deepest = max(depths, default=0)
    return [sum(a >= d for a in accepted) / max(sum(t >= d for t in depths), 1) for d in range(1, deepest + 1)]
