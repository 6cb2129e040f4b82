"""EAGLE-1 drafter: feature-level autoregression. FC(2h -> h, bias) over [embed(token_{t+1}); feature_t],
one Llama decoder layer without its input norm, the target's frozen output head; drafted step by step on
its own predicted features with its own KV cache.

Alignment (docs/conventions.md): position t reads (feature_t, token_{t+1}) and predicts feature_{t+1}; the target's
head on that feature gives the distribution of token_{t+2}. Labels are the target's row t+1: its
feature and its logits (the target's distribution over token t+2).

Feature (`Eagle1Config.feature`):
    normed    (default) the final-normed last hidden state (HF hidden_states[-1]), what the official
              EAGLE code and SGLang feed the drafter; logits = lm_head(x). Engines that load the
              official layout (drafters.export.eagle1) run only this one.
    pre_norm  the last decoder layer's output before the final norm (a reading of the paper's "feature");
              logits = lm_head(final_norm(x)): the target's own head. Trains and drafts here, not exportable.
The frozen head (target final norm, LM head, logit softcap) and embedding belong to the target: they are
attached / passed in by the caller, never parameters of the drafter, never saved with it. The drafter has
no reduced vocabulary: it drafts over all target ids (`draft_vocab` is the identity map).

Module names are the official checkpoint's (`fc.{weight,bias}`, `layers.0.*`), so export is a copy.
Differs from EAGLE-3 (drafters.eagle3): one h-wide input (no cat(embed, hidden) attention input, no
hidden_norm), no input_layernorm, no own norm / lm_head / d2t, a step's hidden input goes through fc
again with the next token, and the loss is feature regression + soft CE through the frozen head.
Knows nothing about the target model, datasets or decoding trees.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from drafters.draft_vocab import DraftVocab
from drafters.layers import DraftAttention, DraftKVCache, TTTKeys, llama_config, target_layer_fields, ttt_input_ids
from drafters.targets import FrozenHead

FEATURES = ("pre_norm", "normed")


@dataclass
class Eagle1Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's: the drafter drafts over all of it
    max_position_embeddings: int  # the target's
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    feature: Literal["pre_norm", "normed"] = "normed"

    @classmethod
    def from_target_config(cls, config, feature: str = "normed") -> "Eagle1Config":
        if feature not in FEATURES:
            raise ValueError(f"EAGLE-1 feature {feature!r}: choose one of {', '.join(FEATURES)}")
        return cls(**target_layer_fields(config), feature=feature)


class Eagle1DecoderLayer(nn.Module):
    """A Llama decoder layer without input_layernorm (official EAGLE-1: layer 0 reads the fc output as is)."""

    def __init__(self, c: Eagle1Config):
        super().__init__()
        self.self_attn = DraftAttention(c, c.hidden_size)  # differs from EAGLE-3: q/k/v read the h-wide fc output
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(c))

    def forward(self, x, cos, sin, past, mask):
        """x (B, T, h); past = (keys, values) (B, Hkv, S, D) or None; mask over the S + T keys.
        -> (output (B, T, h) = predicted features, new (keys, values) (B, Hkv, T, D))."""
        q, k, v = self.self_attn.project(x, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        x = x + self.self_attn.attend(q, keys, values, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, (k, v)


class Eagle1Drafter(nn.Module):
    """Verbs as EAGLE-3's: embed ids (the caller's frozen `embed`), project (fc over [embed; feature]),
    backbone (`layers.0`), compute logits (the attached frozen target head)."""

    def __init__(self, config: Eagle1Config, head: FrozenHead | None = None):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList([Eagle1DecoderLayer(c)])
        self.rotary_emb = LlamaRotaryEmbedding(llama_config(c))  # buffers not saved
        self.head = head  # a plain attribute: not a submodule, so not in parameters() or state_dict()

    def attach_head(self, head: FrozenHead) -> "Eagle1Drafter":
        self.head = head
        return self

    @property
    def lm_head(self) -> nn.Module:  # the target's, attached (EagleProposer reads its device)
        self._require_head()
        return self.head.lm_head

    @property
    def draft_vocab(self) -> DraftVocab:  # no reduced vocabulary: draft id == target id
        return DraftVocab.from_used(torch.arange(self.config.vocab_size), self.config.vocab_size)

    @staticmethod
    def embed_ids(embed, input_ids: Tensor) -> Tensor:
        with torch.no_grad():  # the target's embedding stays frozen
            return embed(input_ids)  # (B, T) -> (B, T, h)

    def project(self, features: Tensor, input_ids: Tensor, embed) -> Tensor:
        # official order cat(embed, feature): fc.weight[:, :h] reads the token, fc.weight[:, h:] the feature
        return self.fc(torch.cat([self.embed_ids(embed, input_ids), features.to(self.fc.weight.dtype)], -1))

    def backbone(self, x, positions, past, mask):
        cos, sin = self.rotary_emb(x, positions)  # positions (B or 1, T)
        return self.layers[0](x, cos, sin, past, mask)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        self._require_head()
        return self.head(hidden)  # (..., h) -> (..., V)

    def _require_head(self) -> None:
        if self.head is None:
            raise RuntimeError("Eagle1Drafter has no target head: call attach_head(FrozenHead.from_target(target, "
                               "config.feature)) before computing logits")

    # ---- training and held-out evaluation -------------------------------------------------------

    def chain_unroll(self, features, input_ids, embed, steps: int, noise: Tensor | None = None):
        """The self-fed chain, all positions at once. Inputs aligned with the sequence the target read
        (right-padded, nothing pre-shifted): features (B, T, h) the target's feature at t, input_ids
        (B, T). Yields (i, hidden (B, T, h) = predicted features) for steps i = 0 .. min(steps, T-1)-1.
        Step 0 is EAGLE-1 training: position t reads (feature_t + noise_t, token_{t+1}) and predicts
        feature_{t+1} (whose head gives token t+2). Steps i > 0 (held-out evaluation) are the chain the
        decoder drafts: position t reads its own step i-1 output as the feature and token_{t+1+i}, RoPE
        position t+i, and attends to step-0 keys <= t and to its own earlier steps only
        (drafters.layers.TTTKeys: what a KV cache sees). The objective is
        drafters.training.eagle1.chain_loss."""
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)[None]  # (1, T)
        hidden = features if noise is None else features + noise  # noise (B, T, h): augmentation, training only
        keys, values = [], []
        for step in range(min(steps, seq_len - 1)):  # step i has labels at t = 0 .. T-2-i
            x = self.project(hidden, ttt_input_ids(input_ids, step), embed)  # (B, T, h), token_{t+1+i}
            past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
            hidden, (k, v) = self.backbone(x, positions + step, past, TTTKeys(step))  # (B, T, h) predicted features
            keys.append(k)
            values.append(v)
            yield step, hidden

    # ---- inference: one step at a time with a real KV cache (drafters.decode.proposers.eagle) -------------

    def prefill(self, features, input_ids, embed, cache: DraftKVCache, positions=None):
        """Append pairs (feature_t, token_{t+1}): features (B, T, h) at cache slots S..S+T-1
        (S = len(cache)), input_ids (B, T) with input_ids[:, t] = the token following feature t. Causal.
        -> (predicted features (B, T, h), logits (B, T, V)); row t, at position S+t, drafts token S+t+2."""
        return self.step(features, input_ids, embed, cache, positions)  # a step on the target's features

    def step(self, hidden, input_ids, embed, cache: DraftKVCache, positions=None, mask=None):
        """Draft on own outputs: hidden (B, q, h) = each node's parent's predicted feature, used as the
        feature input (differs from EAGLE-3, whose step skips fc); input_ids (B, q) the nodes' tokens;
        positions (B, q) = parent's + 1; mask (B, 1, q, S+q) bool over [cache; new] (default causal)."""
        x = self.project(hidden, input_ids, embed)  # (B, q, h)
        out = cache.extend(partial(self.backbone, x), input_ids.shape[1], input_ids.device, positions, mask)
        return out, self.compute_logits(out)
