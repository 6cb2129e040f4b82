"""Independent reader for exported EAGLE-3 drafters (sglang / vllm / native layouts). The toolkit it shares with
the other formats' readers (files, typed fields, Llama spellings, the error and report) is drafters.export.reading.

It reloads an export directory as the documented formats describe it (docs/conventions.md "Export
formats", and what SGLang's llama_eagle3.py / vLLM's speculators reader actually read), checks
every config field and its type, every tensor name, shape (derived from the config alone) and
dtype, and that nothing unexpected is there; then it rebuilds an `Eagle3Drafter` from the files by
its own name mapping and compares draft logits with the source checkpoint on fixed random inputs.

It deliberately shares no key table, name mapping or helper with `drafters.export.dispatch`: a bug in the
writer must not be able to hide itself here. It knows nothing about how the files were written.

Drafters written by other tools load through the same reader (`read_eagle3_export`, the decoder's
loader for exported directories), so it accepts what those tools write, and no more:
- both spellings of the Llama fields: transformers 4.x `rope_theta` / `rope_scaling` /
  `torch_dtype` and 5.x `rope_parameters` / `dtype` (SpecForge under 5.x writes both rope
  spellings; where a config holds both they must agree);
- LlamaConfig's defaults for the fields old configs leave out (`head_dim` = hidden_size /
  num_attention_heads, `num_key_value_heads` = num_attention_heads, `rope_theta` 10000.0, no
  scaling): what transformers and the engines apply, said in one note, never silently;
- no auxiliary layer ids (SpecForge writes `eagle_config` only when its user gave one; speculators
  before 0.5 wrote none): the ids the serving engine then captures, [2, L//2, L-3] as HF
  hidden_states indices in SGLang and vLLM alike, said in one note (which ids, which convention,
  why); the proposer option `aux_layers=` (HF indices) overrides it. Our own exports always record
  them: `check_export` still requires them;
- speculators' training defaults (vllm layout): `norm_output` (the final norm applied to the output that the next
  step reads), a sliding-window draft layer (`layer_types`, `sliding_window` in transformer_layer_config), and no
  d2t / t2d when the draft vocabulary is the whole target vocabulary: what vLLM serves, read as vLLM reads it.
"""

from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from drafters.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from drafters.draft_vocab import DraftVocab
from drafters.eagle3 import LAYER_TYPES, Eagle3Config, Eagle3Drafter
from drafters.export.reading import (CheckReport, ExportCheckError, check_finite, check_layout,
                                     compare_with_source, config_dtype, float_dtype, get_field, int_list, llama_default,
                                     note_defaults, read_json, read_tensors, rebuild, rope_fields)
from drafters.layers import DraftKVCache


def check_export(path, fmt: str, *, target: dict | None = None,
                 reference: Checkpoint | None = None, seed: int = 0) -> CheckReport:
    """target: target facts (num_layers, hidden_size, vocab_size, max_position_embeddings) the
    export must agree with; reference: the source checkpoint whose draft logits must be matched."""
    path = Path(path)
    if fmt == "native":
        return _check_native(path, target, reference, seed)
    rebuilt_config, module_state, written, float_dtype = read_eagle3_export(path, fmt, target=target,
                                                                            engine_defaults=False)
    diffs = _compare(rebuilt_config, module_state, reference, path, seed, float_dtype)
    return CheckReport(path, fmt, "eagle3", rebuilt_config.aux_layers, written, str(float_dtype),
                       len(module_state), *diffs)


