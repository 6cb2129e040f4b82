"""What the EAGLE drafters' layers (drafters.eagle3, drafters.eagle1) share: the layer geometry read from
the target, the attention over an input of a given width, and the drafter's own KV cache.

Geometry: a drafter layer is shaped like one of the target's decoder layers (hidden size, MLP width,
GQA heads, head_dim, RoPE, norm epsilon, activation) so that engines build it from the same config
fields; `target_layer_fields(target_config)` reads them (Gemma's names and per-layer-type RoPE
included) and `llama_config(c)` turns any config holding them into the LlamaConfig that transformers'
RoPE and MLP read. The training-time test's attention (TTTKeys, ttt_attention) lives here too: both
EAGLE families unroll through it. Knows nothing about a family's inputs, losses or decoding.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

ENGINE_AUX_LAYERS = 3  # fused target layers the engines read: SGLang and vLLM build fc with in_features = 3 x hidden


def target_layer_fields(config) -> dict:
    """A target's HF config -> the layer fields every drafter config holds (vocab and positions: the target's)."""
    cfg = config.get_text_config()
    # transformers 5.x keeps theta and scaling here; a target without rotary positions (Nemotron-H's attention
    # layers) still gets a rotary drafter, at Llama's default theta
    rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_theta": 10000.0})
    rope = dict(rope.get("full_attention", rope))  # Gemma-3: per layer type; drafter = full
    rope_theta = rope.pop("rope_theta")
    if "type" in rope:  # the legacy name of rope_type (Ministral-3 configs carry both): one name, as engines write it
        rope.setdefault("rope_type", rope.pop("type"))
    return dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=head_dim_of(cfg),
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        # the drafter's norms are RMSNorms whatever the target's are (Cohere's LayerNorm names its eps layer_norm_eps)
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_eps", None) or 1e-6,
        rope_theta=rope_theta,
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        hidden_act=drafter_activation(cfg),
    )


def drafter_activation(cfg) -> str:
    """The MLP activation of the drafter's layer: the target's (Gemma names it hidden_activation), unless it has
    weights of its own (Apertus' xIELU: a per-layer learnt shape, which no engine's drafter layer holds) or the config
    names none (LFM2's SwiGLU): then Llama's silu."""
    from transformers.activations import ACT2FN

    act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)
    if not isinstance(act, str) or act not in ACT2FN or any(True for _ in ACT2FN[act].parameters()):
        return "silu"
    return act


def head_dim_of(cfg) -> int:
    """The target's attention head size, for the drafter's one layer; where it varies per layer (Gemma-4's config
    refuses a global head_dim), hidden / heads."""
    try:
        head_dim = getattr(cfg, "head_dim", None)
    except Exception:  # noqa: BLE001  transformers' AmbiguousGlobalPerLayerAttributeError (a per-layer value)
        head_dim = None
    return head_dim or cfg.hidden_size // cfg.num_attention_heads


def llama_config(c) -> LlamaConfig:
    """A drafter config's layer as a LlamaConfig (transformers' RoPE and MLP read it)."""
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    return LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
        num_key_value_heads=c.num_key_value_heads, num_hidden_layers=1,
        vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=rope, hidden_act=c.hidden_act)


class DraftAttention(nn.Module):
    """GQA attention whose q/k/v read an input of width `input_width` (EAGLE-3: 2h = cat(embed, hidden);
    EAGLE-1: h, the fc output); keys and values are explicit, so the caller owns the cache."""

    def __init__(self, c, input_width: int):
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(input_width, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(input_width, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(input_width, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        shape = (*x.shape[:2], -1, self.head_dim)  # x (B, T, input_width)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(shape).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(shape).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: "Tensor | TTTKeys") -> Tensor:
        # softmax(q k^T / sqrt(D) where mask else -inf) v; mask (T, S) or (B, 1, T, S), True = see, or the
        # training-time test's structure (TTTKeys), computed without a (T, S) mask
        if isinstance(mask, TTTKeys):
            out = ttt_attention(q, keys, values, mask.step)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))  # (B, T, h)


# ---- the training-time test's attention -------------------------------------------------------------


@dataclass(frozen=True)
class TTTKeys:
    """The keys of training-time-test step i: [step 0 | step 1 | ... | step i], T positions each. Query (step i, t)
    sees step-0 keys at positions <= t (causal) and, of each step j in 1..i, only the key at its own position t
    (diagonal): exactly what drafting with a KV cache sees. ttt_attention_mask(T, i) is this as a dense
    (T, (i+1)T) mask, the reference; ttt_attention computes it in memory linear in T."""

    step: int


def ttt_attention_mask(seq_len: int, step: int, device=None) -> Tensor:
    """(T, (i+1)T) bool over the keys [step 0 | step 1 | ... | step i]: TTTKeys(i) materialised (the reference
    ttt_attention is tested against; 7 GiB at T = 32k, i = 6)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def ttt_attention(q: Tensor, keys: Tensor, values: Tensor, step: int) -> Tensor:
    """softmax over TTTKeys(step) without a (T, (i+1)T) mask. q (B, Hq, T, D); keys, values (B, Hkv, (i+1)T, D)
    -> (B, Hq, T, D).

    Step 0 is plain causal attention. For i > 0, one fused causal attention call over i "diagonal slots" placed
    before step 0's T keys computes the softmax over both: i placeholder query rows go first as well, so the call is
    square and query i+t sees the i slots and step-0 keys <= t. The diagonal scores s_j(t) = q_t . k_{j,t}
    (j = 1..i) ride in extra head dimensions:
        q'_t   = [q_t ; hi(s_1(t)), lo(s_1(t)), ..., hi(s_i(t)), lo(s_i(t))]   (hi + lo = s in fp32, 2 dims each)
        slot j = key [0 ; e_2j-1 + e_2j], value [0 ; e_j]   -> score q'_t . slot_j = s_j(t)
        k0_s   = [k_s ; 0],               value [v_s ; 0]
    so output channel D+j is slot j's softmax weight w_j(t), and the attention is
        out_t = out'_t[:D] + sum_j w_j(t) v_{j,t}.
    Memory and work are linear in T beyond the fused kernel's own causal attention."""
    t, d = q.shape[2], q.shape[3]
    group = q.shape[1] // keys.shape[1]
    k0, v0 = keys[:, :, :t], values[:, :, :t]
    if step == 0:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=True)
    kd = keys[:, :, t:].unflatten(2, (step, t))  # (B, Hkv, i, T, D): step j's key at each position
    vd = values[:, :, t:].unflatten(2, (step, t)).repeat_interleave(group, 1)  # (B, Hq, i, T, D)
    qg = q.unflatten(1, (keys.shape[1], group))  # (B, Hkv, G, T, D)
    with torch.autocast(q.device.type, enabled=False):  # fp32 scores: hi + lo keeps them exact in bf16
        scores = torch.einsum("bkgtd,bkjtd->bkgtj", qg.float(), kd.float()).flatten(1, 2)  # (B, Hq, T, i)
    hi = scores.to(q.dtype)
    lo = (scores - hi.float()).to(q.dtype)
    extra = -(-2 * step // 8) * 8  # 2i dims, padded to a multiple of 8 for the fused kernels
    q_aug = torch.cat([q, torch.stack([hi, lo], -1).flatten(-2), q.new_zeros(*q.shape[:3], extra - 2 * step)], -1)
    q_aug = F.pad(q_aug, (0, 0, step, 0))  # (B, Hq, i + T, D + extra): i placeholder rows first, dropped below
    slots_k = q.new_zeros(step, d + extra)
    slots_v = q.new_zeros(step, d + extra)
    for j in range(step):
        slots_k[j, d + 2 * j: d + 2 * j + 2] = 1
        slots_v[j, d + j] = 1
    b, hq = q.shape[:2]
    k_aug = torch.cat([slots_k.expand(b, hq, step, -1),
                       F.pad(k0, (0, extra)).repeat_interleave(group, 1)], 2)  # (B, Hq, i + T, D + extra)
    v_aug = torch.cat([slots_v.expand(b, hq, step, -1),
                       F.pad(v0, (0, extra)).repeat_interleave(group, 1)], 2)
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, is_causal=True, scale=d ** -0.5)[:, :, step:]
    weights = out[..., d: d + step]  # (B, Hq, T, i): each diagonal slot's softmax weight
    return out[..., :d] + torch.einsum("bhtj,bhjtd->bhtd", weights, vd)


