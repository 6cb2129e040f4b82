"""EAGLE-3 exports: the sglang and vllm (speculators) layouts, and the refusals that keep an engine
from loading a drafter it would run with collapsed acceptance. The independent reader is
drafters.export.eagle3_reader.

    sglang  SGLang / official EAGLE-3 / SpecForge: config.json (LlamaForCausalLMEagle3) +
            model.safetensors with midlayer.*, fc, norm, lm_head, d2t, t2d
    vllm    vLLM speculators: config.json (speculators_model_type eagle3) + model.safetensors
            with layers.0.* instead of midlayer.*, plus the target's embed_tokens (with --target); a deeper
            drafter's layers.1.* .. as they are (vLLM's llama_eagle3 builds num_hidden_layers layers, all but the
            first on the hidden stream alone; SGLang and llama.cpp build one and are refused)

What the engines do with these files (read in sglang python/sglang/srt/models/llama_eagle3.py and
llama.py, vllm model_executor/models/llama_eagle3.py and llama.py, vllm
transformers_utils/configs/speculators/algos.py, speculators models/eagle3):
- Layer ids. Inside this project: Hugging Face hidden_states indices (k = output of layer k-1).
  SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the input of decoder
  layer id+1 (`set_eagle3_layers_to_capture`: `val + 1`), so it wants HF index - 1. vLLM reads a
  top-level `eagle_aux_hidden_state_layer_ids` and captures the input of decoder layer id
  (`if idx in self.aux_hidden_state_layers`), so it wants the HF index itself. Engines only
  capture inputs of layers 0..L-1: HF index L (final-normed) cannot be served.
- vLLM's speculators reader sets `norm_before_residual = config.get(..., True)`: a missing key
  silently switches the residual to the normed hidden. Ours is on the un-normed h: False.
- SGLang without `draft_vocab_size` swaps our lm_head for the target's full one; with
  `tie_word_embeddings: true` it uses the embedding as lm_head. Without d2t both engines map
  draft id i to target id i. All three are silent; all are written explicitly.
- Both engines hard-code fc = Linear(3 * target_hidden_size, hidden_size): exactly 3 aux layers.
- SGLang needs no embedding: it always shares the target's (`set_embed`). vLLM shares it when
  the checkpoint has no `embed_tokens.weight`, but speculators' own loader then drafts on
  uninitialised memory (eval/check_consumers.py): vllm exports carry the target's embedding
  whenever the target is loaded (--target).
"""

import json
from pathlib import Path

from safetensors.torch import save_file

from drafters.checkpoint import Checkpoint
from drafters.eagle3 import NORM_OPTIONS, Eagle3Config
from drafters.export.common import (CONFIG_FILE, WEIGHTS_FILE, ExportError, decoder_fields, export_target,
                                    refuse_export, speculators_config, state_problems, target_problems)

SPECULATORS_VERSION = "0.5.0"  # first speculators release whose Eagle3 config has aux layer ids


# ---- refusals: everything here runs before a byte is written ---------------------------------

def preflight(ckpt: Checkpoint, fmt: str, target=None) -> dict:
    """-> the target facts to export against (target_info fields). Raises ExportError. A checkpoint of another
    family reaches here for --format native only (drafters.export.dispatch.EXPORTERS)."""
    expected = export_target(ckpt, target)
    if ckpt.family != "eagle3":  # --format native: any family is copied as it is
        return expected
    missing = [k for k in ("num_layers", "hidden_size", "vocab_size", "max_position_embeddings")
               if not isinstance(expected.get(k), int)]
    if missing:
        raise ExportError(f"{ckpt.path}: the checkpoint's target info lacks {missing}, so the "
                          "export cannot be checked against its target; pass --target NAME")
    config = _eagle3_config(ckpt)
    refuse_export(ckpt.path, fmt, _target_problems(config, expected, fmt) + _weight_problems(ckpt, config))
    return expected


def _eagle3_config(ckpt: Checkpoint) -> Eagle3Config:
    try:
        return Eagle3Config(**ckpt.config)
    except TypeError as err:
        raise ExportError(f"{ckpt.path}: config is not an Eagle3Config ({err}); was it written "
                          "by another version of drafters?") from None


