"""DFlash drafter (arXiv 2602.06036): one forward pass of a small block-diffusion drafter drafts a
whole block of tokens, conditioned on fused target features injected as keys / values.

Knows nothing about the target model, datasets or decoding trees: callers hand it the fused target
features, the target's frozen token embedding module (`embed`), the target's frozen LM head rows
(`attach_head`) and the target logits that serve as labels. Module names are those of the DFlash
reference checkpoints, SGLang's `DFlashDraftModel` and speculators' `dflash` (`fc`, `hidden_norm`,
`layers.{i}.*` with per-head `q_norm` / `k_norm`, `norm`), so export is a rename at most.

The block (docs/conventions.md "DFlash"). A block anchored at position a has B = block_size slots at
positions a .. a+B-1 holding the tokens [x_a, M, ..., M]: x_a the last verified token (when drafting:
the pending token, which the target has not read yet), M = mask_token_id (a token of the target's
vocabulary whose frozen embedding the drafter learns to read as "unknown"). Slot j (1 <= j <= B-1)
predicts token a+j itself (not the token after it); slot 0 predicts nothing. Per drafter layer:
    c_t = hidden_norm(fc(F_t))                    F_t (n*h) = fused target features of position t
    u   = input_layernorm(x)                      x (B, h) the block stream (embeddings at layer 0)
    q   = rope(q_norm(q_proj(u)))                 block slots only
    K   = rope(k_norm(k_proj([c_0..c_{a-1}; u])))  V = v_proj([c_0..c_{a-1}; u])
    x   = x + o_proj(softmax(q K^T / sqrt(D)) V)  every slot sees the whole context (t < a) and
                                                  every slot of its own block (bidirectional)
    x   = x + mlp(post_attention_layernorm(x))
and after the last layer logits_j = head(norm(x_j)) with head = the target's frozen LM head rows of
the draft vocabulary. The context keys / values c_t are the same for every block that sees them, so
decoding caches them per layer (`DFlashCache`) and never computes a key from a drafted token.

What differs from EAGLE-3 (drafters.eagle3; both take their layer geometry from drafters.layers): no step-by-step unroll and no KV cache of drafted
tokens (one pass drafts B-1 tokens); q/k/v read the h-wide normed block stream, not cat(embed,
hidden); the target features enter as keys / values of every layer (after fc + hidden_norm), not
as the residual stream; Qwen3-style per-head q/k norms; any number of layers; the LM head is the
target's own (frozen, draft-vocabulary rows), not a trained copy.

Training (`block_unroll`, `sample_anchors`, `block_label_rows`): several blocks per row at random
anchors a, anchor eligible iff loss_mask[a] = loss_mask[a+1] = 1; block slot j's label is the target's
row a+j-1 (its distribution over token a+j), counted iff loss_mask[a+j] = 1 and a+j is inside the row.
The objective (per-slot weights, soft labels over the draft vocabulary) is drafters.training.dflash's.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from drafters.draft_vocab import DraftVocab
from drafters.eagle3 import Eagle3Drafter
from drafters.layers import DraftAttention, llama_config, target_layer_fields
from drafters.targets import default_eagle3_layers  # [2, L//2, L-3], HF hidden_states indices


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    max_position_embeddings: int  # the target's
    num_hidden_layers: int  # drafter layers (the paper: 5 for Qwen3-8B)
    block_size: int  # B slots per block: the anchor + B-1 mask tokens, so B-1 drafts per pass
    mask_token_id: int  # a target token id; its frozen embedding fills slots 1..B-1
    aux_layers: list[int] = field(default_factory=list)  # HF hidden_states indices, low to high
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    final_logit_softcapping: float | None = None  # the target's (Gemma-2 style), applied to the head

    def __post_init__(self):
        # checked where a config is read (a checkpoint's drafter.json, an export's config.json): a wrong type or
        # range would surface later as a TypeError in the decoder, or as advice about trees of depth -1
        least = {"hidden_size": 1, "intermediate_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                 "head_dim": 1, "vocab_size": 1, "draft_vocab_size": 1, "max_position_embeddings": 1,
                 "num_hidden_layers": 1, "block_size": 2}  # block: the anchor and at least one mask slot
        problems = [f"{name}={getattr(self, name)!r} must be an integer >= {k}" for name, k in least.items()
                    if not _is_int(getattr(self, name)) or getattr(self, name) < k]
        vocab = self.vocab_size if _is_int(self.vocab_size) else 0
        if not _is_int(self.mask_token_id) or not 0 <= self.mask_token_id < vocab:
            problems.append(f"mask_token_id={self.mask_token_id!r} must be a token id in [0, vocab_size={vocab})")
        if not isinstance(self.aux_layers, list) or not all(_is_int(i) and i >= 0 for i in self.aux_layers):
            problems.append(f"aux_layers={self.aux_layers!r} must be a list of layer indices >= 0")
        if problems:
            raise ValueError("DFlash config: " + "; ".join(problems))

    @classmethod
    def from_target_config(cls, config, draft_vocab_size: int, *, mask_token_id: int, layers=None,
                           num_layers: int = 1, block_size: int = 8) -> "DFlashConfig":
        fields = target_layer_fields(config)  # the layer geometry of every drafter family
        num_target_layers = config.get_text_config().num_hidden_layers
        layers = default_eagle3_layers(num_target_layers) if layers is None else list(layers)
        problems = []
        if len(set(layers)) != len(layers) or not all(0 <= i <= num_target_layers for i in layers):
            problems.append(f"aux layers {layers}: want distinct HF hidden_states indices in [0, {num_target_layers}] "
                            f"for this {num_target_layers}-layer target")
        if not 0 < draft_vocab_size <= fields["vocab_size"]:
            problems.append(f"draft_vocab_size={draft_vocab_size} must be in [1, target vocab {fields['vocab_size']}]")
        if num_layers < 1:
            problems.append(f"num_layers={num_layers} must be >= 1")
        if block_size < 2:
            problems.append(f"block_size={block_size} must be >= 2 (the anchor and at least one mask slot)")
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or \
                not 0 <= mask_token_id < fields["vocab_size"]:
            problems.append(f"mask_token_id={mask_token_id!r} must be a token id in [0, {fields['vocab_size']})")
        if problems:
            raise ValueError("DFlash: " + "; ".join(problems))
        softcap = getattr(config.get_text_config(), "final_logit_softcapping", None)
        return cls(**fields, draft_vocab_size=draft_vocab_size, num_hidden_layers=num_layers, block_size=block_size,
                   mask_token_id=mask_token_id, aux_layers=layers, final_logit_softcapping=softcap)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- the layers ---------------------------------------------------------------------------------


def rope_one(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x (B, H, S, D) -> RoPE at the positions cos / sin (B, S, D) were computed for
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


class DFlashAttention(nn.Module):
    """GQA attention of the block stream over [context keys; block keys]. Differs from EAGLE-3's:
    q/k/v read the h-wide normed stream, per-head RMSNorm on q and k (Qwen3), and the context keys /
    values are the fused target features through the same k_proj / v_proj (`keys_values`)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)  # Qwen3RMSNorm: the same math
        self.k_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(*x.shape[:2], -1, self.head_dim)  # (B, S, H*D) -> (B, S, H, D)

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # x (B, Q, h) normed block stream -> q (B, Hq, Q, D)
        return rope_one(self.q_norm(self._heads(self.q_proj(x))).transpose(1, 2), cos, sin)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        # x (B, S, h): context c_t or the normed block stream -> k (normed, RoPE), v (B, Hkv, S, D)
        k = rope_one(self.k_norm(self._heads(self.k_proj(x))).transpose(1, 2), cos, sin)
        return k, self._heads(self.v_proj(x)).transpose(1, 2)

    attend = DraftAttention.attend  # softmax(q k^T / sqrt(D) where mask) v -> o_proj -> (B, Q, h)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(c))
        # DFlash2's dynamic convolutions around each sublayer (drafters.dflash2); None: DFlash's plain sublayers.
        # Instance attributes, not class defaults (a class attribute would hide the submodule nn.Module registers)
        self.attention_conv = self.mlp_conv = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor] | None,
                mask: Tensor | None) -> Tensor:
        """x (B, Q, h) block stream at the positions of cos / sin; context = this layer's (keys, values)
        (B, Hkv, S, D) of S context slots, or None; mask (B or 1, 1, Q, S + Q) bool over [context; block],
        None = every query sees every key. -> (B, Q, h)."""

        def attention(u: Tensor) -> Tensor:  # u (B, Q, h) the normed block stream
            q = self.self_attn.query(u, cos, sin)
            k, v = self.self_attn.keys_values(u, cos, sin)
            if context is not None:
                k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)
            return self.self_attn.attend(q, k, v, mask)

        x = x + around(self.attention_conv, attention, self.input_layernorm(x))
        return x + around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


