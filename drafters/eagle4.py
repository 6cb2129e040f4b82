"""EAGLE-4 drafter: an EAGLE-3 drafter (drafters.eagle3; a sliding-window decoder layer through its layer_types /
sliding_window) plus a low-rank candidate head that drafts without the full (Vd, h) head product.

The candidate head (names as NeMo Automodel's LlamaForCausalLMEagle4 export writes them):
    efficient_lm_head_down_proj  B (r, h)    x -> B x          (r)
    efficient_lm_head            A (Vd, r)   B x -> A (B x)    (Vd)  the low-rank logits z~ = A B x
A B approximates the full draft head W = lm_head.weight (Vd, h); a fresh head is its truncated SVD,
W = U S V^T ~ U_r S_r V_r^T, A = U_r sqrt(S_r), B = sqrt(S_r) V_r^T (init_candidate_head).

Drafting one position (x = the normed hidden the head reads, (h,)):
    z~   = A (B x)                      r h + Vd r multiply-adds
    cand = top-k of z~                  (k,) draft ids
    z    = W[cand] x                    k h: the EXACT logits of the candidates
    draft logits = z on cand, -inf elsewhere (Vd)
Cost r (h + Vd) + k h against h Vd for the full head; SmolLM2 (h 576, Vd 32000), r 64, k 64: 2.12M against 18.4M
multiply-adds, 0.11x. Greedy drafts the argmax among the candidates (the full head's argmax whenever it is one of
them: candidate recall); sampling draws from softmax over the candidates of the exact logits, and that restricted
distribution is the q the verifier is handed, so verification stays lossless.

Training (drafters.training.eagle4): stage 1 is EAGLE-3's training-time test, the candidate head frozen; stage 2
freezes everything else and trains A and B alone on KL(softmax(W x) || softmax(A B x)) at every TTT depth.

What differs from EAGLE-3: the candidate head's two parameters and `draft_logits` (what drafting ranks). Training
and the full-head logits (`compute_logits`) are EAGLE-3's.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafters.draft_vocab import DraftVocab
from drafters.eagle3 import Eagle3Config, Eagle3Drafter


@dataclass
class Eagle4Config(Eagle3Config):
    rank: int = 64  # r of the candidate head A (Vd, r) B (r, h)
    candidates: int = 64  # k: the low-rank head's top-k that the full head rescores

    def __post_init__(self):
        super().__post_init__()
        problems = []
        most = min(self.draft_vocab_size, self.hidden_size)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= most:
            problems.append(f"rank={self.rank!r} must be in [1, {most}]: a rank-r head A (Vd x r) B (r x h) of the "
                            f"{self.draft_vocab_size} x {self.hidden_size} draft head has rank at most min(Vd, h)")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or \
                not 1 <= self.candidates <= self.draft_vocab_size:
            problems.append(f"candidates={self.candidates!r} must be in [1, {self.draft_vocab_size}] (the draft "
                            "vocabulary): the full head rescores the low-rank head's top-k")
        if self.sliding_window is not None and self.sliding_window > self.max_position_embeddings:
            problems.append(f"sliding_window={self.sliding_window} is larger than the context "
                            f"(max_position_embeddings={self.max_position_embeddings}): no window")
        if problems:
            raise ValueError("EAGLE-4 config: " + "; ".join(problems))

    @classmethod
    def from_target_config(cls, config, draft_vocab_size: int, layers=None, num_layers: int = 1, *,
                           rank: int = 64, candidates: int = 64, window: int | None = None,
                           **norms) -> "Eagle4Config":
        # window: every decoder layer `sliding_attention` within that many positions (null: full attention)
        base = Eagle3Config.from_target_config(config, draft_vocab_size, layers, num_layers, **norms)
        fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
        if window is not None:
            fields.update(layer_types=["sliding_attention"] * num_layers, sliding_window=window)
        return cls(**fields, rank=rank, candidates=candidates)


class Eagle4Drafter(Eagle3Drafter):
    def __init__(self, config: Eagle4Config, draft_vocab: DraftVocab | None = None):
        super().__init__(config, draft_vocab)
        c = config
        self.efficient_lm_head_down_proj = nn.Linear(c.hidden_size, c.rank, bias=False)  # B (r, h)
        self.efficient_lm_head = nn.Linear(c.rank, c.draft_vocab_size, bias=False)  # A (Vd, r)
        self.init_candidate_head()

    @property
    def candidate_parameters(self) -> list[nn.Parameter]:  # A and B: all stage 2 trains
        return [self.efficient_lm_head.weight, self.efficient_lm_head_down_proj.weight]

    @torch.no_grad()
    def init_candidate_head(self) -> None:
        """A, B <- the rank-r truncated SVD of lm_head.weight W (Vd, h): W ~ U_r S_r V_r^T, A = U_r sqrt(S_r) (Vd, r),
        B = sqrt(S_r) V_r^T (r, h). With r = min(Vd, h), A B = W (up to float error)."""
        weight = self.lm_head.weight.float()
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)  # (Vd, m), (m,), (m, h), m = min(Vd, h)
        r, root = self.config.rank, s[:self.config.rank].sqrt()
        self.efficient_lm_head.weight.copy_(u[:, :r] * root)  # (Vd, r)
        self.efficient_lm_head_down_proj.weight.copy_(root[:, None] * vh[:r])  # (r, h)

    def init_from_target(self, lm_head_weight: Tensor, draft_vocab: DraftVocab | None = None):
        super().init_from_target(lm_head_weight, draft_vocab)
        self.init_candidate_head()  # from the head it now has

    def low_rank_logits(self, normed: Tensor) -> Tensor:
        """normed (..., h), what lm_head reads -> z~ = A (B x) (..., Vd)."""
        return self.efficient_lm_head(self.efficient_lm_head_down_proj(normed))

    def candidate_logits(self, normed: Tensor) -> tuple[Tensor, Tensor]:
        """normed (..., h) -> (candidates (..., k) draft ids, the low-rank head's top-k; their exact logits (..., k)
        W[cand] x from the full head's rows)."""
        cand = self.low_rank_logits(normed).topk(self.config.candidates, dim=-1).indices  # (..., k)
        rows = self.lm_head.weight[cand]  # (..., k, h)
        return cand, (rows @ normed.unsqueeze(-1)).squeeze(-1)  # (..., k)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """What drafting ranks (differs from EAGLE-3's full-head logits): hidden (..., h) -> (..., Vd), the exact
        logits on the k candidates and -inf elsewhere, so softmax over them is the restricted distribution q."""
        normed = self.head_input(hidden)
        cand, exact = self.candidate_logits(normed)
        out = torch.full((*normed.shape[:-1], self.config.draft_vocab_size), float("-inf"), dtype=exact.dtype,
                         device=exact.device)
        return out.scatter_(-1, cand, exact)


def candidate_recall(full_logits: Tensor, low_rank_logits: Tensor, k: int) -> Tensor:
    """(..., Vd) each -> (...,) bool: the full head's argmax is among the low-rank head's top-k."""
    top = low_rank_logits.topk(k, dim=-1).indices  # (..., k)
    return (top == full_logits.argmax(-1, keepdim=True)).any(-1)