def read_eagle3_export(path, fmt: str, *, target: dict | None = None, aux_layers: list[int] | None = None,
                       engine_defaults: bool = True, notes: list[str] | None = None):
    """Reads and validates an sglang / vllm export -> (Eagle3Config with aux layers as HF
    indices, state dict in Eagle3Drafter names, layer ids as written (None: not recorded), float
    dtype). Also how exported drafters (ours or another trainer's) are loaded to draft in the
    decoder. Without recorded layer ids (engine_defaults) the engine's default is used, which
    needs `target` (its layer count), unless `aux_layers` (HF indices) is given; `notes` receives
    one line per default applied, for the caller to say."""
    path = Path(path)
    if fmt not in READERS:
        raise ExportCheckError(f"unknown export format {fmt!r}: sglang, vllm or native")
    config = read_json(path / "config.json")
    said = []
    geometry, aux_hf, written = READERS[fmt](config, path / "config.json", said)
    # the field that would hold the ids (SGLang: the ids inside an eagle_config that has no ids)
    nested = fmt == "sglang" and config.get("eagle_config") is not None
    missing = "eagle_config.eagle_aux_hidden_state_layer_ids" if nested else ENGINE[fmt].field
    if aux_hf is None and not engine_defaults:  # our exports always record them
        raise ExportCheckError(f"{path / 'config.json'}: required field {missing!r} is missing")
    aux_hf = _resolve_aux_layers(aux_hf, written, aux_layers, fmt, target, path / "config.json", said,
                                 missing=missing)
    tensors = read_tensors(path / "model.safetensors")
    prefix = {"sglang": "midlayer.", "vllm": "layers.0."}[fmt]
    # speculators saves the verifier's embedding beside the drafter (vLLM then uses it instead
    # of the target's); it is not part of the drafter: `export_embedding` reads it
    embedding = tensors.pop(EMBEDDING, None) if fmt == "vllm" else None
    if embedding is not None and tuple(embedding.shape) != (geometry["vocab_size"], geometry["hidden_size"]):
        raise ExportCheckError(f"{path}: {EMBEDDING} {tuple(embedding.shape)} is not (vocab_size, hidden_size)")
    if fmt == "vllm" and not {"d2t", "t2d"} & tensors.keys() and geometry["draft_vocab_size"] == geometry["vocab_size"]:
        # speculators saves no mapping when it drafts over the whole vocabulary (its default); vLLM then maps
        # draft id i to target id i
        tensors |= DraftVocab.from_used(torch.arange(geometry["vocab_size"]), geometry["vocab_size"]).state_dict()
        said.append(f"{path}: no d2t / t2d and draft_vocab_size = vocab_size = {geometry['vocab_size']}: the "
                    "whole target vocabulary, draft id i = target id i, as vLLM reads it")
    float_dtype = _check_tensors(tensors, geometry, len(aux_hf), prefix, path,
                                 stated_dtype=geometry.pop("torch_dtype"))
    if target is not None:
        _check_against_target(geometry, aux_hf, target, path, engine=True)
    module_state = {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v
                    for k, v in tensors.items()}
    if notes is not None:
        notes += said
    return Eagle3Config(**geometry, aux_layers=aux_hf), module_state, written, float_dtype


# ---- auxiliary layers an export does not record: the engine's default -------------------------

@dataclass(frozen=True)
class EngineLayers:
    engine: str
    field: str  # where the layout records the ids
    convention: str  # what its ids mean
    offset: int  # recorded id = HF hidden_states index + offset
    why: str  # who leaves the ids out


ENGINE = {
    "sglang": EngineLayers("SGLang", "eagle_config", 'SGLang "output of layer" ids', -1,
                           "SpecForge writes it only when its user gave one, the EAGLE repository never"),
    "vllm": EngineLayers("vLLM", "eagle_aux_hidden_state_layer_ids", "vLLM layer ids", 0,
                         "speculators before 0.5 wrote none"),
}