def _target_problems(c: Eagle3Config, t: dict, fmt: str) -> list[str]:
    problems = target_problems(c, t, None if fmt == "native" else "SGLang and vLLM")
    norms = [name for name in (*NORM_OPTIONS, "norm_output") if getattr(c, name)]
    if fmt == "sglang" and norms:
        problems.append(f"the drafter was trained with {', '.join(norms)}: the sglang layout is written without "
                        "norm options; export it with --format vllm (which carries them) or native")
    if fmt == "sglang" and c.sliding_layers:
        problems.append(f"layer_types {c.layer_types}: SGLang takes a draft layer's sliding window from its server "
                        "flag --speculative-draft-window-size, never from the checkpoint; export it with --format "
                        "vllm (vLLM reads layer_types and sliding_window) or native")
    if fmt == "sglang" and c.num_hidden_layers > 1:
        problems.append(f"{c.num_hidden_layers} decoder layers: SGLang's LlamaForCausalLMEagle3 builds one; export "
                        "with --format vllm (vLLM's llama_eagle3 stacks num_hidden_layers) or native")
    return problems


def _weight_problems(ckpt: Checkpoint, c: Eagle3Config) -> list[str]:
    state = ckpt.state_dict
    missing = [k for k in ("d2t", "t2d") if k not in state]
    if missing:
        return [f"no {' / '.join(missing)} tensor: engines would map draft id i to target id i"]
    return state_problems(c, state)


# ---- writers ----------------------------------------------------------------------------------

def write_eagle3(fmt: str, ckpt: Checkpoint, state: dict, payload: Path, expected: dict, dtype: str,
                 speculative_tokens: int, verifier: str, embedding=None) -> dict:
    """Writes the sglang or vllm files into the new directory `payload` -> the config written."""
    c = Eagle3Config(**ckpt.config)
    if fmt == "sglang":
        config, tensors = sglang_config(c, dtype), state
    else:
        config = vllm_config(c, dtype, speculative_tokens, verifier,
                             expected.get("architectures") or [])
        tensors = {_vllm_name(k): v for k, v in state.items()}
        if embedding is not None:
            tensors["embed_tokens.weight"] = embedding
    payload.mkdir()
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, payload / WEIGHTS_FILE, metadata={"format": "pt"})
    (payload / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return config


def _vllm_name(key: str) -> str:
    return "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key


def llama_layer_fields(c: Eagle3Config, dtype: str) -> dict:
    """The decoder layers as Llama config fields (more than one: vLLM's layers.1 .. read the hidden stream alone;
    layer_types / sliding_window: vLLM's Llama attention narrows a sliding draft layer to the window)."""
    windows = {} if c.layer_types is None else {"layer_types": list(c.layer_types), "sliding_window": c.sliding_window}
    return {**decoder_fields(c, "llama", c.num_hidden_layers, dtype), "mlp_bias": False, **windows}


def sglang_config(c: Eagle3Config, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_layer_fields(c, dtype),
        "draft_vocab_size": c.draft_vocab_size,  # absent: SGLang uses the target's lm_head
        "target_hidden_size": c.hidden_size,  # fc in_features = 3 * this
        "eagle_config": {
            # SGLang captures the input of layer id + 1: "output of layer" ids = HF index - 1
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layers],
            "use_aux_hidden_state": True,
        },
    }


def vllm_config(c: Eagle3Config, dtype: str, speculative_tokens: int, verifier: str,
                verifier_architectures: list[str]) -> dict:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": llama_layer_fields(c, dtype),
        "draft_vocab_size": c.draft_vocab_size,
        # always written: vLLM defaults a missing norm_before_residual to True; speculators' trainer defaults
        # norm_before_fc and norm_output to True (norm_output: the normed hidden fed back to the next step)
        **{option: getattr(c, option) for option in (*NORM_OPTIONS, "norm_output")},
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),  # vLLM: HF index as is
        "speculators_config": speculators_config("eagle3", speculative_tokens, verifier, verifier_architectures),
    }