@dataclass
class DraftKVCache:
    """KV cache of a drafter's decoder layer. A slot is an index into it; keys carry RoPE of the
    position they were computed at (slot == position along a chain, not inside a tree). A deeper EAGLE-3
    drafter's layers share one cache, stacked along the head axis (drafters.eagle3.Eagle3Drafter.backbone)."""
    keys: Tensor | None = None  # (B, Hkv, S, D); a deeper drafter's n layers: (B, n * Hkv, S, D)
    values: Tensor | None = None  # (B, Hkv, S, D)
    # (B or 1, S): the RoPE position of every slot, recorded by extend (a sliding-window layer needs them);
    # None once a slot was appended without one
    positions: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def past(self):
        return None if self.keys is None else (self.keys, self.values)

    def append(self, keys: Tensor, values: Tensor, positions: Tensor | None = None) -> None:
        past = self.past()
        known = positions is not None and (past is None or self.positions is not None)
        self.positions = self.key_positions(positions) if known else None
        self.keys = keys if past is None else torch.cat([past[0], keys], 2)
        self.values = values if past is None else torch.cat([past[1], values], 2)

    def key_positions(self, positions: Tensor) -> Tensor:
        """(B or 1, S + q): the cached slots' positions, then those of the q new entries `positions` (B or 1, q)."""
        if len(self) == 0:
            return positions
        if self.positions is None:
            raise ValueError("this cache's slots were appended without their positions; fill it with extend()")
        batch = max(self.positions.shape[0], positions.shape[0])
        return torch.cat([self.positions.expand(batch, -1), positions.expand(batch, -1)], 1)

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
        if self.positions is not None:
            self.positions = self.positions[:, :length]

    def extend(self, backbone, new_len: int, device, positions=None, mask=None) -> Tensor:
        """Run backbone(positions, past, mask) -> (hidden (B, q, h), (keys, values)) on q = new_len entries after the
        S cached slots and append their keys and values -> hidden. Defaults: positions S..S+q-1 (1, q), a chain;
        mask (q, S+q) causal, query j sees slots <= S + j."""
        past_len = len(self)
        if positions is None:
            positions = torch.arange(past_len, past_len + new_len, device=device)[None]
        if mask is None:
            mask = torch.ones(new_len, past_len + new_len, dtype=torch.bool, device=device).tril(past_len)
        hidden, (keys, values) = backbone(positions, self.past(), mask)
        self.append(keys, values, positions)
        return hidden


