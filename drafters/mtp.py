"""Native MTP drafter: a target's own multi-token-prediction layer (DeepSeek-V3 / GLM-4.5 `num_nextn_predict_layers`,
Qwen3-Next / Qwen3.5 `mtp.*`), fine-tuned on the frozen target and drafting in the shared decoder.

One MTP step (h_t = the target's final-normed last hidden state at position t, HF hidden_states[L]):
    x      = proj(cat[norm_e(embed(token_{t+1})), norm_h(h_t)])    proj (H, 2H): the embedding half first
    y      = block(x)                                              a decoder layer of the target's own kind
    logits = head(norm(y))                                         over token_{t+2}; head = the target's lm_head
transformers' MtpLayer (transformers.modeling_layers, post-norm off) is the step up to y; block is the target's own
decoder-layer class (MLA + MoE for DeepSeek-V3, gated-query attention + MoE for Qwen3-Next) built from the target's
config as layer 0 of a one-layer MTP config (full attention; MoE wherever the target has experts), never a copy of
a model file. The norms are the target's RMSNorm class: x * w (DeepSeek, GLM, Llama), x * (1 + w) (Qwen3-Next /
Qwen3.5: zero-centred weights).

Recursion: step i > 0 drafts token_{t+2+i} with the same layer rerun on the previous step's output and the next
token, at RoPE position t+i, as the engines draft with one MTP layer (SGLang reads one; vLLM's Qwen MTP reruns
mtp.layers.0, its DeepSeek MTP layer step % n, which is the same layer for every shipped n = 1 checkpoint):
    DeepSeek layout: h <- y         (vLLM's DeepSeekMTP hands on the block output before shared_head.norm)
    Qwen layout:     h <- norm(y)   (vLLM's Qwen3NextMTP hands on the normed output)

Checkpoint layouts, in the target's own safetensors (N = num_hidden_layers, j = the MTP layer):
    deepseek  model.layers.{N+j}.{enorm, hnorm, eh_proj, shared_head.norm, <block>} + copies of the target's
              embedding and head (embed_tokens, shared_head.head), which stay the target's: never trained
    qwen      mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}, mtp.layers.{j}.<block>
Module names here: layer.{enorm, hnorm, eh_proj}, layer.mtp_block.<block>, norm. <block> tensors are stored as the
target's own layers are (per-expert MoE weights); transformers' checkpoint conversion for the target's model_type
maps them to the module's fused experts and back (`convert_block`).

Knows nothing about training, decoding trees or export directories; it reads a target's files only in `read_mtp`.
"""

import copy
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from drafters.draft_vocab import DraftVocab
from drafters.errors import UserError
from drafters.layers import DraftKVCache, ttt_attention_mask, ttt_input_ids

COUNT_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")  # DeepSeek / GLM / Qwen3-Next, Qwen3.5
LAYOUTS = ("deepseek", "qwen")


class MtpError(UserError):
    pass


def mtp_count(text_config) -> tuple[str, int] | None:
    """(field, number of MTP layers) the target's text config declares, or None."""
    for field in COUNT_FIELDS:
        count = getattr(text_config, field, None)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            return field, count
    return None


@dataclass
class MtpConfig:
    target_config: dict  # the target's text config (to_dict()): the block's class and geometry are rebuilt from it
    layout: str = "deepseek"  # LAYOUTS: where the tensors live in the target's checkpoint, what recursion hands on
    layer: int = 0  # j: the MTP layer this drafter is (model.layers.{N+j} / mtp.layers.{j})
    num_mtp_layers: int = 1  # how many the target declares

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is none of {', '.join(LAYOUTS)}")
        if not 0 <= self.layer < self.num_mtp_layers:
            raise ValueError(f"layer={self.layer} is beyond the target's {self.num_mtp_layers} MTP layer(s)")

    # what registry.fit_problems compares with the target's text config
    hidden_size = property(lambda self: self.target_config["hidden_size"])
    vocab_size = property(lambda self: self.target_config["vocab_size"])
    max_position_embeddings = property(lambda self: self.target_config["max_position_embeddings"])
    model_type = property(lambda self: self.target_config["model_type"])

    @classmethod
    def from_target_config(cls, config, layout: str, layer: int = 0) -> "MtpConfig":
        text = config.get_text_config()
        found = mtp_count(text)
        return cls(target_config=text.to_dict(), layout=layout, layer=layer, num_mtp_layers=found[1] if found else 0)

    def text_config(self):
        from transformers import AutoConfig

        raw = {k: v for k, v in self.target_config.items() if k not in ("model_type", "transformers_version")}
        return AutoConfig.for_model(self.model_type, **raw)

    def block_config(self):
        """The text config as transformers builds an MTP layer (PreTrainedConfig.get_mtp_config): one layer, index 0,
        full attention, MoE where the target has experts (first_k_dense_replace 0, no mlp_only_layers)."""
        cfg = copy.deepcopy(self.text_config())
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = ["full_attention"]
        if hasattr(cfg, "first_k_dense_replace"):
            cfg.first_k_dense_replace = 0
        if getattr(cfg, "mlp_only_layers", None):
            cfg.mlp_only_layers = []
        cfg._attn_implementation = "sdpa"
        return cfg


