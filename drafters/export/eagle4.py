"""Export an EAGLE-4 drafter in a speculators-style layout with the candidate head added, and read such exports back
independently.

    python eval/export.py outputs/eagle4_smollm2/checkpoint-final --format vllm --out exports/eagle4 \
        --target smollm2-135m-instruct

vllm  config.json = speculators' EAGLE-3 layout (transformer_layer_config of Llama fields with layer_types /
      sliding_window, draft_vocab_size, the norm options and norm_output, target_hidden_size,
      eagle_aux_hidden_state_layer_ids as HF hidden_states indices) with speculators_model_type "eagle4",
      architectures ["LlamaForCausalLMEagle4"] (NeMo Automodel's EAGLE-4 serving name), candidate_head {rank,
      num_candidates} and speculators_config.algorithm "eagle4";
      model.safetensors = EAGLE-3's tensors (layers.0.* for midlayer.*, fc, norm, lm_head, d2t, t2d, input_norm /
      fc_norm.*), the candidate head under NeMo's export names, efficient_lm_head.weight A (Vd, r) and
      efficient_lm_head_down_proj.weight B (r, h), and with --target the target's embed_tokens.weight.
One decoder layer (LlamaForCausalLMEagle4 holds one). No engine in this project's reach runs the candidate head:
SGLang's LlamaForCausalLMEagle3 and llama.cpp's EAGLE-3 graph have none, so those exports are refused
(drafters.export.dispatch).

The writer stages into a temporary sibling directory; the reader derives every name and shape from config.json alone,
shares no table with the writer, rebuilds an Eagle4Drafter and compares its drafted rows (the candidates' exact
logits) with the source checkpoint's before the directory is renamed into place.
"""

from functools import partial
from pathlib import Path

import torch

from drafters.checkpoint import Checkpoint
from drafters.dtypes import DTYPES
from drafters.eagle3 import NORM_OPTIONS
from drafters.eagle4 import Eagle4Config, Eagle4Drafter
from drafters.export.common import (ExportError, ExportResult, check_out_dir, export_dtype, export_files, export_target,
                                    load_source, refuse_export, speculators_config, state_problems, target_problems)
from drafters.export.eagle3 import llama_layer_fields
from drafters.export.reading import (CheckReport, ExportCheckError, check_finite, check_layout, compare_with_source,
                                     get_field, int_list, read_json, read_tensors, rebuild, rope_fields)
from drafters.layers import DraftKVCache

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SPECULATORS_VERSION = "0.9.0"


# ---- writer ---------------------------------------------------------------------------------------


def export_eagle4(ckpt_dir, fmt: str, out_dir, *, target=None, dtype: str = "fp32",
                  speculative_tokens: int | None = None, verifier: str | None = None,
                  overwrite: bool = False) -> ExportResult:
    if fmt != "vllm":
        raise ExportError(f"an eagle4 checkpoint exports to vllm (LlamaForCausalLMEagle4) or native, not {fmt!r}")
    canonical = export_dtype(dtype)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected, c = preflight(ckpt, target)
    tokens = 3 if speculative_tokens is None else speculative_tokens
    if tokens < 1:
        raise ExportError(f"speculative_tokens={tokens} must be >= 1")
    cast = DTYPES[canonical]
    tensors = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k):
               (v.to(cast) if v.is_floating_point() else v) for k, v in ckpt.state_dict.items()}
    if target is not None:  # what speculators' saves hold; the serving adapters load the target's in its place
        tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu", cast)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    config = {
        "architectures": ["LlamaForCausalLMEagle4"],
        "speculators_model_type": "eagle4",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": llama_layer_fields(c, canonical),
        "draft_vocab_size": c.draft_vocab_size,
        **{option: getattr(c, option) for option in (*NORM_OPTIONS, "norm_output")},
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),  # HF indices, as EAGLE-3's vllm layout
        "candidate_head": {"rank": c.rank, "num_candidates": c.candidates},
        "speculators_config": speculators_config("eagle4", tokens, verifier or expected["name"],
                                                 expected.get("architectures") or []),
    }
    return export_files(out_dir, ckpt_dir, fmt, dtype, config, tensors, WEIGHTS_FILE,
                        lambda payload: check_eagle4_export(payload, target=expected, reference=ckpt), overwrite)