def engine_default_layers(num_layers: int) -> list[int]:
    """What SGLang (`set_eagle3_layers_to_capture(None)`) and vLLM (`get_eagle3_aux_hidden_state_
    layers`) capture when the drafter names no layers: the inputs of decoder layers 2, L//2 and
    L-3, i.e. HF hidden_states indices [2, L//2, L-3] (SGLang "output of layer" ids [1, L//2-1,
    L-4]). The engines' rule, written out here rather than taken from our trainer's default."""
    return [2, num_layers // 2, num_layers - 3]


def _resolve_aux_layers(recorded: list[int] | None, written: list[int] | None, option: list[int] | None,
                        fmt: str, target: dict | None, where: Path, notes: list[str], *, missing: str) -> list[int]:
    engine = ENGINE[fmt]
    if option is not None:
        option = list(option)
        if not option or not all(isinstance(i, int) and not isinstance(i, bool) for i in option):
            raise ExportCheckError(f"aux_layers={option}: want HF hidden_states indices, e.g. 2,15,27")
    if recorded is not None:
        if option is not None and option != recorded:
            raise ExportCheckError(
                f"{where}: records auxiliary layers {engine.field} {written} ({engine.convention}) = HF "
                f"hidden_states {recorded}, but the aux_layers option says {option}: a drafter drafts only "
                "from the layers it was trained on; drop the option")
        return recorded
    default = engine_default_layers(target["num_layers"]) if target is not None else None

    def in_engine(ids):
        return [i + engine.offset for i in ids]

    if option is not None:
        notes.append(f"{where}: no {missing}: drafting from HF hidden_states indices {option} "
                     f"({engine.convention} {in_engine(option)}), given by the aux_layers option"
                     + (f", not {engine.engine}'s default {default}" if default not in (None, option) else ""))
        return option
    if default is None:
        raise ExportCheckError(f"{where}: no {missing} ({engine.why}) and no target given: "
                               f"{engine.engine}'s default auxiliary layers depend on the target's layer count")
    rule = "[1, L//2-1, L-4]" if engine.offset == -1 else "[2, L//2, L-3]"
    notes.append(f"{where}: no {missing} ({engine.why}): drafting from the layers {engine.engine} captures "
                 f"by default for this {target['num_layers']}-layer target, {engine.convention} "
                 f"{in_engine(default)} (= {rule}), i.e. HF hidden_states indices {default}; override with the "
                 "proposer option DIR:aux_layers=A,B,C (HF hidden_states indices)")
    return default


EMBEDDING = "embed_tokens.weight"
def export_embedding(path) -> torch.Tensor | None:
    """The drafter's own token embedding if a vllm export carries one (speculators' saves do)."""
    with safe_open(Path(path) / "model.safetensors", framework="pt") as f:
        return f.get_tensor(EMBEDDING) if EMBEDDING in f.keys() else None


# ---- config readers: -> (Eagle3Config fields but aux_layers, aux layers as HF indices, as written)

def _layer_geometry(config: dict, where: str, notes: list[str], stacked: bool = False) -> dict:
    """Fields of the Llama decoder layer(s) (top level for sglang, transformer_layer_config for
    vllm) as Eagle3Config keyword arguments. stacked: the layout may hold more than one layer (vLLM's
    llama_eagle3 builds num_hidden_layers; SGLang's one)."""
    get_field(config, "model_type", str, where, equals="llama")
    num_layers = get_field(config, "num_hidden_layers", int, where, **({} if stacked else {"equals": 1}))
    if num_layers < 1:
        raise ExportCheckError(f"{where}: num_hidden_layers = {num_layers}, an EAGLE-3 drafter has at least one")
    get_field(config, "tie_word_embeddings", bool, where, equals=False)
    geometry = {key: get_field(config, key, int, where) for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
        "max_position_embeddings")}
    geometry["num_hidden_layers"] = num_layers
    defaults = []
    geometry.update(
        num_key_value_heads=llama_default(config, "num_key_value_heads", geometry["num_attention_heads"],
                                          "LlamaConfig: = num_attention_heads", where, defaults),
        head_dim=llama_default(config, "head_dim", geometry["hidden_size"] // geometry["num_attention_heads"],
                               "LlamaConfig: = hidden_size / num_attention_heads", where, defaults),
        rms_norm_eps=get_field(config, "rms_norm_eps", float, where),
        **rope_fields(config, where, defaults),
        hidden_act=get_field(config, "hidden_act", str, where),
        # None: neither spelling (speculators writes `dtype` at its top level only); the weights decide
        torch_dtype=config_dtype(config, where),
    )
    note_defaults(defaults, where, notes)
    geometry.update(_layer_types(config, num_layers, where, windows=stacked))
    for flag in ("attention_bias", "mlp_bias"):  # our layer has no biases
        if config.get(flag, False) is not False:
            raise ExportCheckError(f"{where}: {flag!r} = {config[flag]!r}, this drafter has none")
    return geometry


