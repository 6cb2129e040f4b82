"""EAGLE-3 drafter: fused target features -> one decoder layer (or a stack of them) -> reduced-vocabulary logits,
trained with the training-time test (TTT) unroll, drafted step by step with its own KV cache.

Knows nothing about the target model, datasets or decoding trees: callers hand it the fused
target features, the target's frozen token embedding module (`embed`, never a parameter of the
drafter), the target logits that serve as labels, and for tree drafting a 4D mask and positions.
Module names are those of SGLang / the official EAGLE-3 checkpoints (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`), so export is a rename at most. A deeper drafter (num_hidden_layers > 1, as vLLM's
llama_eagle3 builds it) adds plain Llama decoder layers `layers.1`, `layers.2`, ... over the first one's output:
only the first reads cat(embed, hidden); the others read the hidden stream alone.

Alignment (docs/conventions.md): the drafter at position t sees feature_t and token_{t+1} and predicts
token_{t+2}. Its label is the target's row t+1 (the target's logits at t+1 predict token t+2).
"""

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from drafters.draft_vocab import DraftVocab
from drafters.layers import (DraftAttention, DraftKVCache, TTTKeys, llama_config, target_layer_fields,
                             ttt_attention_mask, ttt_input_ids)
from drafters.losses import FusedLinearHead
from drafters.targets import default_eagle3_layers  # [2, L//2, L-3], HF hidden_states indices


NORM_OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual")  # Eagle3Config's optional norms
LAYER_TYPES = ("full_attention", "sliding_attention")  # Eagle3Config.layer_types, HF's names


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    max_position_embeddings: int  # the target's: a smaller value collapses acceptance in engines
    aux_layers: list[int] = field(default_factory=list)  # HF hidden_states indices, low to high
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # the target's rope parameters other than rope_theta
    hidden_act: str = "silu"
    num_hidden_layers: int = 1  # decoder layers: midlayer, then layers.1 .. layers.{n-1} (vLLM's multi-layer EAGLE-3)
    # Optional norms, named and placed as speculators / vLLM do (docs/conventions.md "EAGLE-3 norm options"):
    # norm_before_fc: one RMSNorm over the fused n*h features before fc (weight input_norm, n*h; llama.cpp runs it)
    # fc_norm: EAGLE-3.1, an RMSNorm per aux layer (fc_norm.i, h each) before concatenation (not in llama.cpp)
    # norm_before_residual: the decoder layer's residual is hidden_norm(h), not the raw h (llama.cpp runs it)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    # speculators' EAGLE-3 training defaults, read from its checkpoints (docs/conventions.md "EAGLE-3 options"):
    # norm_output: the last layer's output goes through the final norm before it is both handed to the next step and
    # read by lm_head (EAGLE-3.1's post-norm); off: the next step reads the pre-norm output (EAGLE-3's)
    norm_output: bool = False
    # layer_types[l] (HF's field): "full_attention" or "sliding_attention" for decoder layer l (None: all full); a
    # sliding layer's query at position p sees only keys at positions k with p - k < sliding_window
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers}: an EAGLE-3 drafter has at least one layer")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are two ways to norm the fused features before fc: "
                             "set one of them")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types {self.layer_types}: want one of {LAYER_TYPES} per decoder layer "
                                 f"({self.num_hidden_layers})")
            if self.sliding_layers and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
                raise ValueError(f"sliding_window={self.sliding_window!r}: a sliding_attention layer needs a window "
                                 "of at least one position")

    @property
    def sliding_layers(self) -> list[int]:  # the decoder layers that attend within sliding_window
        return [i for i, kind in enumerate(self.layer_types or ()) if kind == "sliding_attention"]

    @classmethod
    def from_target_config(cls, config, draft_vocab_size: int, layers=None, num_layers: int = 1,
                           **norms) -> "Eagle3Config":
        cfg = config.get_text_config()
        target_layers = cfg.num_hidden_layers
        layers = default_eagle3_layers(target_layers) if layers is None else list(layers)
        if len(set(layers)) != len(layers) or not all(0 <= i <= target_layers for i in layers):
            raise ValueError(f"EAGLE-3 aux layers {layers}: want distinct HF hidden_states indices "
                             f"in [0, {target_layers}] for this {target_layers}-layer target")
        if not 0 < draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, target vocab "
                             f"{cfg.vocab_size}]")
        return cls(**target_layer_fields(config), draft_vocab_size=draft_vocab_size, aux_layers=layers,
                   num_hidden_layers=num_layers, **norms)


