"""Export a P-EAGLE drafter in speculators' `peagle` layout (vLLM 0.16+ parallel drafting), and read such
exports back independently.

    python eval/export.py outputs/peagle_smollm2/checkpoint-final --format vllm --out exports/peagle \
        --target smollm2-135m-instruct

vllm  config.json = speculators' EAGLE-3 layout (drafters.export.eagle3: transformer_layer_config of Llama fields,
      draft_vocab_size, the norm options, target_hidden_size, eagle_aux_hidden_state_layer_ids as HF
      hidden_states indices) with speculators_model_type "peagle", architectures ["PEagleDraftModel"],
      mask_token_id (vLLM's pard_token), embed_requires_grad false and speculators_config.algorithm "peagle" with
      speculative_tokens = the drafter's depth K (one pass drafts K tokens);
      model.safetensors = EAGLE-3's tensors (layers.0.* for midlayer.*, fc, norm, lm_head, d2t, t2d, input_norm /
      fc_norm.* with the norm options), mask_hidden (1, 1, n*h), and the target's embed_tokens.weight (so --target
      is needed): speculators' P-EAGLE saves and loads its own embedding, which reads the mask token.

The writer stages into a temporary sibling directory; the reader derives every name and shape from config.json
alone, shares no table with the writer, rebuilds a PEagleDrafter and compares its one-pass draft logits with
the source checkpoint's (a random stand-in embedding on both sides) before the directory is renamed into place.
"""

from functools import partial
from pathlib import Path

import torch

from drafters.checkpoint import Checkpoint
from drafters.dtypes import DTYPES
from drafters.eagle3 import NORM_OPTIONS
from drafters.export.common import (ExportError, ExportResult, check_out_dir, export_dtype, export_files, export_target,
                                    load_source, refuse_export, speculators_config, state_problems, target_problems)
from drafters.export.eagle3 import llama_layer_fields
from drafters.export.reading import (CheckReport, ExportCheckError, check_finite, check_layout, compare_with_source,
                                     get_field, int_list, read_json, read_tensors, rebuild, rope_fields)
from drafters.layers import DraftKVCache
from drafters.peagle import PEagleConfig, PEagleDrafter

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the first speculators release with P-EAGLE


# ---- writer ---------------------------------------------------------------------------------------


def export_peagle(ckpt_dir, fmt: str, out_dir, *, target=None, dtype: str = "fp32",
                  speculative_tokens: int | None = None, verifier: str | None = None,
                  overwrite: bool = False) -> ExportResult:
    if fmt != "vllm":
        raise ExportError(f"a peagle checkpoint exports to vllm (speculators' peagle) or native, not {fmt!r}")
    canonical = export_dtype(dtype)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected, c = preflight(ckpt, target)
    tokens = c.depth if speculative_tokens is None else speculative_tokens
    if not 1 <= tokens <= c.depth:
        raise ExportError(f"speculative_tokens={tokens}: this P-EAGLE drafter drafts 1 .. {c.depth} tokens per pass")
    cast = DTYPES[canonical]
    tensors = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k):
               (v.to(cast) if v.is_floating_point() else v) for k, v in ckpt.state_dict.items()}
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu", cast)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    layer = llama_layer_fields(c, canonical)
    config = {
        "architectures": ["PEagleDraftModel"],
        "speculators_model_type": "peagle",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        **{option: getattr(c, option) for option in NORM_OPTIONS}, "norm_output": False,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),  # HF indices, as EAGLE-3's vllm layout
        "mask_token_id": c.mask_token_id,
        "embed_requires_grad": False,  # the target's frozen embedding (a training option only)
        "speculators_config": speculators_config("peagle", tokens, verifier or expected["name"],
                                                 expected.get("architectures") or []),
    }
    return export_files(out_dir, ckpt_dir, fmt, dtype, config, tensors, WEIGHTS_FILE,
                        lambda payload: check_peagle_export(payload, target=expected, reference=ckpt), overwrite)


def preflight(ckpt: Checkpoint, target) -> tuple[dict, PEagleConfig]:
    """-> (target facts, the drafter config). Raises ExportError before any write."""
    if target is None:
        raise ExportError("--format vllm of a P-EAGLE drafter needs --target: speculators' P-EAGLE loads its token "
                          "embedding from the export (the mask slots read it), and that is the target's")
    expected = export_target(ckpt, target)
    try:
        c = PEagleConfig(**ckpt.config)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{ckpt.path}: config is not a PEagleConfig ({err})") from None
    problems = target_problems(c, expected, "vLLM")
    refuse_export(ckpt.path, "vllm", problems + state_problems(c, ckpt.state_dict))
    return expected, c


# ---- independent reader ----------------------------------------------------------------------------


