"""What the single-layer drafters (drafters.eagle3, drafters.eagle1) share: the layer geometry read from
the target, the attention over an input of a given width, and the drafter's own KV cache.

Geometry: a drafter layer is shaped like one of the target's decoder layers (hidden size, MLP width,
GQA heads, head_dim, RoPE, norm epsilon, activation) so that engines build it from the same config
fields; `target_layer_fields(target_config)` reads them (Gemma's names and per-layer-type RoPE
included) and `llama_config(c)` turns any config holding them into the LlamaConfig that transformers'
RoPE and MLP read. Knows nothing about a family's inputs, losses or decoding.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def target_layer_fields(config) -> dict:
    """A target's HF config -> the layer fields every drafter config holds (vocab and positions: the target's)."""
    cfg = config.get_text_config()
    rope = dict(cfg.rope_parameters)  # transformers 5.x keeps theta and scaling here
    rope = dict(rope.get("full_attention", rope))  # Gemma-3: per layer type; drafter = full
    rope_theta = rope.pop("rope_theta")
    return dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        hidden_act=getattr(cfg, "hidden_act", None) or cfg.hidden_activation,  # Gemma names
    )


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

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        # softmax(q k^T / sqrt(D) where mask else -inf) v; mask (T, S) or (B, 1, T, S), True = see
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))  # (B, T, h)


@dataclass
class DraftKVCache:
    """KV cache of a drafter's single decoder layer. A slot is an index into it; keys carry RoPE of the
    position they were computed at (slot == position along a chain, not inside a tree)."""
    keys: Tensor | None = None  # (B, Hkv, S, D)
    values: Tensor | None = None  # (B, Hkv, S, D)

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def past(self):
        return None if self.keys is None else (self.keys, self.values)

    def append(self, keys: Tensor, values: Tensor) -> None:
        past = self.past()
        self.keys = keys if past is None else torch.cat([past[0], keys], 2)
        self.values = values if past is None else torch.cat([past[1], values], 2)

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

