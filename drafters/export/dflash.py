"""Export a DFlash or DSpark drafter for SGLang and vLLM speculators, and read such exports back independently.

    python eval/export.py outputs/dflash_smollm2/checkpoint-final --format sglang --out exports/dflash-sglang
    python eval/export.py outputs/dflash_smollm2/checkpoint-final --format vllm --out exports/dflash-vllm \
        --target smollm2-135m-instruct

sglang  the DFlash reference layout SGLang's DFlashDraftModel loads (--speculative-algorithm DFLASH):
        config.json = the drafter layers as Qwen3 fields (architectures ["DFlashDraftModel"], model_type
        qwen3, num_hidden_layers = drafter layers, the target's vocab_size and max_position_embeddings,
        layer_types full_attention: bidirectional), block_size, num_target_layers, and dflash_config
        {mask_token_id, target_layer_ids, block_size}; model.safetensors = layers.{i}.*, fc.weight,
        hidden_norm.weight, norm.weight. No embedding and no LM head: SGLang uses the target's, over the
        FULL vocabulary, so only drafters trained with draft_vocab_size = the target's vocabulary export
        (a reduced-vocabulary drafter never learnt to rank the other ids: SGLang would draft them anyway).
vllm    speculators' `dflash` (vLLM reads it through its speculators config translation):
        config.json {speculators_model_type dflash, architectures ["DFlashSpeculator"],
        transformer_layer_config (Qwen3 fields), draft_vocab_size, block_size, target_hidden_size,
        aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor false, speculators_config};
        model.safetensors = the same names, plus d2t, t2d and lm_head.weight (the target's head rows of the
        draft vocabulary, so --target is needed) when the vocabulary is reduced; none of the three with the
        full vocabulary (speculators then takes the verifier's head). No embedding (the verifier's).

dspark  (a DSpark checkpoint, --format vllm only: SGLang has no DSpark drafter) speculators' `dspark`, which
        llama.cpp's converter also reads (DSparkDraftModel): the vllm DFlash layout with speculators_model_type
        dspark, architectures ["DSparkDraftModel"], markov_rank, markov_head_type, enable_confidence_head,
        confidence_head_with_markov true, sample_from_anchor false (slot j drafts token a+j, as DFlash's), and
        the tensors markov_head.markov_w1.weight (V, R), markov_head.markov_w2.weight (Vd, R) and, with the
        confidence head, confidence_head.proj.{weight (1, h+R), bias (1,)}.

Layer ids (docs/conventions.md): inside this project HF hidden_states indices. speculators'
aux_hidden_state_layer_ids are the same numbers (vLLM maps them to dflash_config.target_layer_ids =
id - 1); SGLang's and the reference's dflash_config.target_layer_ids are "output of layer" ids: HF index - 1
(the reference reads hidden_states[id + 1]).

The writer stages into a temporary sibling directory; the reader below derives every name and shape from
config.json alone and shares no table or helper with the writer; it rebuilds a DFlashDrafter and compares
its draft logits with the source checkpoint's (the same stand-in head on both: the real one is the
target's) before the directory is renamed into place.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from drafters.checkpoint import Checkpoint
from drafters.dflash import DFlashCache, DFlashConfig, DFlashDrafter
from drafters.draft_vocab import DraftVocab
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.dtypes import DTYPES
from drafters.export.common import (ExportError, ExportResult, check_out_dir, decoder_fields, export_dtype,
                                    export_files, export_target, load_source, refuse_export, speculators_config,
                                    state_problems)
from drafters.export.reading import (CheckReport, ExportCheckError, check_finite, check_layout, compare_with_source,
                                     float_dtype, get_field, int_list, read_json, read_tensors, rebuild)

FORMATS = ("sglang", "vllm")
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SPECULATORS_VERSION = "0.5.0"


# ---- writer ---------------------------------------------------------------------------------------


def export_dflash(ckpt_dir, fmt: str, out_dir, *, target=None, dtype: str = "fp32",
                  speculative_tokens: int | None = None, verifier: str | None = None,
                  overwrite: bool = False) -> ExportResult:
    """target: a loaded drafters Target to validate against (needed for vllm with a reduced vocabulary:
    the export carries the target's LM head rows)."""
    if fmt not in FORMATS:
        raise ExportError(f"a dflash checkpoint exports to {' / '.join(FORMATS)} or native, not {fmt!r}")
    canonical = export_dtype(dtype)  # float32 | bfloat16
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected, c = preflight(ckpt, fmt, target)
    tokens = c.block_size - 1 if speculative_tokens is None else speculative_tokens
    if not 1 <= tokens <= c.block_size - 1:
        raise ExportError(f"speculative_tokens={tokens}: a DFlash block of {c.block_size} drafts 1 .. "
                          f"{c.block_size - 1} tokens")
    state = {k: v.to(DTYPES[canonical]) if v.is_floating_point() else v for k, v in ckpt.state_dict.items()}
    full = c.draft_vocab_size == c.vocab_size
    if fmt == "sglang":
        config = sglang_config(c, expected["num_layers"], canonical)
        tensors = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    else:
        config = vllm_config(c, canonical, tokens, verifier or expected["name"], expected.get("architectures") or [])
        tensors = {k: v for k, v in state.items() if not (full and k in ("d2t", "t2d"))}
        if not full:
            used = DraftVocab.from_state_dict(ckpt.state_dict).used
            tensors["lm_head.weight"] = target.lm_head.weight.detach()[used.to(target.lm_head.weight.device)] \
                .to("cpu", DTYPES[canonical])
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    head = target.lm_head.weight if target is not None else None
    return export_files(out_dir, ckpt_dir, fmt, dtype, config, tensors, WEIGHTS_FILE,
                        lambda payload: check_dflash_export(payload, fmt, target=expected, reference=ckpt,
                                                            target_head=head), overwrite)


def preflight(ckpt: Checkpoint, fmt: str, target=None, cls: type | None = None) -> tuple[dict, DFlashConfig]:
    """-> (target facts to export against, the drafter config: `cls`, default DFlash's or DSpark's). Raises
    ExportError before any write."""
    expected = export_target(ckpt, target)
    cls = cls or (DSparkConfig if ckpt.family == "dspark" else DFlashConfig)
    try:
        c = cls(**ckpt.config)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{ckpt.path}: config is not a {cls.__name__} ({err})") from None
    problems = [f"{key}: drafter config {getattr(c, key)} != target {expected.get(key)} ({expected.get('name')!r})"
                for key in ("hidden_size", "vocab_size", "max_position_embeddings")
                if getattr(c, key) != expected.get(key)]
    num_layers = expected.get("num_layers")
    if not isinstance(num_layers, int):
        problems.append("the checkpoint's target info lacks num_layers; pass --target NAME")
    elif any(not 1 <= i <= num_layers - 1 for i in c.aux_layers):
        problems.append(f"aux layers {c.aux_layers} (HF hidden_states indices) outside [1, {num_layers - 1}]: "
                        "engines capture only the outputs of decoder layers 0..L-2")
    if sorted(set(c.aux_layers)) != list(c.aux_layers):
        problems.append(f"aux layers {c.aux_layers} must be distinct and ascending, the order fc was trained on")
    if c.final_logit_softcapping is not None:
        problems.append(f"final_logit_softcapping {c.final_logit_softcapping}: neither engine's DFlash head applies "
                        "the target's logit softcap")
    full = c.draft_vocab_size == c.vocab_size
    if fmt == "sglang" and isinstance(c, DSparkConfig):
        problems.append("SGLang has no DSpark drafter (its DFlashDraftModel would drop the Markov head and draft "
                        "independent slots); export --format vllm (speculators' dspark, which llama.cpp converts)")
    elif fmt == "sglang" and not full:
        problems.append(f"draft_vocab_size {c.draft_vocab_size} < the target's {c.vocab_size}: SGLang's DFlash drafter "
                        "scores every target id with the target's head, ids this drafter never learnt to rank "
                        "included; retrain with draft_vocab_size equal to the target's vocabulary, or export --format "
                        "vllm")
    if fmt == "vllm" and not full and target is None:
        problems.append("a reduced-vocabulary vllm export carries the target's LM head rows: pass --target NAME")
    refuse_export(ckpt.path, fmt, problems + state_problems(c, ckpt.state_dict))
    return expected, c


def qwen3_layer_fields(c: DFlashConfig, dtype: str) -> dict:
    """The drafter's layers as Qwen3Config fields (per-head q/k norms: Qwen3's attention)."""
    return {
        **decoder_fields(c, "qwen3", c.num_hidden_layers, dtype),
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * c.num_hidden_layers,  # DFlash: full = bidirectional in the block
    }


def sglang_config(c: DFlashConfig, target_layers: int, dtype: str) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        **qwen3_layer_fields(c, dtype),
        "block_size": c.block_size,
        "num_target_layers": target_layers,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": [i - 1 for i in c.aux_layers],  # "output of layer" ids = HF index - 1
            "block_size": c.block_size,
        },
    }