def read_peagle_export(path, *, target: dict | None = None):
    """Reads and validates a speculators peagle export (ours or another trainer's) -> (PEagleConfig with aux
    layers as HF indices, state dict in PEagleDrafter names, the export's embedding (V, h), float dtype).
    Also how exported P-EAGLE drafters are loaded to draft in the decoder."""
    path = Path(path)
    where = str(path / CONFIG_FILE)
    config = read_json(path / CONFIG_FILE)
    get_field(config, "speculators_model_type", str, where, equals="peagle")
    if get_field(config, "architectures", list, where) not in (["PEagleDraftModel"], ["PEagleSpeculator"]):
        raise ExportCheckError(f"{where}: architectures {config['architectures']}, want ['PEagleDraftModel']")
    layer = get_field(config, "transformer_layer_config", dict, where)
    inner = f"{where} transformer_layer_config"
    get_field(layer, "model_type", str, inner, equals="llama")
    if get_field(layer, "num_hidden_layers", int, inner) != 1:
        raise ExportCheckError(f"{inner}: num_hidden_layers {layer['num_hidden_layers']}: this project's P-EAGLE "
                               "drafter has one layer")
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if layer.get(flag, False) is not False:
            raise ExportCheckError(f"{inner}: {flag} = {layer[flag]!r}; this drafter has none")
    if config.get("norm_output", False) is not False:
        raise ExportCheckError(f"{where}: norm_output = {config['norm_output']!r}: P-EAGLE feeds no hidden state back")
    geometry = {key: get_field(layer, key, int, inner) for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "max_position_embeddings")}
    defaults: list[str] = []
    rope = rope_fields(layer, inner, defaults)
    if defaults:
        raise ExportCheckError(f"{inner}: no rope_theta / rope_parameters")
    norms = {name: get_field(config, name, bool, where) for name in NORM_OPTIONS if name in config}
    aux = int_list(config, "eagle_aux_hidden_state_layer_ids", where)
    spec = get_field(config, "speculators_config", dict, where)
    get_field(spec, "algorithm", str, f"{where} speculators_config", equals="peagle")
    methods = get_field(spec, "proposal_methods", list, f"{where} speculators_config")
    if not methods or not all(isinstance(m, dict) and isinstance(m.get("speculative_tokens"), int)
                              and m["speculative_tokens"] >= 1 for m in methods):
        raise ExportCheckError(f"{where} speculators_config: proposal_methods must give speculative_tokens >= 1")
    depth = max(m["speculative_tokens"] for m in methods)  # K: what one pass drafts
    try:
        c = PEagleConfig(**geometry, **rope, rms_norm_eps=get_field(layer, "rms_norm_eps", float, inner),
                         hidden_act=get_field(layer, "hidden_act", str, inner),
                         draft_vocab_size=get_field(config, "draft_vocab_size", int, where), aux_layers=aux,
                         depth=depth, mask_token_id=get_field(config, "mask_token_id", int, where), **norms)
    except ValueError as err:
        raise ExportCheckError(f"{where}: {err}") from None
    if target is not None:
        wrong = [f"{k} {getattr(c, k)} (target {target[k]})" for k in ("hidden_size", "vocab_size",
                                                                       "max_position_embeddings")
                 if getattr(c, k) != target[k]]
        if wrong or not all(1 <= i <= target["num_layers"] - 1 for i in aux):
            raise ExportCheckError(f"{where}: does not fit the target {target.get('name')!r}: {wrong or aux}")
    tensors = read_tensors(path / WEIGHTS_FILE)
    check_finite(tensors, path / WEIGHTS_FILE)
    shapes = _shapes(c)
    check_layout(tensors, shapes, "peagle", path / WEIGHTS_FILE)
    floats = {v.dtype for k, v in tensors.items() if v.is_floating_point()}
    if len(floats) != 1:
        raise ExportCheckError(f"{path / WEIGHTS_FILE}: mixed float dtypes {sorted(map(str, floats))}")
    embedding = tensors.pop("embed_tokens.weight")
    state = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
             for k, v in tensors.items()}
    return c, state, embedding, floats.pop()


def _shapes(c: PEagleConfig) -> dict[str, tuple[int, ...]]:
    h, d, n = c.hidden_size, c.head_dim, len(c.aux_layers)
    p = "layers.0."
    shapes = {
        "embed_tokens.weight": (c.vocab_size, h), "mask_hidden": (1, 1, n * h), "fc.weight": (h, n * h),
        "norm.weight": (h,), "lm_head.weight": (c.draft_vocab_size, h), "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
        p + "self_attn.q_proj.weight": (c.num_attention_heads * d, 2 * h),  # cat(embedding, hidden)
        p + "self_attn.k_proj.weight": (c.num_key_value_heads * d, 2 * h),
        p + "self_attn.v_proj.weight": (c.num_key_value_heads * d, 2 * h),
        p + "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
        p + "mlp.gate_proj.weight": (c.intermediate_size, h), p + "mlp.up_proj.weight": (c.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, c.intermediate_size),
        p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
    }
    if c.norm_before_fc:
        shapes["input_norm.weight"] = (n * h,)
    if c.fc_norm:
        shapes |= {f"fc_norm.{i}.weight": (h,) for i in range(n)}
    return shapes


def check_peagle_export(path, *, target: dict | None = None, reference: Checkpoint | None = None,
                        seed: int = 0) -> CheckReport:
    """Validates the files; with `reference`, the drafter rebuilt from them must draft the source's logits (weights
    rounded to the export dtype) within 1e-5 in one pass over random features."""
    path = Path(path)
    c, state, _, dtype = read_peagle_export(path, target=target)
    rebuilt = rebuild(c, state, path)
    diffs = (None, None)
    if reference is not None:
        diffs = compare_with_source(rebuilt, c, state, reference, dtype, path, partial(_draft_logits, seed=seed))
    return CheckReport(path, "vllm", "peagle", c.aux_layers, c.aux_layers, str(dtype), len(state) + 1, *diffs)




@torch.no_grad()
def _draft_logits(drafter: PEagleDrafter, seed: int, context: int = 7) -> torch.Tensor:
    """Random fused features and tokens as the committed pairs, then one pass: -> (K, Vd)."""
    c = drafter.config
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    embed.weight.copy_(torch.randn(c.vocab_size, c.hidden_size, generator=gen))
    features = torch.randn(1, context + 1, len(c.aux_layers) * c.hidden_size, generator=gen)
    ids = torch.randint(0, c.vocab_size, (1, context + 1), generator=gen)
    cache = DraftKVCache()
    drafter.prefill(features[:, :-1], ids[:, :-1], embed, cache)
    return drafter.draft(features[:, -1:], ids[:, -1:], embed, cache)[1][0]