def around(conv: nn.Module | None, sublayer, u: Tensor) -> Tensor:
    """sublayer(u), or conv(sublayer, u) where a DFlash2 convolution wraps it (drafters.dflash2.DynamicConv)."""
    return sublayer(u) if conv is None else conv(sublayer, u)


# ---- training inputs: anchors, blocks, labels ------------------------------------------------------------------


def eligible_anchors(loss_mask: Tensor) -> Tensor:
    """(B, T) bool: position a may anchor a block iff token a is learnt and so is token a+1 (the first
    draft's label): the pending token while drafting a reply is always a reply token."""
    first_label = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], 1)
    return loss_mask.bool() & first_label.bool()


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to `num_anchors` distinct eligible anchors per row, uniformly without replacement, ascending.
    -> anchors (B, N) long, keep (B, N) bool; N = min(num_anchors, most eligible positions of any row,
    at least 1); a row with fewer has keep False (anchor 0) in its last slots. Drawn on the CPU from
    `generator` (T uniforms per row), so the draw depends only on the generator state and loss_mask."""
    eligible = eligible_anchors(loss_mask).cpu()  # (B, T)
    counts = eligible.sum(1)  # (B,)
    n = max(1, min(num_anchors, int(counts.max())))
    scores = torch.rand(eligible.shape, generator=generator)  # (B, T) in [0, 1)
    scores = torch.where(eligible, scores, 2.0)  # ineligible positions sort last
    chosen = scores.argsort(dim=1, stable=True)[:, :n]  # (B, N)
    keep = torch.arange(n)[None] < counts[:, None].clamp(max=n)  # (B, N)
    anchors = torch.where(keep, chosen, eligible.shape[1]).sort(dim=1).values  # kept first, ascending
    anchors = torch.where(keep, anchors, 0)
    device = loss_mask.device
    return anchors.to(device), keep.to(device)


def block_ids(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """-> (B, N, Bk) block tokens: [x_a, M, ..., M] for each anchor a."""
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    return ids


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """-> (B, N, Bk) positions a .. a+Bk-1 of each block's slots."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def block_attention_mask(anchors: Tensor, keep: Tensor, seq_len: int, block_size: int) -> Tensor:
    """(B, 1, N*Bk, T + N*Bk) bool over the keys [context 0..T-1 | block 0 | ... | block N-1]: slot (n, j)
    sees context t < anchors[n] (the features of every committed token before the anchor; the anchor's
    own feature does not exist yet while drafting) and all Bk slots of block n, nothing of other blocks.
    Blocks that are not kept see only themselves (never a fully masked row: SDPA would give NaN)."""
    batch, n = anchors.shape
    t = torch.arange(seq_len, device=anchors.device)
    context = (t[None, None] < anchors[..., None]) & keep[..., None]  # (B, N, T)
    context = context.repeat_interleave(block_size, dim=1)  # (B, N*Bk, T)
    block = torch.arange(n * block_size, device=anchors.device) // block_size  # (N*Bk,) block of each slot
    own = (block[:, None] == block[None, :]).expand(batch, -1, -1)  # (B, N*Bk, N*Bk)
    return torch.cat([context, own], dim=2)[:, None]


