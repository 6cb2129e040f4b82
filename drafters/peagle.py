"""P-EAGLE drafter: EAGLE-3 (drafters.eagle3) that drafts all K tokens of a chain in one forward pass.

Module names are EAGLE-3's plus `mask_hidden` (speculators' `peagle`: the same weights, `layers.0.*` for
`midlayer.*`), so export is a rename.

The slots (docs/conventions.md "P-EAGLE"). EAGLE-3's alignment: a depth-0 slot at position t reads
(fc(F_t), token t+1) and drafts token t+2. A chain anchored at t adds slots of depth d = 1 .. K-1 at RoPE
positions t+d; slot d reads (fc(mask_hidden), M) with mask_hidden (1, 1, n*h) a learned stand-in for the fused
target features it cannot have, M = mask_token_id (a target id whose frozen embedding the drafter reads as
"unknown"), and drafts token t+2+d (label: the target's row t+1+d). Attention:
    depth-0 slot t    sees depth-0 slots <= t                           (EAGLE-3's step 0, causal)
    depth-d slot of t sees depth-0 slots <= t and depths 1..d of its own chain
So one pass over [committed pairs ; (F_t, pending) ; d = 1..K-1 mask slots], causal, drafts K tokens: the
root's children from the depth-0 row, depth-d nodes' children from row d. The slots do not read each other's
tokens, so a tree takes every depth-d node's children from row d (as DFlash does).

Training (conditional drop-token, `sample_chains`): every position is a depth-0 slot; chains start at the
positions whose first label is learnt; depth d keeps, per row, the first ceil(n x max(r^d, r_min)) of one random
ranking of them (r = down_sample_ratio, r_min = down_sample_ratio_min, n = eligible starts), so the chains kept
at depth d are a subset of those kept at d-1. The loss is one count-normalised mean over every counted slot of
every depth (drafters.training.peagle).

What differs from EAGLE-3: no training-time test unroll (no slot reads the drafter's own output hidden), one
forward per round instead of K sequential steps, and the mask_hidden parameter.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafters.draft_vocab import DraftVocab
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.layers import DraftKVCache, shift_left


@dataclass
class PEagleConfig(Eagle3Config):
    depth: int = 4  # K: tokens drafted per pass (the depth-0 slot and K-1 mask slots)
    mask_token_id: int = 0  # a target token id; its frozen embedding fills the mask slots

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or not 1 <= self.depth <= 64:
            problems.append(f"depth={self.depth!r} must be an integer in [1, 64] (tokens drafted per pass)")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or \
                not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id={self.mask_token_id!r} must be a token id in [0, {self.vocab_size})")
        if self.norm_output:  # differs from EAGLE-3: no step reads another's output
            problems.append("norm_output: P-EAGLE feeds no hidden state back to a next step")
        if self.sliding_layers:
            problems.append(f"layer_types {self.layer_types}: P-EAGLE's drafting pass has no sliding window")
        if problems:
            raise ValueError("P-EAGLE config: " + "; ".join(problems))

    @classmethod
    def from_target_config(cls, config, draft_vocab_size: int, layers=None, *, depth: int = 4,
                           mask_token_id: int = 0, **norms) -> "PEagleConfig":
        base = Eagle3Config.from_target_config(config, draft_vocab_size, layers, **norms)
        fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
        return cls(**fields, depth=depth, mask_token_id=mask_token_id)


class PEagleDrafter(Eagle3Drafter):
    def __init__(self, config: PEagleConfig, draft_vocab: DraftVocab | None = None):
        super().__init__(config, draft_vocab)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(config.aux_layers) * config.hidden_size))

    def mask_features(self, batch: int, count: int) -> Tensor:
        return self.mask_hidden.expand(batch, count, -1)  # (B, count, n*h), fc'd like real features

    # ---- training: every depth of every kept chain in one pass

    def parallel_unroll(self, features: Tensor, input_ids: Tensor, embed, starts: Tensor, keep: Tensor) -> Tensor:
        """features (B, T, n*h), input_ids (B, T) aligned as the target read them; starts (B, N) chain starts,
        keep (B, K-1, N) bool: chain n is kept at depth d (`sample_chains`). -> pre-norm outputs
        (B, T + (K-1) N, h): rows 0..T-1 the depth-0 slots (row t drafts token t+2), then depth 1..K-1 in
        blocks of N (row T + (d-1) N + n drafts token starts[n] + 2 + d)."""
        batch, seq_len = input_ids.shape
        n, deeper = starts.shape[1], keep.shape[1]
        device = input_ids.device
        ids0 = shift_left(input_ids, 1)  # token t+1 at depth-0 slot t
        ids = torch.cat([ids0, torch.full((batch, deeper * n), self.config.mask_token_id, device=device,
                                          dtype=torch.long)], 1)
        feats = torch.cat([features, self.mask_features(batch, deeper * n).to(features.dtype)], 1)
        depth = torch.arange(1, deeper + 1, device=device)[None, :, None]  # (1, K-1, 1)
        positions = torch.cat([torch.arange(seq_len, device=device)[None].expand(batch, -1),
                               (starts[:, None] + depth).flatten(1)], 1)  # (B, S)
        mask = chain_attention_mask(starts, keep, seq_len)
        hidden, _ = self.backbone(self.embed_ids(embed, ids), self.project_hidden_states(feats), positions, None,
                                  mask)
        return hidden

    # ---- inference

    def draft(self, last_feature: Tensor, pending: Tensor, embed, cache: DraftKVCache) -> tuple[Tensor, Tensor]:
        """last_feature (1, 1, n*h) the newest committed position's features, pending (1, 1) its next token,
        at slot S = len(cache); then K-1 mask slots at S+1 .. S+K-1, causal over the cache. -> (pre-norm
        outputs (1, K, h), logits (1, K, Vd)); row d ranks the children of a depth-d node. The caller crops the
        K slots (they are drafts)."""
        k, device = self.config.depth, pending.device
        feats = torch.cat([last_feature, self.mask_features(1, k - 1).to(last_feature.dtype)], 1)
        ids = torch.cat([pending, torch.full((1, k - 1), self.config.mask_token_id, device=device,
                                             dtype=torch.long)], 1)
        return self.prefill(feats, ids, embed, cache)


def chain_attention_mask(starts: Tensor, keep: Tensor, seq_len: int) -> Tensor:
    """(B, 1, S, S) bool over the slots of `parallel_unroll`, S = T + (K-1) N: depth-0 slot t sees depth-0 slots
    <= t; the depth-d slot of chain n sees depth-0 slots <= starts[n] and its own chain's depths 1..d. A slot not
    kept sees only itself (never a fully masked row: SDPA would give NaN)."""
    batch, n = starts.shape
    deeper, device = keep.shape[1], starts.device
    t = torch.arange(seq_len, device=device)
    top = torch.cat([(t[:, None] >= t[None]).expand(batch, -1, -1),  # (B, T, T) causal
                     torch.zeros(batch, seq_len, deeper * n, dtype=torch.bool, device=device)], 2)
    context = (t[None, None] <= starts[..., None])  # (B, N, T)
    context = context[:, None].expand(-1, deeper, -1, -1) & keep[..., None]  # (B, K-1, N, T)
    depth = torch.arange(deeper, device=device)
    own = (depth[:, None] >= depth[None])  # (K-1, K-1): depth d sees depths <= d
    chain = torch.eye(n, dtype=torch.bool, device=device)  # same chain
    deep = own[:, None, :, None] & chain[None, :, None, :]  # (K-1, N, K-1, N)
    deep = deep[None] & keep[:, None, None] & keep[:, :, :, None, None]  # both ends kept
    deep = deep | torch.eye(deeper * n, dtype=torch.bool, device=device).view(deeper, n, deeper, n)  # self
    bottom = torch.cat([context.flatten(1, 2), deep.flatten(1, 2).flatten(2)], 2)  # (B, (K-1)N, S)
    return torch.cat([top, bottom], 1)[:, None]


def chain_label_mask(loss_mask: Tensor, starts: Tensor, keep: Tensor) -> Tensor:
    """-> (B, K-1, N) bool: the depth-d slot of chain n counts iff kept and token starts[n] + 2 + d is learnt
    (inside the row)."""
    seq_len = loss_mask.shape[1]
    depth = torch.arange(1, keep.shape[1] + 1, device=starts.device)[None, :, None]
    token = starts[:, None] + 2 + depth  # (B, K-1, N)
    learnt = loss_mask.gather(1, token.clamp(max=seq_len - 1).flatten(1)).view_as(token).bool()
    return keep & (token < seq_len) & learnt


def sample_chains(loss_mask: Tensor, depth: int, ratio: float, ratio_min: float, generator: torch.Generator,
                  max_chains: int | None = None) -> tuple[Tensor, Tensor]:
    """Conditional drop-token: chain starts t are the positions whose depth-0 label (token t+2) is learnt; one
    uniform ranking per row (drawn on the CPU from `generator`), and depth d = 1..K-1 keeps the first
    ceil(n x max(ratio^d, ratio_min)) of it (n = the row's eligible starts, capped at max_chains), so depth d's
    chains are a subset of depth d-1's. -> starts (B, N) long (ascending rank order, 0 where unused),
    keep (B, K-1, N) bool."""
    eligible = shift_left(loss_mask, 2).bool().cpu()  # (B, T): token t+2 learnt
    counts = eligible.sum(1)  # (B,)
    if max_chains is not None:
        counts = counts.clamp(max=max_chains)
    scores = torch.rand(eligible.shape, generator=generator)
    scores = torch.where(eligible, scores, 2.0)  # ineligible last
    fractions = torch.tensor([max(ratio ** d, ratio_min) for d in range(1, depth)])  # (K-1,)
    kept = torch.ceil(counts[:, None].double() * fractions.double()[None]).long()  # (B, K-1)
    n = max(1, int(kept.max()) if depth > 1 else 1)  # chains are ranked: only depth 1's kept ones are ever read
    order = scores.argsort(dim=1, stable=True)[:, :n]  # (B, N) by rank
    rank = torch.arange(n)
    keep = rank[None, None] < kept[..., None]  # (B, K-1, N)
    device = loss_mask.device
    return order.to(device), keep.to(device)
