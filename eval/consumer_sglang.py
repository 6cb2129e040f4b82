"""SGLang's side of eval/check_consumers.py: runs INSIDE the consumers' virtual environment
(.ci/consumers-venv installs sglang 0.5.23 there without its dependencies) and never imports
drafters. It reads our --format sglang export the way SGLang 0.5.23 does, as far as that can run
on a CPU machine:

    python eval/consumer_sglang.py EXPORT_DIR OUT_JSON

- import: `sglang.srt.models.llama_eagle3` is tried; where it stops is reported (installed without
  dependencies: at `orjson`; with the pure-Python ones: `sglang.srt.configs` imports torchvision,
  whose PyPI build fails against the CPU torch; behind it sgl_kernel and a torch 2.14.1 pin).
- config: parsed by the transformers SGLang pins (5.19.0) with `AutoConfig`, then read field by
  field as `LlamaForCausalLMEagle3` / its `LlamaModel` (models/llama_eagle3.py) and
  `_resolve_eagle_aux_hidden_state` (model_executor/model_runner_components/spec_aux_hidden_state.py)
  read it; captured layers as `set_eagle3_layers_to_capture` sets them (models/llama.py: id + 1,
  the input of that decoder layer = Hugging Face hidden_states index id + 1).
- weights: the name mapping (`legacy_name_map`, `stacked_params_mapping`) is taken from the
  installed source of `LlamaForCausalLMEagle3.load_weights` by `ast` (not imported, not copied)
  and applied to every tensor in the export, as load_weights does: a name that lands on no
  parameter is dropped SILENTLY there, so here it is a problem; so is a parameter nothing loads.
  The parameter names are the modules' attributes, each checked to be assigned in the source.
"""

import ast
import importlib.util
import json
import sys
import traceback
from pathlib import Path

from safetensors import safe_open

# parameter -> (source file under sglang/srt/models, class, attribute assigned in its __init__)
PARAMETERS = {
    "model.embed_tokens.weight": ("llama_eagle3.py", "LlamaModel", "embed_tokens"),
    "model.fc.weight": ("llama_eagle3.py", "LlamaModel", "fc"),
    "model.layers.0.self_attn.qkv_proj.weight": ("llama_eagle3.py", "LlamaDecoderLayer", "qkv_proj"),
    "model.layers.0.self_attn.o_proj.weight": ("llama.py", "LlamaAttention", "o_proj"),
    "model.layers.0.mlp.gate_up_proj.weight": ("llama.py", "LlamaMLP", "gate_up_proj"),
    "model.layers.0.mlp.down_proj.weight": ("llama.py", "LlamaMLP", "down_proj"),
    "model.layers.0.input_layernorm.weight": ("llama.py", "LlamaDecoderLayer", "input_layernorm"),
    "model.layers.0.post_attention_layernorm.weight": ("llama.py", "LlamaDecoderLayer", "post_attention_layernorm"),
    "model.layers.0.hidden_norm.weight": ("llama_eagle3.py", "LlamaDecoderLayer", "hidden_norm"),
    "model.norm.weight": ("llama_eagle3.py", "LlamaModel", "norm"),
    "lm_head.weight": ("llama_eagle3.py", "LlamaForCausalLMEagle3", "lm_head"),
}
SHARDS = {"model.layers.0.self_attn.qkv_proj.weight": {"q", "k", "v"},
          "model.layers.0.mlp.gate_up_proj.weight": {0, 1}}
FROM_TARGET = {"model.embed_tokens.weight"}  # eagle_worker: draft_runner.model.set_embed(target's)


def models_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without running it
    if spec is None:
        raise SystemExit("sglang is not installed in this environment: run .ci/consumers-venv")
    return Path(spec.submodule_search_locations[0]) / "srt" / "models"


def try_import() -> str | None:
    try:
        import sglang.srt.models.llama_eagle3  # noqa: F401
    except Exception as err:  # any failure is the finding: where the import stops
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "site-packages" in f.filename]
        last = frames[-1] if frames else None
        where = f"{last.filename.split('site-packages/')[-1]}:{last.lineno}" if last else "?"
        return f"{type(err).__name__}: {err} (at {where})"
    return None


def classes(file: Path) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, ast.ClassDef)}


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def assigned_attributes(cls: ast.ClassDef) -> set[str]:
    # self.x = ... and self.a.x = ... in __init__ -> {"x", ...}
    return {target.attr for node in ast.walk(method(cls, "__init__")) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Attribute)}


def load_weights_tables(source: dict[str, ast.ClassDef]) -> tuple[dict, list]:
    tables = {}
    for node in ast.walk(method(source["LlamaForCausalLMEagle3"], "load_weights")):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("legacy_name_map", "stacked_params_mapping"):
                tables[node.targets[0].id] = ast.literal_eval(node.value)
    return tables["legacy_name_map"], tables["stacked_params_mapping"]