def preflight(ckpt: Checkpoint, target) -> tuple[dict, Eagle4Config]:
    """-> (target facts, the drafter config). Raises ExportError before any write."""
    expected = export_target(ckpt, target)
    try:
        c = Eagle4Config(**ckpt.config)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{ckpt.path}: config is not an Eagle4Config ({err})") from None
    problems = target_problems(c, expected, "the engines")
    if c.num_hidden_layers != 1:
        problems.append(f"{c.num_hidden_layers} decoder layers: LlamaForCausalLMEagle4 holds one; export with "
                        "--format native")
    refuse_export(ckpt.path, "vllm", problems + state_problems(c, ckpt.state_dict))
    return expected, c


# ---- independent reader ----------------------------------------------------------------------------


def read_eagle4_export(path, *, target: dict | None = None):
    """Reads and validates an eagle4 export -> (Eagle4Config with aux layers as HF indices, state dict in
    Eagle4Drafter names, the export's embedding (V, h) or None, float dtype). Also how exported EAGLE-4 drafters are
    loaded to draft in the decoder."""
    path = Path(path)
    where = str(path / CONFIG_FILE)
    config = read_json(path / CONFIG_FILE)
    get_field(config, "speculators_model_type", str, where, equals="eagle4")
    if get_field(config, "architectures", list, where) != ["LlamaForCausalLMEagle4"]:
        raise ExportCheckError(f"{where}: architectures {config['architectures']}, want ['LlamaForCausalLMEagle4']")
    layer = get_field(config, "transformer_layer_config", dict, where)
    inner = f"{where} transformer_layer_config"
    get_field(layer, "model_type", str, inner, equals="llama")
    if get_field(layer, "num_hidden_layers", int, inner) != 1:
        raise ExportCheckError(f"{inner}: num_hidden_layers {layer['num_hidden_layers']}: LlamaForCausalLMEagle4 "
                               "holds one decoder layer")
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if layer.get(flag, False) is not False:
            raise ExportCheckError(f"{inner}: {flag} = {layer[flag]!r}; this drafter has none")
    geometry = {key: get_field(layer, key, int, inner) for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "max_position_embeddings")}
    defaults: list[str] = []
    rope = rope_fields(layer, inner, defaults)
    if defaults:
        raise ExportCheckError(f"{inner}: no rope_theta / rope_parameters")
    window = {"layer_types": get_field(layer, "layer_types", list, inner),
              "sliding_window": layer.get("sliding_window")} if "layer_types" in layer else {}
    flags = {name: get_field(config, name, bool, where) for name in (*NORM_OPTIONS, "norm_output")}
    head = get_field(config, "candidate_head", dict, where)
    try:
        c = Eagle4Config(**geometry, **rope, **window, **flags,
                         rms_norm_eps=get_field(layer, "rms_norm_eps", float, inner),
                         hidden_act=get_field(layer, "hidden_act", str, inner),
                         draft_vocab_size=get_field(config, "draft_vocab_size", int, where),
                         aux_layers=int_list(config, "eagle_aux_hidden_state_layer_ids", where),
                         rank=get_field(head, "rank", int, f"{where} candidate_head"),
                         candidates=get_field(head, "num_candidates", int, f"{where} candidate_head"))
    except ValueError as err:
        raise ExportCheckError(f"{where}: {err}") from None
    get_field(get_field(config, "speculators_config", dict, where), "algorithm", str, f"{where} speculators_config",
              equals="eagle4")
    if target is not None:
        wrong = [f"{k} {getattr(c, k)} (target {target[k]})" for k in ("hidden_size", "vocab_size",
                                                                       "max_position_embeddings")
                 if getattr(c, k) != target[k]]
        if wrong or not all(1 <= i <= target["num_layers"] - 1 for i in c.aux_layers):
            raise ExportCheckError(f"{where}: does not fit the target {target.get('name')!r}: {wrong or c.aux_layers}")
    tensors = read_tensors(path / WEIGHTS_FILE)
    check_finite(tensors, path / WEIGHTS_FILE)
    shapes = _shapes(c, embedding="embed_tokens.weight" in tensors)
    check_layout(tensors, shapes, "eagle4", path / WEIGHTS_FILE)
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    if len(floats) != 1:
        raise ExportCheckError(f"{path / WEIGHTS_FILE}: mixed float dtypes {sorted(map(str, floats))}")
    embedding = tensors.pop("embed_tokens.weight", None)
    state = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
             for k, v in tensors.items()}
    return c, state, embedding, floats.pop()