def target_classes(cfg) -> tuple[type, type, type]:
    """(decoder layer, RMSNorm, rotary embedding) classes of the target's base model, read off a one-layer instance on
    the meta device (no memory, no weights): what transformers' MtpModel infers from the main model."""
    from transformers import AutoModel

    with torch.device("meta"):
        base = AutoModel.from_config(cfg)
    layer = base.layers[0]
    return type(layer), type(layer.input_layernorm), type(base.rotary_emb)


class _StepCache:
    """The transformers Cache API a decoder layer's attention calls (update) over explicit past keys: it returns
    past + new along the sequence axis and keeps the new entries for drafters.layers.DraftKVCache. Works for any
    per-layer state (MLA caches the compressed latents)."""

    def __init__(self, past):
        self.past, self.new = past, None

    def update(self, keys: Tensor, values: Tensor, layer_idx: int, *args, **kwargs):
        self.new = (keys, values)
        if self.past is None:
            return keys, values
        return torch.cat([self.past[0], keys], 2), torch.cat([self.past[1], values], 2)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    # bool (q, S) or (B, 1, q, S), True = see -> (1 or B, 1, q, S) 0 / dtype-min: what eager and sdpa both add
    while mask.dim() < 4:
        mask = mask[None]
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class MtpDrafter(nn.Module):
    """Verbs as the EAGLE drafters' (drafters.decode.proposers.eagle drives it): embed ids (the target's frozen
    embedding, passed in), one MTP step (prefill / step), compute logits (the attached frozen target head)."""

    def __init__(self, config: MtpConfig, head=None):
        super().__init__()
        from transformers.modeling_layers import MtpLayer

        self.config = config
        cfg = config.block_config()
        layer_cls, norm_cls, rotary_cls = target_classes(cfg)
        self.layer = MtpLayer(cfg, layer_cls, norm_cls, 0, use_post_norm=False)  # enorm, hnorm, eh_proj, mtp_block
        self.norm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)  # shared_head.norm / mtp.norm
        self.rotary_emb = rotary_cls(cfg)  # buffers not saved
        self.head = head  # drafters.targets.FrozenHead (normed): a plain attribute, never saved or trained

    def attach_head(self, head) -> "MtpDrafter":
        self.head = head
        return self

    @property
    def lm_head(self) -> nn.Module:  # the target's, attached (EagleProposer reads its device)
        return self.head.lm_head

    @property
    def draft_vocab(self) -> DraftVocab:  # the target's whole vocabulary: draft id == target id
        return DraftVocab.from_used(torch.arange(self.config.vocab_size), self.config.vocab_size)

    def compute_logits(self, normed: Tensor) -> Tensor:
        if self.head is None:
            raise RuntimeError("MtpDrafter has no target head: attach_head(FrozenHead.from_target(target, 'normed'))")
        return self.head(normed)  # (..., H) -> (..., V)

    def backbone(self, embeds: Tensor, hidden: Tensor, positions: Tensor, past, mask: Tensor):
        """embeds, hidden (B, q, H); positions (B or 1, q); past (keys, values) of the cached slots or None; mask
        bool (q, S+q) or (B, 1, q, S+q). -> (y (B, q, H), the q new cache entries)."""
        cache = _StepCache(past)
        dtype = self.layer.eh_proj.weight.dtype
        y = self.layer(embeds.to(dtype), hidden.to(dtype), position_embeddings=self.rotary_emb(embeds, positions),
                       attention_mask=additive_mask(mask, dtype), position_ids=positions, cache=cache)
        return y, cache.new

    def carry(self, y: Tensor) -> tuple[Tensor, Tensor]:
        # y (..., H) -> (what the next step reads as h, norm(y) the head reads): module docstring, Recursion
        normed = self.norm(y)
        return (normed if self.config.layout == "qwen" else y), normed

    def step(self, hidden: Tensor, input_ids: Tensor, embed, cache: DraftKVCache, positions=None, mask=None):
        """hidden (B, q, H): the target's h at each slot (prefill) or each node's parent's carried output; input_ids
        (B, q) the token after it; positions (B or 1, q) (default: the next slots); mask over [cache; new] (default
        causal). -> (carried (B, q, H), logits (B, q, V)); row t drafts the token after input_ids[:, t]."""
        with torch.no_grad():  # the target's embedding stays frozen
            embeds = embed(input_ids)
        y = cache.extend(partial(self.backbone, embeds, hidden), input_ids.shape[1], input_ids.device, positions, mask)
        carried, normed = self.carry(y)
        return carried, self.compute_logits(normed)

    prefill = step  # committed pairs (h_t, token_{t+1}) are one step on the target's features

    def chain_unroll(self, features: Tensor, input_ids: Tensor, embed, steps: int):
        """Training: features (B, T, H) the target's h_t, input_ids (B, T), right-padded, nothing shifted. Yields
        (i, norm(y_i) (B, T, H)) for i = 0 .. min(steps, T-1)-1: step i at position t reads (h_{i-1,t},
        token_{t+1+i}) (h_{-1} = the target's), RoPE position t+i, and drafts token_{t+2+i}; it attends to step 0's
        keys <= t and to its own chain's earlier steps at t (drafters.layers.ttt_attention_mask, dense: what the KV
        cache of the decoder's chain sees)."""
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)[None]  # (1, T)
        hidden, keys, values = features, [], []
        for step in range(min(steps, seq_len - 1)):
            with torch.no_grad():
                embeds = embed(ttt_input_ids(input_ids, step))  # (B, T, H) token_{t+1+i}
            past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
            mask = ttt_attention_mask(seq_len, step, input_ids.device)  # (T, (i+1)T)
            y, (k, v) = self.backbone(embeds, hidden, positions + step, past, mask)
            keys.append(k)
            values.append(v)
            hidden, normed = self.carry(y)
            yield step, normed