def vllm_config(c: DFlashConfig, dtype: str, speculative_tokens: int, verifier: str,
                verifier_architectures: list[str]) -> dict:
    algorithm = "dspark" if isinstance(c, DSparkConfig) else "dflash"
    markov = {} if algorithm == "dflash" else {
        "markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
        "enable_confidence_head": c.confidence_head,
        "confidence_head_with_markov": True,  # proj reads [normed ; W1[prev]] (llama.cpp's only form)
    }
    return {
        "architectures": ["DSparkDraftModel" if markov else "DFlashSpeculator"],
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": qwen3_layer_fields(c, dtype),
        "draft_vocab_size": c.draft_vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": list(c.aux_layers),  # HF indices; vLLM writes target_layer_ids = id - 1
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": False,  # slot 0 holds the anchor and predicts nothing (speculators' DSpark default
        # is True; llama.cpp reads the flag, and drafts block_size - 1 tokens with it False)
        **markov,
        "speculators_config": speculators_config(algorithm, speculative_tokens, verifier, verifier_architectures),
    }


# ---- independent reader ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SGLangVariant:
    """A drafter whose sglang layout is DFlash's plus fields and tensors of its own (DFlash2: drafters.export.dflash2):
    what the reader checks and builds instead of DFlash's."""

    architecture: str  # config.json's architectures[0]
    config: Callable  # (dflash_config dict, DFlashConfig fields, where) -> the drafter's config (ExportCheckError)
    shapes: Callable  # (that config) -> {name: shape} of its own tensors


