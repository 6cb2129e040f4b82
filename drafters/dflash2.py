"""DFlash2 drafter: DFlash (drafters.dflash) plus a grouped two-tap dynamic convolution around every sublayer and a
pairwise path selector over each slot's top-k candidates. One drafter pass still drafts the whole block; the
convolution lets a slot read the slot before it inside every layer, and the selector turns the block's independent
per-slot candidates into one coherent path (Inco AI / z-lab's DFlash 2, August 2026; docs/conventions.md "DFlash2").

Module names are those of the DFlash2DraftModel checkpoints (z-lab/dflash, the layout SGLang and vLLM load):
`layers.{i}.attention_conv.*`, `layers.{i}.mlp_conv.*` (`base_kernel`, `kernel_projection.weight`) and
`candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`, on DFlash's backbone
names, so export is a copy.

Dynamic convolution (`DynamicConv`, around attention and around the MLP of every layer). With x_j (h) the sublayer's
input at block slot j (after its RMSNorm), K = conv_kernel_size taps (2: two-tap), G = h / g groups of
g = conv_group_size channels, c a channel and grp(c) its group:
    d_j      = kernel_projection(x_j)                                       (2, K, G): one value per group and tap
    u_j[c]   = sum_{t<K} (base[0, t, c] + d_j[0, t, grp(c)]) x_{j-t}[c]     before the sublayer
    y        = sublayer(u)
    out_j[c] = sum_{t<K} (base[1, t, c] + d_j[1, t, grp(c)]) y_{j-t}[c]     after it, its kernel from x_j
x_{j-t} = 0 where j - t < 0: taps never cross the block's start, so slot 0 (the anchor) mixes nothing before it and
slot 1 reads the anchor. base (2, K, h) starts as the identity (tap 0 = 1, the rest 0) and kernel_projection at 0:
a fresh DFlash2 backbone computes exactly DFlash's. Only the block stream is convolved: the context keys / values
c_t are DFlash's (cached as they are).

Path selector (`PathSelector`). Slot d (1 <= d <= B-1) has unary logits U_d = head(n_d) (DFlash's, n_d the normed
output) and candidates C_d = its top-k draft ids (k = path_top_k). A candidate b after a predecessor a (a target id:
the anchor for d = 1, a candidate of slot d-1 after) scores
    S_d(a, b)    = U_d(b) + <P[a] * (H n_d), S[b]>        P, S (V, r) codebooks over target ids; H (r, h)
    q_d(b | a)   = softmax over b in C_d of S_d(a, b)     (0 off C_d)
H starts at 0, so a fresh selector ranks candidates by U_d alone (DFlash's slots). Drafting: a tree node at depth d-1
holding token a proposes its children from q_d(. | a) (siblings' subtrees differ, as DSpark's); a sampled node hands
its own q_d(. | a) to the verifier (lossless). A greedy chain with path_search "viterbi" drafts the best path
argmax_x sum_d log q_d(x_d | x_{d-1}) (`viterbi`: k states per slot, O(D k^2)); "walk" drafts each slot's argmax
given the slot before (the reference's greedy walk, what every tree's top-1 path is).

What differs from DFlash: the two convolutions per layer (`around`) and what drafting ranks; training adds the
selector's pairwise cross-entropy (drafters.training.dflash2) to DFlash's block loss.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.dflash import DFlashConfig, DFlashDrafter, _is_int

SEARCHES = ("viterbi", "walk")  # how a greedy chain picks its path through the candidates


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 2  # K taps of each dynamic convolution (2: the published two-tap)
    conv_group_size: int = 16  # g channels share one dynamic tap value
    selector_rank: int = 64  # r of the selector's codebooks (the published drafter: 256)
    path_top_k: int = 16  # k candidates per slot
    path_search: str = "viterbi"

    def __post_init__(self):
        super().__post_init__()
        problems, k, g = [], self.conv_kernel_size, self.conv_group_size
        if not _is_int(k) or not 1 <= k <= self.block_size:
            problems.append(f"conv_kernel_size={k!r} must be in [1, block_size={self.block_size}]: taps read the slots "
                            "before it in the block")
        if not _is_int(g) or g < 1 or self.hidden_size % g:
            problems.append(f"conv_group_size={g!r} must divide hidden_size={self.hidden_size} (channels sharing one "
                            "dynamic tap value)")
        if not _is_int(self.selector_rank) or self.selector_rank < 1:
            problems.append(f"selector_rank={self.selector_rank!r} must be an integer >= 1")
        if not _is_int(self.path_top_k) or not 1 <= self.path_top_k <= self.draft_vocab_size:
            problems.append(f"path_top_k={self.path_top_k!r} must be in [1, draft_vocab_size={self.draft_vocab_size}]")
        if self.path_search not in SEARCHES:
            problems.append(f"path_search={self.path_search!r} must be one of {', '.join(SEARCHES)}")
        if problems:
            raise ValueError("DFlash2 config: " + "; ".join(problems))

    @classmethod
    def from_target_config(cls, config, draft_vocab_size: int, *, conv_kernel_size: int = 2,
                           conv_group_size: int = 16, selector_rank: int = 64, path_top_k: int = 16,
                           path_search: str = "viterbi", **dflash) -> "DFlash2Config":
        base = DFlashConfig.from_target_config(config, draft_vocab_size, **dflash)
        fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
        return cls(**fields, conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                   selector_rank=selector_rank, path_top_k=path_top_k, path_search=path_search)


class DynamicConv(nn.Module):
    """The grouped dynamic causal convolution around one sublayer (module docstring): forward(sublayer, x)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        groups = hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0  # the identity: u = x, out = y
        self.base_kernel = nn.Parameter(base)  # (2, K, h): [before, after] x taps x channels
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def forward(self, sublayer, x: Tensor) -> Tensor:
        # x (B, S, h) with S = N * Bk block slots (N blocks side by side while training, 1 while drafting)
        dynamic = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel_size, -1)  # (B, S, 2, K, G)
        u = self._mix(x, self.base_kernel[0], dynamic[:, :, 0])
        return self._mix(sublayer(u), self.base_kernel[1], dynamic[:, :, 1])

    def _mix(self, x: Tensor, base: Tensor, dynamic: Tensor) -> Tensor:
        # x (B, S, h), base (K, h), dynamic (B, S, K, G) -> out_j = sum_t (base[t] + dynamic_j[t]) x_{j-t}, per block
        b, s, h = x.shape
        groups = dynamic.shape[-1]
        blocks = x.view(b, s // self.block_size, self.block_size, groups, self.group_size)  # (B, N, Bk, G, g)
        dynamic = dynamic.view(b, s // self.block_size, self.block_size, self.kernel_size, groups, 1)
        out = torch.zeros_like(blocks)
        for t in range(self.kernel_size):  # x_{j-t}: shifted t slots later, zeros before the block's slot 0
            shifted = blocks if t == 0 else F.pad(blocks[:, :, :-t], (0, 0, 0, 0, t, 0))
            out = out + (base[t].view(groups, self.group_size).to(x.dtype) + dynamic[:, :, :, t]) * shifted
        return out.view(b, s, h)


class PathSelector(nn.Module):
    """The pairwise term <P[a] * (H n), S[b]> of S_d(a, b) (module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        # plain (V, r) parameters under the published tensor names (no `.weight`), indexed by target ids; their entries
        # ~ N(0, r^-1/2) make each P[a]_i S[b]_i of variance 1/r, so the term is of the size of |H n|
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * rank ** -0.25)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * rank ** -0.25)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)  # the pairwise term starts at 0: the selector starts as DFlash

    def forward(self, normed: Tensor, prev: Tensor, cand: Tensor) -> Tensor:
        """normed (..., h) a slot's output, prev (..., P) predecessor target ids, cand (..., k) candidate target ids
        -> (..., P, k) the pairwise term of every (predecessor, candidate) pair."""
        gate = self.hidden_projection(normed)  # (..., r) H n
        left = self.predecessor_codebook[prev].to(gate.dtype) * gate[..., None, :]  # (..., P, r)
        return left @ self.successor_codebook[cand].to(gate.dtype).transpose(-1, -2)  # (..., P, k)


class DFlash2Drafter(DFlashDrafter):
    def __init__(self, config: DFlash2Config, draft_vocab=None):
        super().__init__(config, draft_vocab)
        c = config
        for layer in self.layers:
            layer.attention_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)
            layer.mlp_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)
        self.candidate_selector = PathSelector(c.vocab_size, c.hidden_size, c.selector_rank)

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]  # target id = draft id + d2t[draft id]

    def transition_scores(self, normed: Tensor, unary: Tensor, cand: Tensor, prev: Tensor) -> Tensor:
        """S_d(a, b): normed (..., h) slot d's output, unary (..., k) U_d at the candidates, cand (..., k) their draft
        ids, prev (..., P) predecessor target ids -> (..., P, k)."""
        return unary[..., None, :] + self.candidate_selector(normed, prev, self.target_ids(cand))

    def transition_logprobs(self, normed: Tensor, unary: Tensor, cand: Tensor, prev: Tensor) -> Tensor:
        """log q_d(b | a) over the candidates: (..., P, k)."""
        return self.transition_scores(normed, unary, cand, prev).float().log_softmax(-1)

    def best_path(self, normed: Tensor, unary: Tensor, anchor: int) -> Tensor:
        """The greedy chain's path through slots 1..D: normed (D, h), unary (D, Vd) -> (D,) target ids, Viterbi's
        argmax_x sum_d log q_d(x_d | x_{d-1}) with x_0 = the anchor."""
        values, cand = unary.topk(self.config.path_top_k, dim=-1)  # (D, k)
        first = self.transition_logprobs(normed[:1], values[:1], cand[:1], torch.tensor([[anchor]],
                                                                                      device=cand.device))[0, 0]
        rest = self.transition_logprobs(normed[1:], values[1:], cand[1:], self.target_ids(cand[:-1]))  # (D-1, k, k)
        index = viterbi(first, rest)  # (D,)
        return self.target_ids(cand.gather(1, index[:, None].to(cand.device))[:, 0])


def viterbi(first: Tensor, transitions: Tensor) -> Tensor:
    """The best path through D layers of k states: first (k,) the score of each state of layer 1, transitions
    (D-1, k, k) [d, i, j] the score of state j at layer d+2 after state i at layer d+1 -> (D,) state per layer
    maximising the summed score (ties: the lower index)."""
    score, back = first.float().cpu(), []
    for step in transitions.float().cpu():  # (k, k)
        total = score[:, None] + step  # (k, k) best path ending in i, then j
        score, best = total.max(0)  # (k,) each j's best predecessor i
        back.append(best)
    path = [int(score.argmax())]
    for best in reversed(back):
        path.append(int(best[path[-1]]))
    return torch.tensor(path[::-1])