# ---- the target's checkpoint: which tensors are the MTP layer, read and converted ------------------------------


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a model directory (sharded or not)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    names = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names.update({name: file for name in f.keys()})
    return names


@dataclass(frozen=True)
class MtpNames:
    """Where MTP layer j's tensors live in the target's checkpoint (module docstring, Checkpoint layouts)."""
    own: dict  # module name -> checkpoint name: the projection and norms
    block: str  # checkpoint prefix of the decoder layer's tensors
    copies: dict  # "embed" / "head" -> checkpoint name of the target's copies (DeepSeek layout), never trained

    @classmethod
    def of(cls, layout: str, num_layers: int, layer: int) -> "MtpNames":
        if layout == "deepseek":
            p = f"model.layers.{num_layers + layer}."
            own = {"layer.enorm.weight": p + "enorm.weight", "layer.hnorm.weight": p + "hnorm.weight",
                   "layer.eh_proj.weight": p + "eh_proj.weight", "norm.weight": p + "shared_head.norm.weight"}
            return cls(own, p, {"embed": p + "embed_tokens.weight", "head": p + "shared_head.head.weight"})
        own = {"layer.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "layer.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "layer.eh_proj.weight": "mtp.fc.weight",
               "norm.weight": "mtp.norm.weight"}
        return cls(own, f"mtp.layers.{layer}.", {})

    def block_names(self, names) -> list[str]:
        skip = set(self.own.values()) | set(self.copies.values())
        return [n for n in names if n.startswith(self.block) and n not in skip]