def read_dflash_export(path, fmt: str, *, target: dict | None = None, variant: SGLangVariant | None = None):
    """Reads and validates an sglang / vllm DFlash export (ours or another trainer's) -> (DFlashConfig with
    aux layers as HF indices, state dict in DFlashDrafter names with d2t / t2d (the identity map where the
    export has none: full vocabulary), the export's LM head rows (Vd, h) or None (the target's head), the
    layer ids as written, float dtype). Also how exported drafters are loaded to draft in the decoder.
    variant: an sglang layout that extends DFlash's (its architecture, config and tensors)."""
    path = Path(path)
    if fmt not in ("sglang", "vllm"):
        raise ExportCheckError(f"unknown DFlash export format {fmt!r}: sglang or vllm")
    where = str(path / CONFIG_FILE)
    config = read_json(path / CONFIG_FILE)
    algorithm, markov = "dflash", None
    if fmt == "sglang":
        get_field(config, "architectures", list, where,
                  equals=[variant.architecture if variant else "DFlashDraftModel"])
        layer, dflash = config, get_field(config, "dflash_config", dict, where)
        written = int_list(dflash, "target_layer_ids", f"{where} dflash_config")
        aux = [i + 1 for i in written]  # SGLang / reference: hidden_states[id + 1]
        mask_token = get_field(dflash, "mask_token_id", int, f"{where} dflash_config")
        block = get_field(dflash, "block_size", int, f"{where} dflash_config") if "block_size" in dflash else \
            get_field(config, "block_size", int, where)
        if "block_size" in config and config["block_size"] != block:
            raise ExportCheckError(f"{where}: block_size {config['block_size']} and dflash_config.block_size {block} "
                                   "disagree")
        geometry = _qwen3_layers(layer, where)
        draft_vocab = geometry["vocab_size"]  # the target's head over its whole vocabulary
        if target is not None and config.get("num_target_layers", target["num_layers"]) != target["num_layers"]:
            raise ExportCheckError(f"{where}: num_target_layers {config['num_target_layers']} but the target has "
                                   f"{target['num_layers']}")
    else:
        algorithm = get_field(config, "speculators_model_type", str, where)
        if algorithm not in ("dflash", "dspark"):
            raise ExportCheckError(f"{where}: speculators_model_type {algorithm!r}, want 'dflash' or 'dspark'")
        archs = (["DFlashSpeculator"], ["DFlashDraftModel"]) if algorithm == "dflash" else \
            (["DSparkDraftModel"], ["DSparkSpeculator"])
        if get_field(config, "architectures", list, where) not in archs:
            raise ExportCheckError(f"{where}: architectures {config['architectures']}, want one of {list(archs)}")
        if algorithm == "dspark":
            markov = {"markov_rank": get_field(config, "markov_rank", int, where),
                      "markov_head_type": get_field(config, "markov_head_type", str, where),
                      "confidence_head": get_field(config, "enable_confidence_head", bool, where)}
            if markov["confidence_head"] and config.get("confidence_head_with_markov", True) is not True:
                raise ExportCheckError(f"{where}: confidence_head_with_markov false: this drafter's confidence head "
                                       "reads [normed ; W1[prev]] (llama.cpp's only form)")
        get_field(config, "speculators_version", str, where)
        geometry = _qwen3_layers(get_field(config, "transformer_layer_config", dict, where),
                                 f"{where} transformer_layer_config")
        draft_vocab = get_field(config, "draft_vocab_size", int, where)
        block = get_field(config, "block_size", int, where)
        written = int_list(config, "aux_hidden_state_layer_ids", where)
        aux = list(written)
        mask_token = get_field(config, "mask_token_id", int, where)
        if config.get("sample_from_anchor", False) is not False:
            raise ExportCheckError(f"{where}: sample_from_anchor = {config['sample_from_anchor']!r}: slot 0 predicts "
                                   "a token there (DSpark's layout); this DFlash drafter's slot 0 is the anchor")
        if config.get("projector_type", "dflash") != "dflash" or config.get("shift_label") not in (None, False):
            raise ExportCheckError(f"{where}: projector_type {config.get('projector_type')!r} / shift_label "
                                   f"{config.get('shift_label')!r}: a Domino drafter, not DFlash")
        if config.get("target_hidden_size") is not None:
            get_field(config, "target_hidden_size", int, where, equals=geometry["hidden_size"])
        spec = get_field(config, "speculators_config", dict, where)
        get_field(spec, "algorithm", str, f"{where} speculators_config", equals=algorithm)
        methods = get_field(spec, "proposal_methods", list, f"{where} speculators_config")
        if not methods or not all(isinstance(m, dict) and isinstance(m.get("speculative_tokens"), int)
                                  and 1 <= m["speculative_tokens"] <= block - 1 for m in methods):
            raise ExportCheckError(f"{where} speculators_config: proposal_methods must give speculative_tokens in "
                                   f"1..{block - 1} (block_size - 1)")
        verifier = get_field(spec, "verifier", dict, f"{where} speculators_config")
        get_field(verifier, "name_or_path", str, f"{where} speculators_config verifier")
    if not 0 <= mask_token < geometry["vocab_size"]:
        raise ExportCheckError(f"{where}: mask_token_id {mask_token} is not a token id (vocab {geometry['vocab_size']})")
    if block < 2:
        raise ExportCheckError(f"{where}: block_size {block} must be >= 2")
    config_dtype = geometry.pop("torch_dtype")
    if target is not None:
        for key in ("hidden_size", "vocab_size", "max_position_embeddings"):
            if geometry[key] != target[key]:
                raise ExportCheckError(f"{where}: {key} = {geometry[key]} but the target has {target[key]}; the "
                                       "drafter would run with lost acceptance")
        if not all(1 <= i <= target["num_layers"] - 1 for i in aux):
            raise ExportCheckError(f"{where}: aux layers (HF indices) {aux} outside [1, {target['num_layers'] - 1}] "
                                   f"for the {target['num_layers']}-layer target")
    fields = dict(**geometry, draft_vocab_size=draft_vocab, block_size=block, mask_token_id=mask_token, aux_layers=aux)
    try:
        c = variant.config(dflash, fields, where) if variant else \
            DFlashConfig(**fields) if markov is None else DSparkConfig(**fields, **markov)
    except ValueError as err:
        raise ExportCheckError(f"{where}: {err}") from None
    tensors = read_tensors(path / WEIGHTS_FILE)
    shapes = dflash_shapes(c, fmt) | (variant.shapes(c) if variant else {})
    head, dtype = _check_dflash_tensors(tensors, c, config_dtype, fmt, path / WEIGHTS_FILE, shapes)
    if "d2t" not in tensors:  # full vocabulary: draft id i = target id i
        tensors["d2t"] = torch.zeros(c.vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    return c, tensors, head, written, dtype


def _qwen3_layers(config: dict, where: str) -> dict:
    get_field(config, "model_type", str, where, equals="qwen3")
    if config.get("tie_word_embeddings", False) is not False:
        raise ExportCheckError(f"{where}: tie_word_embeddings = {config['tie_word_embeddings']!r}: the drafter has "
                               "no embedding of its own to tie")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False) is not False:
            raise ExportCheckError(f"{where}: {flag!r} = {config[flag]!r}, this drafter's layers have no biases")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or config.get("use_sliding_window", False):
        raise ExportCheckError(f"{where}: sliding-window draft layers ({layer_types}): this project's DFlash "
                               "layers see the whole context")
    g = {key: get_field(config, key, int, where) for key in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "max_position_embeddings")}
    if layer_types and len(layer_types) != g["num_hidden_layers"]:
        raise ExportCheckError(f"{where}: {len(layer_types)} layer_types for {g['num_hidden_layers']} layers")
    if "rope_theta" in config or "rope_parameters" not in config:
        rope = {"rope_theta": float(get_field(config, "rope_theta", (int, float), where)),
                "rope_scaling": get_field(config, "rope_scaling", (dict, type(None)), where)}
    else:  # transformers 5.x saves rope_parameters {rope_type, rope_theta, ...}
        params = dict(get_field(config, "rope_parameters", dict, where))
        theta = params.pop("rope_theta", None)
        if not isinstance(theta, (int, float)):
            raise ExportCheckError(f"{where}: rope_parameters has no rope_theta")
        rope = {"rope_theta": float(theta),
                "rope_scaling": params if params.get("rope_type", "default") != "default" else None}
    dtype_key = "torch_dtype" if "torch_dtype" in config else "dtype"
    return {**g, **rope, "rms_norm_eps": get_field(config, "rms_norm_eps", float, where),
            "hidden_act": get_field(config, "hidden_act", str, where),
            "torch_dtype": config.get(dtype_key)}


