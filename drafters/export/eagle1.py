"""Export an EAGLE-1 drafter in the official EAGLE layout, and read such an export back independently.

    python eval/export.py outputs/eagle1_smollm2/checkpoint-final --format eagle1 --out exports/eagle1

    config.json        the ONE decoder layer as LlamaConfig fields: architectures ["LlamaForCausalLM"],
                       model_type llama, num_hidden_layers 1, hidden_size, intermediate_size,
                       num_attention_heads, num_key_value_heads, head_dim, hidden_act, rms_norm_eps,
                       rope_theta, rope_scaling, vocab_size and max_position_embeddings (the target's),
                       bias true (fc has one), attention_bias / mlp_bias false, tie_word_embeddings false,
                       torch_dtype
    model.safetensors  fc.weight (h, 2h), fc.bias (h,), layers.0.self_attn.{q,k,v,o}_proj.weight,
                       layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight;
                       no input_layernorm (the official layer 0 has none), no embedding, no LM head

That is the SafeAILab/EAGLE EAGLE-1 model (eagle/model/cnets1.py: fc over cat(embed, hidden), layer 0
without input_layernorm, output = the predicted feature, no final norm) and what SGLang's llama_eagle.py
loads, the target's embedding and LM head shared (SGLang wants architectures ["LlamaForCausalLMEagle"]:
edit that one field for it). Both feed the drafter the target's final-NORMED last hidden state and put
the LM head straight on its output, so only drafters trained with eagle1.feature=normed export: a
pre_norm drafter would load there and draft from the wrong feature with collapsed acceptance.

The writer stages into a temporary sibling directory, has the reader below (which derives every name
and shape from config.json alone, sharing nothing with the writer) reload and check every field, name,
shape and dtype, rebuilds an Eagle1Drafter from the files and compares its predicted features and
logits with the source checkpoint's, and only then renames the directory into place.

The reader also loads the EAGLE repository's own saves: either transformers spelling of the Llama fields,
architectures ["LlamaForCausalLMEagle"], and the fields its configs leave out at the defaults its loader
and LlamaConfig apply (bias true, head_dim, num_key_value_heads, rope_theta 10000), said in one note;
float16 weights.
"""

from pathlib import Path

import torch

from drafters.checkpoint import Checkpoint
from drafters.dtypes import DTYPES
from drafters.eagle1 import Eagle1Config, Eagle1Drafter
from drafters.export.common import (ExportError, ExportResult, check_out_dir, decoder_fields, export_dtype,
                                    export_files, export_target, load_source, refuse_export, state_problems)
from drafters.export.reading import (CheckReport, ExportCheckError, check_finite, check_layout,
                                     compare_with_source, config_dtype, float_dtype, get_field, llama_default,
                                     note_defaults, read_json, read_tensors, rebuild, rope_fields)
from drafters.layers import DraftKVCache
from drafters.targets import FrozenHead

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


# ---- writer ---------------------------------------------------------------------------------------


def export_eagle1(ckpt_dir, out_dir, *, target=None, dtype: str = "fp32", overwrite: bool = False) -> ExportResult:
    """target: a loaded drafters Target to validate against (else the checkpoint's target info)."""
    canonical = export_dtype(dtype)  # float32 | bfloat16
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected, c = preflight(ckpt, target)
    tensors = {k: v.detach().to("cpu", DTYPES[canonical]).contiguous().clone()  # names are already official
               for k, v in ckpt.state_dict.items()}
    return export_files(out_dir, ckpt_dir, "eagle1", dtype, official_config(c, canonical), tensors, WEIGHTS_FILE,
                        lambda payload: check_eagle1_export(payload, target=expected, reference=ckpt), overwrite)


def preflight(ckpt: Checkpoint, target=None) -> tuple[dict, Eagle1Config]:
    """-> (target facts to export against, the drafter config). Raises ExportError before any write."""
    expected = export_target(ckpt, target)
    try:
        c = Eagle1Config(**ckpt.config)
    except TypeError as err:
        raise ExportError(f"{ckpt.path}: config is not an Eagle1Config ({err})") from None
    problems = [f"{key}: drafter config {getattr(c, key)} != target {expected.get(key)} ({expected.get('name')!r})"
                for key in ("hidden_size", "vocab_size", "max_position_embeddings")
                if getattr(c, key) != expected.get(key)]
    if c.feature != "normed":
        problems.append(f"feature {c.feature!r}: the official EAGLE code and SGLang feed the drafter the target's "
                        "final-normed hidden state and apply the LM head directly; retrain with eagle1.feature=normed "
                        "to export, or export --format native")
    refuse_export(ckpt.path, "eagle1", problems + state_problems(c, ckpt.state_dict))
    return expected, c


def official_config(c: Eagle1Config, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        **decoder_fields(c, "llama", 1, dtype),
        "bias": True,  # fc has a bias (official EAGLE-1 `Model(config, bias=True)`)
        "mlp_bias": False,
    }


# ---- independent reader ----------------------------------------------------------------------------


# the official layout names the plain Llama class; SGLang's loader wants its EAGLE class (same files)
ARCHITECTURES = (["LlamaForCausalLM"], ["LlamaForCausalLMEagle"])