def convert_block(state: dict, text_config, to_checkpoint: bool) -> dict:
    """The block's tensors between module names (layer.mtp_block.*) and the checkpoint's tensor format, through
    transformers' checkpoint conversion for the target's model_type (its WeightConverters: per-expert MoE weights <->
    fused experts) applied to these tensors alone; names keep their prefix."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    converters = [c for c in get_checkpoint_conversion_mapping(text_config.model_type) or []
                  if isinstance(c, WeightConverter)]
    if not converters:
        return dict(state)
    if not to_checkpoint:  # revert_weight_conversion undoes what it is given: give it the reverse to load
        converters = [c.reverse_transform() for c in converters]
    return revert_weight_conversion(SimpleNamespace(_weight_conversions=converters, config=text_config), state)


def mtp_layout(names) -> str:
    return "qwen" if any(n.startswith("mtp.") for n in names) else "deepseek"


def check_mtp_target(path: Path, text_config, layer: int, where) -> tuple[str, int, dict[str, Path]]:
    """Refusals before any work, one sentence each: no MTP count in the config, a layer beyond it, the layer's tensors
    missing from the files. -> (layout, count, tensor files)."""
    found = mtp_count(text_config)
    if found is None:
        raise MtpError(f"{where}: config has no num_nextn_predict_layers / mtp_num_hidden_layers (or it is 0), so "
                       "the target ships no native MTP layer to train; choose a target that does (DeepSeek-V3, "
                       "GLM-4.5, Qwen3-Next, Qwen3.5) or another drafter family")
    field, count = found
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < count:
        raise MtpError(f"{where}: mtp.layer={layer!r} is beyond the target's MTP layers ({field}={count}: layers "
                       f"0..{count - 1})")
    files = tensor_files(path)
    layout = mtp_layout(files)
    names = MtpNames.of(layout, text_config.num_hidden_layers, layer)
    missing = [n for n in names.own.values() if n not in files] + ([] if names.block_names(files) else
                                                                   [names.block + "*"])
    if missing:
        raise MtpError(f"{where}: {field}={count} but the safetensors in {path} hold no {missing[0]} (and "
                       f"{len(missing) - 1} more MTP tensors): a checkpoint saved by transformers drops them; point "
                       "the target at the original checkpoint directory")
    return layout, count, files


def read_tensor(files: dict[str, Path], name: str) -> Tensor:
    from safetensors import safe_open

    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name)


def read_mtp(path, text_config, layer: int = 0, where=None) -> tuple[MtpConfig, dict, dict]:
    """A target directory's MTP layer `layer` -> (MtpConfig, state dict in MtpDrafter names, the checkpoint's copies
    of the embedding and head: {"embed": (V, H), "head": (V, H)} in the DeepSeek layout, else {})."""
    path = Path(path)
    layout, count, files = check_mtp_target(path, text_config, layer, where or path)
    names = MtpNames.of(layout, text_config.num_hidden_layers, layer)
    state = {module: read_tensor(files, name) for module, name in names.own.items()}
    block = {"layer.mtp_block." + n.removeprefix(names.block): read_tensor(files, n)
             for n in names.block_names(files)}
    state.update(convert_block(block, text_config, to_checkpoint=False))
    copies = {key: read_tensor(files, name) for key, name in names.copies.items() if name in files}
    config = MtpConfig(target_config=text_config.to_dict(), layout=layout, layer=layer, num_mtp_layers=count)
    return config, state, copies


def checkpoint_tensors(config: MtpConfig, state: dict, num_layers: int) -> dict[str, Tensor]:
    """A drafter's state dict in MtpDrafter names -> its tensors under the target checkpoint's names and format (the
    inverse of read_mtp's mapping)."""
    names = MtpNames.of(config.layout, num_layers, config.layer)
    out = {name: state[module] for module, name in names.own.items()}
    block = convert_block({k: v for k, v in state.items() if k.startswith("layer.mtp_block.")}, config.text_config(),
                          to_checkpoint=True)
    out.update({names.block + k.removeprefix("layer.mtp_block."): v for k, v in block.items()})
    return out


def shared_copy_problems(copies: dict, target) -> list[str]:
    """The DeepSeek layout stores copies of the target's embedding and head; drafting here uses the target's own (as
    SGLang does; vLLM loads the copies), so they must be the same weights (compared in the file's dtype)."""
    mine = {"embed": target.embed_tokens.weight, "head": target.lm_head.weight}
    return [f"the MTP layer's {key} copy differs from the target's {'embed_tokens' if key == 'embed' else 'lm_head'}"
            for key, tensor in copies.items()
            if not torch.equal(tensor, mine[key].detach().to("cpu", tensor.dtype))]


def target_dir(target) -> Path:
    """The directory a loaded target's weights came from (config.name_or_path, as transformers' MtpModel reads it)."""
    path = Path(target.model.config.name_or_path or target.name)
    if not path.is_dir() or not tensor_files(path):
        raise MtpError(f"{target.name}: its MTP layers are read from its safetensors, and it was not loaded from a "
                       "local model directory holding them (a Hub id: download it and pass the directory)")
    return path


def read_target_mtp(target, layer: int = 0) -> tuple[MtpConfig, dict]:
    """The loaded target's own MTP layer `layer` -> (config, state dict), its embedding and head copies checked."""
    path = target_dir(target)
    config, state, copies = read_mtp(path, target.config.get_text_config(), layer, where=target.name)
    problems = shared_copy_problems(copies, target)
    if problems:
        raise MtpError(f"{target.name}: " + "; ".join(problems) + ": engines disagree on which to use (SGLang takes "
                       "the target's, vLLM the copies), so this drafter is not trained on them")
    return config, state