def _shapes(c: Eagle4Config, embedding: bool) -> dict[str, tuple[int, ...]]:
    h, d, n, vd = c.hidden_size, c.head_dim, len(c.aux_layers), c.draft_vocab_size
    p = "layers.0."
    shapes = {
        "fc.weight": (h, n * h), "norm.weight": (h,), "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (c.vocab_size,),
        "efficient_lm_head.weight": (vd, c.rank), "efficient_lm_head_down_proj.weight": (c.rank, h),  # A, B
        p + "self_attn.q_proj.weight": (c.num_attention_heads * d, 2 * h),  # cat(embedding, hidden)
        p + "self_attn.k_proj.weight": (c.num_key_value_heads * d, 2 * h),
        p + "self_attn.v_proj.weight": (c.num_key_value_heads * d, 2 * h),
        p + "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
        p + "mlp.gate_proj.weight": (c.intermediate_size, h), p + "mlp.up_proj.weight": (c.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, c.intermediate_size),
        p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
    }
    if embedding:
        shapes["embed_tokens.weight"] = (c.vocab_size, h)
    if c.norm_before_fc:
        shapes["input_norm.weight"] = (n * h,)
    if c.fc_norm:
        shapes |= {f"fc_norm.{i}.weight": (h,) for i in range(n)}
    return shapes


def check_eagle4_export(path, *, target: dict | None = None, reference: Checkpoint | None = None,
                        seed: int = 0) -> CheckReport:
    """Validates the files; with `reference`, the drafter rebuilt from them must draft the source's rows (weights
    rounded to the export dtype) within 1e-5 over random features: the candidates' exact logits, -inf elsewhere."""
    path = Path(path)
    c, state, embedding, dtype = read_eagle4_export(path, target=target)
    rebuilt = rebuild(c, state, path)
    diffs = (None, None)
    if reference is not None:
        diffs = compare_with_source(rebuilt, c, state, reference, dtype, path, partial(_draft_rows, seed=seed),
                                    what="drafted rows")
    return CheckReport(path, "vllm", "eagle4", c.aux_layers, c.aux_layers, str(dtype),
                       len(state) + (embedding is not None), *diffs)


@torch.no_grad()
def _draft_rows(drafter: Eagle4Drafter, seed: int, context: int = 7) -> list[torch.Tensor]:
    """Random fused features and tokens prefilled, then two chain steps: -> [full-head logits, drafted rows with
    the -inf off the candidates replaced by a constant, so that equal rows compare as equal]."""
    c = drafter.config
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    embed.weight.copy_(torch.randn(c.vocab_size, c.hidden_size, generator=gen))
    features = torch.randn(1, context, len(c.aux_layers) * c.hidden_size, generator=gen)
    ids = torch.randint(0, c.vocab_size, (1, context + 2), generator=gen)
    cache = DraftKVCache()
    hidden, rows = drafter.prefill(features, ids[:, :context], embed, cache)
    step_hidden, step_rows = drafter.step(hidden[:, -1:], ids[:, context:context + 1], embed, cache)
    drafted = torch.cat([rows, step_rows], 1)
    return [drafter.compute_logits(torch.cat([hidden, step_hidden], 1)), drafted.nan_to_num(neginf=-1e4)]