def dflash_shapes(c: DFlashConfig, fmt: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash export holds, shaped from the config alone."""
    h, d, heads, kv, inter = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, \
        c.intermediate_size
    shapes = {"fc.weight": (h, len(c.aux_layers) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * d, h),  # the h-wide normed block stream
            p + "self_attn.k_proj.weight": (kv * d, h),  # block stream and context c_t alike
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "self_attn.q_norm.weight": (d,),  # per head
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    if isinstance(c, DSparkConfig):
        shapes |= {"markov_head.markov_w1.weight": (c.vocab_size, c.markov_rank),  # keyed on target ids
                   "markov_head.markov_w2.weight": (c.draft_vocab_size, c.markov_rank)}
        if c.confidence_head:
            shapes |= {"confidence_head.proj.weight": (1, h + c.markov_rank), "confidence_head.proj.bias": (1,)}
    if fmt == "vllm" and c.draft_vocab_size != c.vocab_size:
        shapes |= {"lm_head.weight": (c.draft_vocab_size, h), "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    return shapes


def _check_dflash_tensors(tensors: dict, c: DFlashConfig, config_dtype, fmt: str, where: Path, shapes: dict):
    check_finite(tensors, where)
    check_layout(tensors, shapes, f"{fmt} {type(c).__name__.removesuffix('Config')}", where)
    if "d2t" in tensors:
        if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
            raise ExportCheckError(f"{where}: want d2t int64 and t2d bool, got {tensors['d2t'].dtype} / "
                                   f"{tensors['t2d'].dtype}")
        kept = torch.arange(c.draft_vocab_size) + tensors["d2t"]  # target id = draft id + d2t[draft id]
        if int(tensors["t2d"].sum()) != c.draft_vocab_size or bool((kept[1:] <= kept[:-1]).any()) or \
                int(kept.min()) < 0 or int(kept.max()) >= c.vocab_size or not bool(tensors["t2d"][kept].all()):
            raise ExportCheckError(f"{where}: d2t and t2d do not describe one ascending draft vocabulary")
    dtype = float_dtype(tensors, config_dtype, where, {"float32": torch.float32, "bfloat16": torch.bfloat16})
    return tensors.pop("lm_head.weight", None), dtype


def check_dflash_export(path, fmt: str, *, target: dict | None = None, reference: Checkpoint | None = None,
                        target_head: torch.Tensor | None = None, seed: int = 0) -> CheckReport:
    """Validates the files; with `reference`, a drafter rebuilt from them must give the source's draft logits
    (weights rounded to the export dtype) within 1e-5, both scored by the same stand-in head; an exported LM
    head must equal `target_head`'s rows of the draft vocabulary (in the export dtype)."""
    path = Path(path)
    c, state, head, written, dtype = read_dflash_export(path, fmt, target=target)
    rebuilt = rebuild(c, state, path)
    diffs = (None, None)
    if head is not None and target_head is not None:
        want = target_head.detach().cpu()[rebuilt.draft_vocab.used].to(dtype)
        if not torch.equal(head, want):
            raise ExportCheckError(f"{path}: lm_head.weight is not the target's LM head rows of the draft vocabulary")
    if reference is not None:
        diffs = compare_with_source(rebuilt, c, state, reference, dtype, path, partial(probe_draft_logits, seed=seed))
    return CheckReport(path, fmt, "dspark" if isinstance(c, DSparkConfig) else "dflash", c.aux_layers, written, str(dtype), len(state), *diffs)




@torch.no_grad()
def probe_draft_logits(drafter: DFlashDrafter, seed: int, context: int = 7) -> torch.Tensor:
    """Random fused features as the context, one block, scored by a random stand-in head and embedding
    (the real ones are the target's) -> (Bk-1, Vd) logits."""
    c = drafter.config
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    embed.weight.copy_(torch.randn(c.vocab_size, c.hidden_size, generator=gen))
    drafter.attach_head(torch.randn(c.vocab_size, c.hidden_size, generator=gen))
    features = torch.randn(1, context, len(c.aux_layers) * c.hidden_size, generator=gen)
    cache = DFlashCache()
    drafter.extend_context(features, cache)
    pending = torch.randint(0, c.vocab_size, (1,), generator=gen)
    normed, logits = drafter.draft(pending, embed, cache)
    if not isinstance(drafter, DSparkDrafter):
        return logits[0]
    prev = torch.randint(0, c.vocab_size, (c.block_size - 1,), generator=gen)  # random tokens before each slot
    slots = drafter.slot_logits(normed[0, 1:], prev)  # (Bk-1, Vd) with the Markov bias
    if drafter.confidence_head is None:
        return slots
    return torch.cat([slots, drafter.confidence_logits(normed[0, 1:], prev)[:, None]], 1)  # + confidence