def window_mask(mask, positions: Tensor, key_positions: Tensor | None, window: int) -> Tensor:
    """`mask` narrowed to a sliding window: a query at position p keeps only keys at positions k with p - k < window
    (HF's and vLLM's rule). mask: (T, S) or (B, 1, T, S) bool, True = see, with key_positions (B or 1, S); or
    TTTKeys(i), whose keys [step 0 | .. | step i] sit at positions t + j (step j's key at row t) for queries at
    positions t + i: then a dense (T, (i+1)T) mask. positions (B or 1, T). -> (B or 1, 1, T, S) bool."""
    if isinstance(mask, TTTKeys):
        rows = positions[0] - mask.step  # (T,) each row's step-0 position
        key_positions = torch.cat([rows + j for j in range(mask.step + 1)])[None]  # (1, (i+1)T)
        mask = ttt_attention_mask(positions.shape[-1], mask.step, positions.device)
    if key_positions is None:
        raise ValueError("a sliding-window layer needs the positions of its keys (Eagle3Drafter.step passes them)")
    near = positions[:, :, None] - key_positions[:, None, :] < window  # (B or 1, T, S)
    return mask & near[:, None]


def fuse_features(hidden_states, layers) -> Tensor:
    """hidden_states: HF tuple or {HF index: (B, T, h)} -> (B, T, n*h), layers low to high."""
    return torch.cat([hidden_states[layer] for layer in layers], dim=-1)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DraftAttention(c, 2 * c.hidden_size)  # q/k/v read cat(embed, hidden)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(c))
        self.norm_before_residual = c.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, past, mask):
        """embeds, hidden (B, T, h); past = (keys, values) (B, Hkv, S, D) or None; mask over the
        S + T keys [past; new]. -> (output hidden (B, T, h), new (keys, values) (B, Hkv, T, D))."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden  # EAGLE-3: the UN-normed hidden input
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B,T,2h)
        q, k, v = self.self_attn.project(x, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2),
                                                    torch.cat([past[1], v], 2))
        hidden = residual + self.self_attn.attend(q, keys, values, mask)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, (k, v)


class Eagle3DeeperLayer(nn.Module):
    """Layer i >= 1 of a deeper drafter: a plain pre-norm Llama decoder layer on the hidden stream (vLLM's
    llama_eagle3 for layer_idx > 0): h = h + attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h)).
    Same positions and mask as the first layer, its own keys and values."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DraftAttention(c, c.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(c))

    def forward(self, hidden, cos, sin, past, mask):
        q, k, v = self.self_attn.project(self.input_layernorm(hidden), cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2),
                                                    torch.cat([past[1], v], 2))
        hidden = hidden + self.self_attn.attend(q, keys, values, mask)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, (k, v)

    @torch.no_grad()
    def start_as_identity(self) -> None:
        """o_proj = down_proj = 0: both residual branches add zero, so the layer passes its input through unchanged
        (and gradients still reach o_proj / down_proj, then the rest): how grow_layers stacks a layer on a trained
        drafter without changing what it drafts."""
        self.self_attn.o_proj.weight.zero_()
        self.mlp.down_proj.weight.zero_()


LLAMA_LAYER_WEIGHTS = ({f"self_attn.{p}_proj.weight" for p in "qkvo"}
                       | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
                       | {"input_layernorm.weight", "post_attention_layernorm.weight"})