def map_names(names, params: set[str], legacy: dict, stacked: list) -> tuple[dict, dict]:
    """load_weights' routing of each checkpoint name -> (name -> (parameter or None, shard),
    parameter -> shards loaded). d2t becomes hot_token_id; t2d is skipped."""
    routed, loaded = {}, {}
    for original in names:
        name = original
        for old, new in legacy.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name or "t2d" in name:
            routed[original] = ("hot_token_id" if "d2t" in name else "(skipped)", None)
            continue
        shard = None
        for param_name, weight_name, shard_id in stacked:
            if weight_name in name:
                name, shard = name.replace(weight_name, param_name), shard_id
                break
        param = name if name in params else f"model.{name}"
        routed[original] = (param if param in params else None, shard)
        if param in params:
            loaded.setdefault(param, set()).add(shard)
    return routed, loaded


def read_config(export: Path) -> tuple[dict, list[str]]:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(export)
    eagle = getattr(c, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    rope = getattr(c, "rope_parameters", None) or {}
    read = {
        "architectures": c.architectures,
        "model_type": c.model_type,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "hidden_size_in": getattr(c, "target_hidden_size", None) or c.hidden_size,
        "num_aux_hidden_states": getattr(c, "num_aux_hidden_states", None) or (len(ids) if ids else 3),
        "vocab_size": c.vocab_size,
        "draft_vocab_size": getattr(c, "draft_vocab_size", None),
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "head_dim": getattr(c, "head_dim", None),
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": rope.get("rope_theta"),
        "rope_type": rope.get("rope_type"),
        "hidden_act": c.hidden_act,
        "use_aux_hidden_state": eagle.get("use_aux_hidden_state", True) if isinstance(eagle, dict) else None,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_fc": bool(eagle.get("norm_before_fc", getattr(c, "norm_before_fc", False))),
        "fc_norm": bool(getattr(c, "fc_norm", None) or getattr(c, "use_aux_norm", False)),
        "norm_output": bool(getattr(c, "norm_output", False)),
    }
    problems = []
    if c.architectures != ["LlamaForCausalLMEagle3"]:
        problems.append(f"architectures {c.architectures}: SGLang would pick another model class")
    if c.tie_word_embeddings:
        problems.append("tie_word_embeddings: SGLang uses the target's embedding as lm_head")
    if read["draft_vocab_size"] is None:
        problems.append("no draft_vocab_size: SGLang loads the target's full lm_head instead of ours")
    if ids is None:
        problems.append("no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang captures its defaults")
    problems += [f"{key} is on: a norm our drafter was not trained with"
                 for key in ("norm_before_fc", "fc_norm", "norm_output") if read[key]]
    read["captured_hf_indices"] = [i + 1 for i in ids] if ids else None  # llama.py: val + 1
    return read, problems


def main(export: Path, out_json: Path) -> None:
    srt_models = models_dir()
    sources = {name: classes(srt_models / name) for name in ("llama_eagle3.py", "llama.py")}
    problems = [f"{param}: {cls}.{attr} is no longer assigned in sglang/srt/models/{file}"
                for param, (file, cls, attr) in PARAMETERS.items()
                if attr not in assigned_attributes(sources[file][cls])]
    legacy, stacked = load_weights_tables(sources["llama_eagle3.py"])
    with safe_open(export / "model.safetensors", framework="pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    routed, loaded = map_names(shapes, set(PARAMETERS), legacy, stacked)
    problems += [f"{name}: no SGLang parameter takes it (load_weights drops it silently)"
                 for name, (param, _) in routed.items() if param is None]
    for param in PARAMETERS:
        want = SHARDS.get(param, {None})
        if param not in FROM_TARGET and loaded.get(param, set()) != want:
            problems.append(f"{param}: loaded shards {sorted(map(str, loaded.get(param, set())))}, "
                            f"needs {sorted(map(str, want))}: it would keep its initial values")
    config, config_problems = read_config(export)
    h, n = config["hidden_size"], config["num_aux_hidden_states"]
    expected = {"fc.weight": [h, config["hidden_size_in"] * n], "lm_head.weight": [config["draft_vocab_size"], h]}
    problems += config_problems + [f"{name} {shapes.get(name)} but SGLang builds {shape}"
                                   for name, shape in expected.items() if shapes.get(name) != shape]
    report = {"import_stops_at": try_import(), "config_read": config,
              "captured_hf_indices": config.pop("captured_hf_indices"),
              "weights": {name: param for name, (param, _) in routed.items()}, "problems": problems}
    out_json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