def read_eagle1_export(path, *, target: dict | None = None,
                       notes: list[str] | None = None) -> tuple[Eagle1Config, dict, torch.dtype]:
    """Reads and validates an official-layout EAGLE-1 export -> (Eagle1Config with feature "normed", the
    official layout's meaning; state dict in Eagle1Drafter names; float dtype). Either transformers
    spelling of the Llama fields is read (drafters.export.eagle3_reader.rope_fields, config_dtype); fields the
    EAGLE repository's configs leave out take the defaults its loader and LlamaConfig apply, one line
    about them appended to `notes`."""
    path = Path(path)
    config = read_json(path / CONFIG_FILE)
    where = str(path / CONFIG_FILE)
    if get_field(config, "architectures", list, where) not in ARCHITECTURES:
        raise ExportCheckError(f"{where}: field 'architectures' = {config['architectures']!r}, the format "
                               f"requires one of {list(ARCHITECTURES)}")
    get_field(config, "model_type", str, where, equals="llama")
    get_field(config, "num_hidden_layers", int, where, equals=1)
    defaults = []
    if "bias" in config:  # the EAGLE repository's loader: `bias = con["bias"]`, absent -> True
        get_field(config, "bias", bool, where, equals=True)
    else:
        defaults.append("bias true (the EAGLE repository's loader: fc has a bias)")
    get_field(config, "tie_word_embeddings", bool, where, equals=False)
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False) is not False:
            raise ExportCheckError(f"{where}: {flag!r} = {config[flag]!r}, this drafter's layer has no biases")
    g = {key: get_field(config, key, int, where) for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "max_position_embeddings")}
    g["num_key_value_heads"] = llama_default(config, "num_key_value_heads", g["num_attention_heads"],
                                             "LlamaConfig: = num_attention_heads", where, defaults)
    g["head_dim"] = llama_default(config, "head_dim", g["hidden_size"] // g["num_attention_heads"],
                                  "LlamaConfig: = hidden_size / num_attention_heads", where, defaults)
    c = Eagle1Config(**g, rms_norm_eps=get_field(config, "rms_norm_eps", float, where),
                     **rope_fields(config, where, defaults),
                     hidden_act=get_field(config, "hidden_act", str, where), feature="normed")
    stated_dtype = config_dtype(config, where)
    if target is not None:
        for key in ("hidden_size", "vocab_size", "max_position_embeddings"):
            if g[key] != target.get(key):
                raise ExportCheckError(f"{where}: {key} = {g[key]} but the target has {target.get(key)}; the "
                                       "drafter would run with lost acceptance")
    tensors = read_tensors(path / WEIGHTS_FILE)
    check_finite(tensors, path / WEIGHTS_FILE)
    dtype = _check_tensors(tensors, g, stated_dtype, path / WEIGHTS_FILE)
    if notes is not None:
        note_defaults(defaults, where, notes)
    return c, tensors, dtype


def expected_shapes(g: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the official EAGLE-1 layout, shaped from config.json alone."""
    h, d, heads, kv, inter = (g["hidden_size"], g["head_dim"], g["num_attention_heads"], g["num_key_value_heads"],
                              g["intermediate_size"])
    return {
        "fc.weight": (h, 2 * h),  # cat(embed, feature) (2h) -> h
        "fc.bias": (h,),
        "layers.0.self_attn.q_proj.weight": (heads * d, h),
        "layers.0.self_attn.k_proj.weight": (kv * d, h),
        "layers.0.self_attn.v_proj.weight": (kv * d, h),
        "layers.0.self_attn.o_proj.weight": (h, heads * d),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
        "layers.0.post_attention_layernorm.weight": (h,),
    }


def check_eagle1_export(path, *, target: dict | None = None, reference: Checkpoint | None = None,
                        seed: int = 0) -> CheckReport:
    """Validates the files; with `reference`, a drafter rebuilt from them must give the source's
    predicted features and logits (weights rounded to the export dtype) within 1e-5."""
    path = Path(path)
    c, state, dtype = read_eagle1_export(path, target=target)
    rebuilt = rebuild(c, state, path)
    diffs = (None, None)
    if reference is not None:
        diffs = compare_with_source(rebuilt, c, state, reference, dtype, path, lambda d: _outputs(d, c, seed),
                                    what="features and logits")
    return CheckReport(path, "eagle1", "eagle1", None, None, str(dtype), len(state), *diffs)


def _check_tensors(tensors: dict, g: dict, stated_dtype: str | None, where: Path) -> torch.dtype:
    shapes = expected_shapes(g)
    check_layout(tensors, shapes, "official EAGLE-1", where)
    return float_dtype(tensors, stated_dtype, where)  # float16 too: the EAGLE repository's checkpoints




@torch.no_grad()
def _outputs(drafter: Eagle1Drafter, c: Eagle1Config, seed: int, seq_len: int = 6) -> list[torch.Tensor]:
    """Prefill on random features + token ids, then one step on the drafter's own predicted feature, with a
    random embedding and LM head standing in for the target's -> [features, logits, step feature, logits]."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    embed.weight.copy_(torch.randn(c.vocab_size, c.hidden_size, generator=gen))
    lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
    lm_head.weight.copy_(torch.randn(c.vocab_size, c.hidden_size, generator=gen))
    drafter.attach_head(FrozenHead(lm_head, None))  # normed: the LM head straight on the output
    features = torch.randn(1, seq_len, c.hidden_size, generator=gen)  # (1, T, h)
    ids = torch.randint(0, c.vocab_size, (1, seq_len + 1), generator=gen)
    cache = DraftKVCache()
    hidden, logits = drafter.prefill(features, ids[:, :seq_len], embed, cache)
    step_hidden, step_logits = drafter.step(hidden[:, -1:], ids[:, seq_len:], embed, cache)
    return [hidden, logits, step_hidden, step_logits]