# ---- training-time test: which inputs, labels and keys step i uses --------------------------

def shift_left(x: Tensor, n: int) -> Tensor:
    """x (B, T, ...) -> y with y[:, t] = x[:, t+n], zeros past the end."""
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def ttt_input_ids(input_ids: Tensor, step: int) -> Tensor:
    # step i at position t reads token_{t+1+i} (the target's sequence, teacher-forced tokens)
    return shift_left(input_ids, 1 + step)  # (B, T); positions past the end read id 0 (no label)


# Labels of step i exist for positions t = 0 .. T-2-i (later positions have no target row).
# Step i at t has read token_{t+1+i} and predicts token_{t+2+i}; the target's logits at row t+1+i
# are its distribution over token t+2+i, so label[:, t] = target row t+1+i. The label counts iff
# token t+2+i is supervised: loss_mask[t+2+i] (drafters.training.data: loss_mask[s] = 1 iff token s is a
# token to learn), 0 past the end of the row.

def ttt_label_rows(target_rows: Tensor, step: int) -> Tensor:
    return target_rows[:, 1 + step:]  # (B, T, ...) -> (B, T-1-i, ...), row t = target row t+1+i


def ttt_label_mask(loss_mask: Tensor, step: int) -> Tensor:
    num_rows = loss_mask.shape[1] - 1 - step
    return shift_left(loss_mask, 2 + step)[:, :num_rows]  # (B, T-1-i), t -> loss_mask[t+2+i]