def _layer_types(config: dict, num_layers: int, where: str, windows: bool) -> dict:
    """layer_types / sliding_window as Eagle3Config reads them. vLLM's Llama attention narrows a draft layer marked
    "sliding_attention" to sliding_window (its layer index less the target's layers, `target_layer_count`), so the
    vllm layout carries them (windows); SGLang takes a draft window from its server flag
    --speculative-draft-window-size, never from the checkpoint, so the sglang layout refuses a sliding layer."""
    kinds = config.get("layer_types")
    if kinds is None:  # vLLM: no layer_types, no window (a bare sliding_window is not read)
        return {"layer_types": None, "sliding_window": None}
    if (not isinstance(kinds, list) or len(kinds) != num_layers
            or not all(kind in LAYER_TYPES for kind in kinds)):
        raise ExportCheckError(f"{where}: layer_types {kinds!r}: want one of {list(LAYER_TYPES)} per decoder layer "
                               f"({num_layers})")
    if "sliding_attention" not in kinds:
        return {"layer_types": list(kinds), "sliding_window": None}
    if not windows:
        raise ExportCheckError(f"{where}: layer_types {kinds}: SGLang does not read a draft layer's sliding window "
                               "from the checkpoint (only from --speculative-draft-window-size), so this layout "
                               "cannot carry one")
    window = get_field(config, "sliding_window", int, where)
    if window < 1:
        raise ExportCheckError(f"{where}: sliding_window = {window}, a sliding layer needs at least one position")
    return {"layer_types": list(kinds), "sliding_window": window}


# Norm options engines read, default False (speculators' trainer defaults norm_before_fc and norm_output to True).
# The vllm layout may carry the three this drafter has (NORM_OPTIONS, docs/conventions.md); the others it has not,
# and the sglang layout is read with none of them: a checkpoint that sets them must not draft here.
NORM_OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual")
UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output")
VLLM_UNSUPPORTED = ("use_aux_norm",)


def _refuse_options(config: dict, where: str, options=UNSUPPORTED_OPTIONS) -> None:
    on = [key for key in options if config.get(key, False) is not False]
    if on:
        raise ExportCheckError(f"{where}: {', '.join(f'{k} = {config[k]!r}' for k in on)}: this "
                               "project's EAGLE-3 drafter has no such norm (EAGLE-3.1 options); "
                               "it cannot draft with this checkpoint")


def _read_sglang(config: dict, where, notes: list[str]) -> tuple[dict, list[int] | None, list[int] | None]:
    where = str(where)
    get_field(config, "architectures", list, where, equals=["LlamaForCausalLMEagle3"])
    geometry = _layer_geometry(config, where, notes)
    geometry["draft_vocab_size"] = get_field(config, "draft_vocab_size", int, where)
    if "target_hidden_size" in config:  # optional for SGLang; fc in_features = 3 * it
        get_field(config, "target_hidden_size", int, where, equals=geometry["hidden_size"])
    _refuse_options(config, where)
    # SGLang reads eagle_config.get(...) when there is one: no eagle_config, or one without ids,
    # leaves the ids to the engine's default (resolved by read_eagle3_export)
    eagle = config.get("eagle_config")
    if eagle is None:
        return geometry, None, None
    eagle = get_field(config, "eagle_config", dict, where)
    _refuse_options(eagle, f"{where} eagle_config")
    if eagle.get("use_aux_hidden_state", True) is not True:  # SGLang's default: True
        get_field(eagle, "use_aux_hidden_state", bool, f"{where} eagle_config", equals=True)
    if eagle.get("eagle_aux_hidden_state_layer_ids") is None:
        return geometry, None, None
    ids = int_list(eagle, "eagle_aux_hidden_state_layer_ids", f"{where} eagle_config")
    # SGLang "output of layer" ids: it captures the input of layer id+1 = HF index id+1
    return geometry, [i + 1 for i in ids], ids