# Labels: slot j (1 <= j <= Bk-1) of the block at a drafts token a+j; the target's logits at row a+j-1 are
# its distribution over token a+j, so the label of slot j is target row a+j-1. It counts iff token a+j is
# learnt (loss_mask[a+j] = 1; drafters.training.data), inside the row, and the block is kept.

def block_label_rows(anchors: Tensor, block_size: int) -> Tensor:
    """-> (B, N, Bk-1) target row a+j-1 labelling slot j = 1..Bk-1 of each block."""
    return anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)


def block_prev_ids(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """-> (B, N, Bk-1) teacher-forced prev of slot j = 1..Bk-1: token a+j-1 (the anchor for j = 1), the token
    the target committed before slot j's label, which DSpark's Markov head reads (drafters.dspark). Positions past
    the row's end are clamped (their labels never count: block_label_mask)."""
    rows = block_label_rows(anchors, block_size).clamp(max=input_ids.shape[1] - 1)  # a+j-1
    return input_ids.gather(1, rows.flatten(1)).view_as(rows)


def block_label_mask(anchors: Tensor, keep: Tensor, loss_mask: Tensor, block_size: int) -> Tensor:
    """-> (B, N, Bk-1) bool: slot j's label counts (token a+j learnt, inside the row, block kept)."""
    seq_len = loss_mask.shape[1]
    token = block_label_rows(anchors, block_size) + 1  # (B, N, Bk-1): a + j
    learnt = loss_mask.gather(1, token.clamp(max=seq_len - 1).flatten(1)).view_as(token).bool()
    return keep[..., None] & (token < seq_len) & learnt


# ---- the drafter --------------------------------------------------------------------------------


@dataclass
class DFlashCache:
    """Per drafter layer, the keys / values of the committed context: slot t = position t. Never holds a
    drafted token's key (block keys live for one pass only)."""
    keys: list[Tensor] = field(default_factory=list)  # per layer (B, Hkv, S, D)
    values: list[Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def layer(self, i: int) -> tuple[Tensor, Tensor] | None:
        return (self.keys[i], self.values[i]) if self.keys else None

    def append(self, kv: list[tuple[Tensor, Tensor]]) -> None:
        if not self.keys:
            self.keys, self.values = [k for k, _ in kv], [v for _, v in kv]
        else:
            self.keys = [torch.cat([old, k], 2) for old, (k, _) in zip(self.keys, kv)]
            self.values = [torch.cat([old, v], 2) for old, (_, v) in zip(self.values, kv)]

    def crop(self, length: int) -> None:
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig, draft_vocab: DraftVocab | None = None):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.aux_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(llama_config(c))  # buffers not saved
        vocab = draft_vocab or DraftVocab.from_used(torch.arange(c.draft_vocab_size), c.vocab_size)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(vocab)
        # The target's LM head rows of the draft vocabulary (Vd, h): frozen, never saved (the target has
        # them), filled by attach_head; compute_logits refuses to run before.
        self.register_buffer("head", torch.zeros(c.draft_vocab_size, c.hidden_size), persistent=False)
        self.head_attached = False
        self.confidence_head = None  # DSpark's optional head (drafters.dspark); an attribute, not a class default
        # (a class attribute would hide the submodule nn.Module registers)

    set_draft_vocab = Eagle3Drafter.set_draft_vocab  # d2t / t2d from a DraftVocab, shapes checked
    draft_vocab = Eagle3Drafter.draft_vocab
    embed_ids = staticmethod(Eagle3Drafter.embed_ids)  # the target's frozen embedding, no grad
    topk_tokens = Eagle3Drafter.topk_tokens  # (log-probs, TARGET ids) through d2t

    @torch.no_grad()
    def attach_head(self, lm_head_weight: Tensor) -> "DFlashDrafter":
        """head <- the target LM head's rows (V, h) of the draft vocabulary's ids."""
        used = self.draft_vocab.used.to(lm_head_weight.device)
        self.head.copy_(lm_head_weight[used].to(self.head.device, self.head.dtype))
        self.head_attached = True
        return self

    # ---- the four pieces

    def project_context(self, features: Tensor) -> Tensor:
        return self.hidden_norm(self.fc(features))  # (B, T, n*h) -> c (B, T, h)

    def context_kv(self, context: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """c (B, S, h) at positions (B or 1, S) -> per layer (keys, values) (B, Hkv, S, D)."""
        cos, sin = self.rotary_emb(context, positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def run_block(self, embeds: Tensor, positions: Tensor, context: list | DFlashCache | None,
                  mask: Tensor | None) -> Tensor:
        """embeds (B, Q, h) block slots at positions (B or 1, Q); context per layer (or a DFlashCache);
        -> normed output (B, Q, h), the LM head's input."""
        cos, sin = self.rotary_emb(embeds, positions)
        x = embeds
        for i, layer in enumerate(self.layers):
            kv = context.layer(i) if isinstance(context, DFlashCache) else (context[i] if context else None)
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    fused_loss = True  # the loss may fuse the frozen head into its cross-entropy (no logits kept)

    def slot_logits(self, normed: Tensor, prev: Tensor | None) -> Tensor:
        """-> (..., Vd) a slot's logits; DFlash's slots ignore the token before them (DSpark's do not)."""
        return self.compute_logits(normed)

    def compute_logits(self, normed: Tensor) -> Tensor:
        """normed (..., h) -> (..., Vd): the target's head rows (and its logit softcap, if any)."""
        if not self.head_attached:
            raise RuntimeError("DFlashDrafter: no LM head attached; call attach_head(target.lm_head.weight) "
                               "(the drafter scores with the target's frozen head, which no checkpoint holds)")
        logits = normed @ self.head.to(normed.dtype).T
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- training

    def block_unroll(self, features, input_ids, embed, anchors, keep) -> Tensor:
        """All blocks of a batch in one pass (the training forward). Inputs aligned with the sequence the
        target read (rows right-padded, nothing shifted): features (B, T, n*h) fused at positions t;
        input_ids (B, T); anchors, keep (B, N) from `sample_anchors`. -> normed outputs (B, N, Bk, h), the
        LM head's input; slot j of block n drafts token anchors[n] + j (label rows: `block_label_rows`).
        The objective (drafters.training.dflash.block_loss) scores slots 1..Bk-1."""
        c, device = self.config, input_ids.device
        batch, seq_len = input_ids.shape
        bk, n = c.block_size, anchors.shape[1]
        ctx = self.context_kv(self.project_context(features), torch.arange(seq_len, device=device)[None])
        ids = block_ids(input_ids, anchors, bk, c.mask_token_id)  # (B, N, Bk)
        embeds = self.embed_ids(embed, ids.flatten(1))  # (B, N*Bk, h)
        positions = block_positions(anchors, bk).flatten(1)  # (B, N*Bk)
        mask = block_attention_mask(anchors, keep, seq_len, bk)  # (B, 1, N*Bk, T + N*Bk)
        return self.run_block(embeds, positions, ctx, mask).view(batch, n, bk, -1)

    # ---- inference: the same computation, one block at a time, context keys cached

    def extend_context(self, features: Tensor, cache: DFlashCache) -> None:
        """features (B, a, n*h) of the next a committed positions S..S+a-1 (S = len(cache))."""
        start = len(cache)
        positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
        cache.append(self.context_kv(self.project_context(features), positions))

    def draft(self, pending: Tensor, embed, cache: DFlashCache) -> tuple[Tensor, Tensor]:
        """pending (B,) the anchor token at position S = len(cache) (the context is positions 0..S-1).
        -> (normed outputs (B, Bk, h), logits (B, Bk-1, Vd)); logits row j-1 scores token S+j."""
        c, start = self.config, len(cache)
        ids = torch.full((pending.shape[0], c.block_size), c.mask_token_id, dtype=torch.long, device=pending.device)
        ids[:, 0] = pending
        positions = torch.arange(start, start + c.block_size, device=pending.device)[None]
        normed = self.run_block(self.embed_ids(embed, ids), positions, cache, mask=None)  # all keys visible
        return normed, self.compute_logits(normed[:, 1:])