class Eagle3Drafter(nn.Module):
    """The four verbs (SpecForge v0.1): embed ids (the caller's `embed`: the target's frozen
    embedding), project hidden states (`fc`), backbone (`midlayer`), compute logits."""

    def __init__(self, config: Eagle3Config, draft_vocab: DraftVocab | None = None):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.aux_layers) * c.hidden_size, c.hidden_size, bias=False)
        if c.norm_before_fc:
            self.input_norm = LlamaRMSNorm(len(c.aux_layers) * c.hidden_size, eps=c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps) for _ in c.aux_layers)
        self.midlayer = Eagle3DecoderLayer(c)
        if c.num_hidden_layers > 1:  # named as vLLM loads them: midlayer is its layers.0
            self.layers = nn.ModuleDict({str(i): Eagle3DeeperLayer(c) for i in range(1, c.num_hidden_layers)})
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = FusedLinearHead(c.hidden_size, c.draft_vocab_size)  # (Vd, h); also the fused loss
        self.rotary_emb = LlamaRotaryEmbedding(llama_config(c))  # buffers not saved
        # Without a vocab the buffers hold the lowest draft_vocab_size ids until set_draft_vocab()
        # or load_state_dict() fills them.
        vocab = draft_vocab or DraftVocab.from_used(torch.arange(c.draft_vocab_size), c.vocab_size)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(vocab)

    def set_draft_vocab(self, vocab: DraftVocab) -> None:
        if (vocab.size, vocab.target_vocab_size) != (self.d2t.numel(), self.t2d.numel()):
            raise ValueError(f"draft vocab is {vocab.size} of {vocab.target_vocab_size} ids, the "
                             f"config wants {self.d2t.numel()} of {self.t2d.numel()}")
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    @property
    def draft_vocab(self) -> DraftVocab:
        return DraftVocab(d2t=self.d2t, t2d=self.t2d)

    @torch.no_grad()
    def init_from_target(self, lm_head_weight: Tensor, draft_vocab: DraftVocab | None = None):
        """lm_head rows <- the target LM head's rows (V, h) of the draft vocab's ids."""
        if draft_vocab is not None:
            self.set_draft_vocab(draft_vocab)
        self.lm_head.weight.copy_(lm_head_weight[self.draft_vocab.used.to(lm_head_weight.device)])

    @torch.no_grad()
    def init_layer_from(self, layer: nn.Module) -> None:
        """midlayer <- a target decoder layer of the same width (a Llama-style layer: self_attn.{q,k,v,o}_proj,
        mlp, input_layernorm, post_attention_layernorm). The drafter's q/k/v read cat(input_layernorm(embed),
        hidden_norm(hidden)) (2h): their hidden half [:, h:] and hidden_norm take the target layer's q/k/v
        and input_layernorm, so on the hidden stream alone the drafter starts as that layer; the embed
        half starts at zero (gradients still reach it). o_proj, the MLP and post_attention_layernorm copy."""
        mine, h = self.midlayer, self.config.hidden_size
        extra = sorted({name for name, _ in layer.named_parameters()} - LLAMA_LAYER_WEIGHTS)
        if extra:
            raise ValueError(f"init_layer copies a Llama-style decoder layer; this target's layer also has {extra}, "
                             "which the EAGLE-3 drafter layer has no place for: leave init_layer unset")
        for name in ("q_proj", "k_proj", "v_proj"):
            src, dst = getattr(layer.self_attn, name).weight, getattr(mine.self_attn, name).weight
            if src.shape != (dst.shape[0], h):
                raise ValueError(f"target layer's self_attn.{name} is {tuple(src.shape)}, the drafter's hidden half "
                                 f"is {(dst.shape[0], h)}: init_layer needs a layer of the target's own shape")
            dst.zero_()
            dst[:, h:].copy_(src)
        mine.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        mine.input_layernorm.weight.fill_(1.0)
        mine.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        mine.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
        mine.mlp.load_state_dict({k: v.to(mine.mlp.gate_proj.weight.dtype) for k, v in layer.mlp.state_dict().items()})

    def project_hidden_states(self, features: Tensor) -> Tensor:
        if self.config.norm_before_fc:  # one RMSNorm over all n*h
            features = self.input_norm(features)
        elif self.config.fc_norm:  # one RMSNorm per aux layer's h-wide slice
            parts = features.split(self.config.hidden_size, dim=-1)
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features)  # (B, T, n*h) -> (B, T, h)

    @staticmethod
    def embed_ids(embed, input_ids: Tensor) -> Tensor:
        with torch.no_grad():  # the target's embedding stays frozen even if the caller forgot
            return embed(input_ids)  # (B, T) -> (B, T, h)

    def backbone(self, embeds, hidden, positions, past, mask, key_positions=None):
        """-> (the last layer's output hidden (B, T, h), through the final norm under norm_output; new (keys, values)).
        A deeper drafter's keys and values are its layers' stacked along the head axis, (B, n * Hkv, T, D), layer l's
        heads at [l * Hkv, (l+1) * Hkv): one cache (DraftKVCache) and one TTT key list hold them all, cropped and
        reordered along positions as one. key_positions (B or 1, S + T): every key's position, which sliding-window
        layers need (`step` passes them; the training-time test's follow from TTTKeys)."""
        cos, sin = self.rotary_emb(hidden, positions)  # positions (B or 1, T)
        masks = self._layer_masks(mask, positions, key_positions)  # one per decoder layer
        n = self.config.num_hidden_layers
        if n == 1:
            hidden, keys_values = self.midlayer(embeds, hidden, cos, sin, past, masks[0])
        else:
            pasts = [None] * n if past is None else list(zip(past[0].chunk(n, 1), past[1].chunk(n, 1)))
            hidden, (k, v) = self.midlayer(embeds, hidden, cos, sin, pasts[0], masks[0])
            keys, values = [k], [v]
            for layer, layer_past, layer_mask in zip(self.layers.values(), pasts[1:], masks[1:]):
                hidden, (k, v) = layer(hidden, cos, sin, layer_past, layer_mask)
                keys.append(k)
                values.append(v)
            keys_values = (torch.cat(keys, 1), torch.cat(values, 1))
        if self.config.norm_output:  # differs from EAGLE-3: the next step reads the normed output too
            hidden = self.norm(hidden)
        return hidden, keys_values

    def _layer_masks(self, mask, positions, key_positions) -> list:
        sliding = self.config.sliding_layers
        if not sliding:
            return [mask] * self.config.num_hidden_layers
        narrow = window_mask(mask, positions, key_positions, self.config.sliding_window)
        return [narrow if i in sliding else mask for i in range(self.config.num_hidden_layers)]

    def head_input(self, hidden: Tensor) -> Tensor:
        """What lm_head reads: the final norm of a layer output (already applied under norm_output)."""
        return hidden if self.config.norm_output else self.norm(hidden)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.head_input(hidden))  # (B, T, h) -> (B, T, Vd)

    def ttt_unroll(self, features, input_ids, embed, steps: int):
        """Training-time test forward (docs/conventions.md). Inputs aligned with the sequence the target
        read (rows right-padded, nothing pre-shifted): features (B, T, n*h) fused at positions t;
        input_ids (B, T). Yields (i, hidden (B, T, h)) for steps i = 0 .. steps-1: step i reads, at
        position t, its own output of step i-1 (fc(features) at i = 0) and token_{t+1+i}, at RoPE
        position t+i, attending to the keys of steps 0 .. i as TTTKeys(i) says (drafters.layers); its row t drafts
        token t+2+i (label: the target's row t+1+i, ttt_label_rows / ttt_label_mask). The objective
        (drafters.training.eagle3.ttt_loss) scores each step as it comes."""
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)[None]  # (1, T)
        hidden = self.project_hidden_states(features)  # step-0 hidden input (B, T, h)
        keys, values = [], []
        for step in range(steps):
            embeds = self.embed_ids(embed, ttt_input_ids(input_ids, step))  # (B, T, h)
            past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
            hidden, (k, v) = self.backbone(embeds, hidden, positions + step, past, TTTKeys(step))
            keys.append(k)
            values.append(v)
            yield step, hidden

    # ---- inference: the same computation one step at a time with a real KV cache -------------

    def prefill(self, features, input_ids, embed, cache: DraftKVCache, positions=None):
        """Append step-0 inputs: features (B, T, n*h) at cache slots S..S+T-1 (S = len(cache))
        and input_ids (B, T) with input_ids[:, t] = the token following feature t. Causal.
        -> (hidden (B, T, h) pre-norm outputs, logits (B, T, Vd)); row t, at position S+t,
        drafts token S+t+2."""
        return self.step(self.project_hidden_states(features), input_ids, embed, cache, positions)

    def step(self, hidden, input_ids, embed, cache: DraftKVCache, positions=None, mask=None):
        """Draft on own outputs: hidden (B, q, h) = output hidden of each node's parent,
        input_ids (B, q) the nodes' tokens (target ids), positions (B, q) = parent's + 1,
        mask (B, 1, q, S+q) bool over [cache; new] (default causal: a chain)."""
        embeds = self.embed_ids(embed, input_ids)  # (B, q, h)
        backbone = partial(self.backbone, embeds, hidden)
        if self.config.sliding_layers:  # the window needs every key's position: the cached slots', then these
            if positions is None:  # extend's default, a chain after the cache
                positions = torch.arange(len(cache), len(cache) + input_ids.shape[1], device=input_ids.device)[None]
            backbone = partial(backbone, key_positions=cache.key_positions(positions))
        out = cache.extend(backbone, input_ids.shape[1], input_ids.device, positions, mask)
        return out, self.draft_logits(out)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """What drafting (prefill / step) ranks: the full head's logits (B, T, Vd). EAGLE-4 overrides it."""
        return self.compute_logits(hidden)

    def topk_tokens(self, logits: Tensor, k: int = 1) -> tuple[Tensor, Tensor]:
        """logits (..., Vd) -> (log-probs (..., k), TARGET ids (..., k)) via target = d + d2t[d]."""
        logprobs, draft_ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return logprobs, draft_ids + self.d2t[draft_ids]