def _read_vllm(config: dict, where, notes: list[str]) -> tuple[dict, list[int] | None, list[int] | None]:
    where = str(where)
    # ours: the config class's default name; speculators' own saves: the model class's name
    if get_field(config, "architectures", list, where) not in (["Eagle3Speculator"], ["Eagle3DraftModel"]):
        raise ExportCheckError(f"{where}: architectures {config['architectures']}, want "
                               "['Eagle3Speculator'] or ['Eagle3DraftModel']")
    get_field(config, "speculators_model_type", str, where, equals="eagle3")
    _refuse_options(config, where, VLLM_UNSUPPORTED)
    get_field(config, "speculators_version", str, where)
    layer = get_field(config, "transformer_layer_config", dict, where)
    geometry = _layer_geometry(layer, f"{where} transformer_layer_config", notes, stacked=True)
    top_dtype = config_dtype(config, where)  # speculators under transformers 5.x: here only
    if geometry["torch_dtype"] is None:
        geometry["torch_dtype"] = top_dtype
    elif top_dtype not in (None, geometry["torch_dtype"]):
        raise ExportCheckError(f"{where}: dtype {top_dtype!r} at the top level but "
                               f"{geometry['torch_dtype']!r} in transformer_layer_config")
    geometry["draft_vocab_size"] = get_field(config, "draft_vocab_size", int, where)
    # vLLM defaults a missing norm_before_residual to True (and the other two to False): ours are always written
    get_field(config, "norm_before_residual", bool, where)  # required: its engine default is not ours
    for option in (*NORM_OPTIONS, "norm_output"):  # vLLM reads norm_output too (vllm#42764, #46488)
        geometry[option] = get_field(config, option, bool, where) if option in config else False
    if geometry["norm_before_fc"] and geometry["fc_norm"]:
        raise ExportCheckError(f"{where}: norm_before_fc and fc_norm are both true; an EAGLE-3 drafter has one")
    if config.get("target_hidden_size", 0) is not None:  # speculators writes null: = hidden_size
        get_field(config, "target_hidden_size", int, where, equals=geometry["hidden_size"])
    _check_speculators_config(get_field(config, "speculators_config", dict, where),
                              f"{where} speculators_config")
    if config.get("eagle_aux_hidden_state_layer_ids") is None:  # vLLM: then the model's default
        return geometry, None, None
    ids = int_list(config, "eagle_aux_hidden_state_layer_ids", where)
    return geometry, list(ids), ids  # vLLM captures the input of layer id = HF index id


def _check_speculators_config(spec: dict, where: str) -> None:
    get_field(spec, "algorithm", str, where, equals="eagle3")
    methods = get_field(spec, "proposal_methods", list, where)
    if not methods or not all(isinstance(m, dict) for m in methods):
        raise ExportCheckError(f"{where}: proposal_methods must be a non-empty list of objects")
    for i, method in enumerate(methods):
        get_field(method, "proposal_type", str, f"{where} proposal_methods[{i}]")
        tokens = get_field(method, "speculative_tokens", int, f"{where} proposal_methods[{i}]")
        if tokens < 1:
            raise ExportCheckError(f"{where} proposal_methods[{i}]: speculative_tokens={tokens}")
    get_field(methods[0], "proposal_type", str, f"{where} proposal_methods[0]", equals="greedy")
    default = get_field(spec, "default_proposal_method", str, where)
    if default not in [m["proposal_type"] for m in methods]:
        raise ExportCheckError(f"{where}: default_proposal_method {default!r} is none of the "
                               "proposal_methods")
    verifier = get_field(spec, "verifier", dict, where)
    get_field(verifier, "name_or_path", str, f"{where} verifier")
    archs = get_field(verifier, "architectures", list, f"{where} verifier")
    if not all(isinstance(a, str) for a in archs):
        raise ExportCheckError(f"{where} verifier: architectures must be strings, got {archs}")


READERS = {"sglang": _read_sglang, "vllm": _read_vllm}


# ---- tensors -------------------------------------------------------------------------------------

