"""Mean accepted length (tau) of a greedy chain of drafts from its per-step acceptance rates: the one
formula the held-out evaluations predict tau_pred with (drafters.training.eagle3 / eagle1, train/heads.py)
and eval/tau.py's speedup model inverts (drafters.decode.evaluate).

    tau = 1 + sum_{k=1..K} prod_{j<=k} acc_j

acc_k = P(draft k accepted | drafts 1..k-1 accepted); the 1 is the bonus token every round commits. With
one rate a at every step, tau = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a), a closed form that also
reads for a real K (a mean drafted depth). Trees generalise it: drafters.training.heads_tree.expected_tau.
"""

import math
from collections.abc import Sequence


def chain_tau(accuracy: Sequence[float]) -> float:
    # accuracy[k - 1] = acc_k, k = 1 .. K
    return 1 + sum(math.prod(accuracy[:k + 1]) for k in range(len(accuracy)))


def geometric_chain_tau(a: float, k: float) -> float:
    # chain_tau([a] * k) for a in [0, 1], any real k >= 0: (1 - a^(k+1)) / (1 - a), k + 1 at a = 1
    return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