def expected_shapes(g: dict, num_aux: int, layer: str) -> dict[str, tuple[int, ...]]:
    """Every tensor an EAGLE-3 export holds, shaped from the config alone. No embedding."""
    h, d = g["hidden_size"], g["head_dim"]
    heads, kv = g["num_attention_heads"], g["num_key_value_heads"]
    inter, vocab, draft = g["intermediate_size"], g["vocab_size"], g["draft_vocab_size"]
    norms = {"input_norm.weight": (num_aux * h,)} if g.get("norm_before_fc") else {}  # one norm over n*h
    if g.get("fc_norm"):  # one per aux layer
        norms = {f"fc_norm.{i}.weight": (h,) for i in range(num_aux)}
    return {**norms,
        "fc.weight": (h, num_aux * h),  # fused target features (n*h) -> h
        f"{layer}self_attn.q_proj.weight": (heads * d, 2 * h),  # reads cat(embed, hidden)
        f"{layer}self_attn.k_proj.weight": (kv * d, 2 * h),
        f"{layer}self_attn.v_proj.weight": (kv * d, 2 * h),
        f"{layer}self_attn.o_proj.weight": (h, heads * d),
        f"{layer}mlp.gate_proj.weight": (inter, h),
        f"{layer}mlp.up_proj.weight": (inter, h),
        f"{layer}mlp.down_proj.weight": (h, inter),
        f"{layer}input_layernorm.weight": (h,),
        f"{layer}hidden_norm.weight": (h,),
        f"{layer}post_attention_layernorm.weight": (h,),
        **{f"layers.{i}.{name}": shape for i in range(1, g.get("num_hidden_layers", 1)) for name, shape in (
            ("self_attn.q_proj.weight", (heads * d, h)),  # deeper layers read the hidden stream alone
            ("self_attn.k_proj.weight", (kv * d, h)),
            ("self_attn.v_proj.weight", (kv * d, h)),
            ("self_attn.o_proj.weight", (h, heads * d)),
            ("mlp.gate_proj.weight", (inter, h)),
            ("mlp.up_proj.weight", (inter, h)),
            ("mlp.down_proj.weight", (h, inter)),
            ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,)))},
        "norm.weight": (h,),
        "lm_head.weight": (draft, h),
        "d2t": (draft,),
        "t2d": (vocab,),
    }


def _check_tensors(tensors: dict, g: dict, num_aux: int, layer: str, where: Path,
                   stated_dtype: str | None) -> torch.dtype:
    check_finite(tensors, where)
    shapes = expected_shapes(g, num_aux, layer)
    check_layout(tensors, shapes, "EAGLE-3", where)
    if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
        raise ExportCheckError(f"{where}: want d2t int64 and t2d bool, got "
                               f"{tensors['d2t'].dtype} / {tensors['t2d'].dtype}")
    dtype = float_dtype(tensors, stated_dtype, where)  # float16 too: the EAGLE repository's checkpoints
    _check_vocab_maps(tensors["d2t"], tensors["t2d"], where)
    return dtype


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, where: Path) -> None:
    # target id = draft id + d2t[draft id]; t2d marks exactly those target ids
    n = d2t.numel()
    if int(t2d.sum()) != n:
        raise ExportCheckError(f"{where}: t2d marks {int(t2d.sum())} target ids, d2t has {n}")
    target_ids = torch.arange(n) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d.numel():
        raise ExportCheckError(f"{where}: arange + d2t leaves [0, {t2d.numel()})")
    if bool((target_ids[1:] <= target_ids[:-1]).any()):
        raise ExportCheckError(f"{where}: arange + d2t is not strictly ascending")
    if not bool(t2d[target_ids].all()):
        raise ExportCheckError(f"{where}: t2d and d2t disagree on which target ids are kept")


def _check_against_target(g: dict, aux_hf: list[int], target: dict, where: Path, *,
                          engine: bool) -> None:
    for key in ("max_position_embeddings", "vocab_size", "hidden_size"):
        if g[key] != target[key]:
            raise ExportCheckError(f"{where}: {key} = {g[key]} but the target has "
                                   f"{target[key]}; engines would run it with lost acceptance")
    num_layers = target["num_layers"]
    low, high = (1, num_layers - 1) if engine else (0, num_layers)
    if not all(low <= i <= high for i in aux_hf):
        raise ExportCheckError(f"{where}: aux layers (HF indices) {aux_hf} outside [{low}, "
                               f"{high}] for the {num_layers}-layer target")
    if engine and len(aux_hf) != 3:
        raise ExportCheckError(f"{where}: {len(aux_hf)} aux layers; engines build fc for 3")


# ---- native -----------------------------------------------------------------------------------

def _check_native(path: Path, target, reference, seed) -> CheckReport:
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as err:
        raise ExportCheckError(str(err)) from None
    check_finite(ckpt.state_dict, path)
    if ckpt.family != "eagle3":  # other families: a faithful copy is all this reader can say
        if reference is not None:
            _same_tensors(ckpt.state_dict, reference.state_dict, path)
        return CheckReport(path, "native", ckpt.family, None, None, None, len(ckpt.state_dict),
                           None, None)
    names = {f.name for f in fields(Eagle3Config)}
    if set(ckpt.config) | ADDED_FIELDS != names | ADDED_FIELDS:  # older checkpoints: those fields' defaults
        raise ExportCheckError(f"{path}: config keys differ from Eagle3Config: missing "
                               f"{sorted(names - set(ckpt.config))}, unexpected "
                               f"{sorted(set(ckpt.config) - names)}")
    geometry = {k: v for k, v in ckpt.config.items() if k != "aux_layers"}
    aux = list(ckpt.config["aux_layers"])
    dtype = _check_tensors(ckpt.state_dict, geometry, len(aux), "midlayer.", path, None)
    if target is not None:
        _check_against_target(geometry, aux, target, path, engine=False)
    diffs = _compare(Eagle3Config(**ckpt.config), ckpt.state_dict, reference, path, seed, dtype)
    return CheckReport(path, "native", "eagle3", aux, aux, str(dtype), len(ckpt.state_dict),
                       *diffs)


# Eagle3Config fields a checkpoint written before them lacks (Eagle3Config's defaults hold for it): deeper drafters,
# speculators' post-norm output and sliding-window layers
ADDED_FIELDS = {"num_hidden_layers", "norm_output", "layer_types", "sliding_window"}


def _same_tensors(a: dict, b: dict, where: Path) -> None:
    if set(a) != set(b):
        raise ExportCheckError(f"{where}: tensor names differ from the source: "
                               f"{sorted(set(a) ^ set(b))}")
    bad = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k].to(a[k].dtype))]
    if bad:
        raise ExportCheckError(f"{where}: tensors differ from the source: {bad}")


# ---- rebuild and compare with the source checkpoint -------------------------------------------

def _compare(config: Eagle3Config, state: dict, reference: Checkpoint | None, where: Path,
             seed: int, dtype: torch.dtype) -> tuple[float | None, float | None]:
    rebuilt = rebuild(config, state, where)
    if reference is None:
        return None, None
    return compare_with_source(rebuilt, config, state, reference, dtype, where,
                               lambda d: _draft_logits(d, config, seed))




@torch.no_grad()
def _draft_logits(drafter: Eagle3Drafter, c: Eagle3Config, seed: int,
                  seq_len: int = 6) -> list[torch.Tensor]:
    """Prefill on random fused features + token ids, then one step on the drafter's own output."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    embed.weight.copy_(torch.randn(c.vocab_size, c.hidden_size, generator=gen))
    width = len(c.aux_layers) * c.hidden_size
    features = torch.randn(1, seq_len, width, generator=gen)  # (1, T, n*h) fused target features
    ids = torch.randint(0, c.vocab_size, (1, seq_len + 1), generator=gen)  # (1, T+1)
    cache = DraftKVCache()
    hidden, prefill_logits = drafter.prefill(features, ids[:, :seq_len], embed, cache)
    _, step_logits = drafter.step(hidden[:, -1:], ids[:, seq_len:], embed, cache)
    return [prefill_logits, step_logits]
