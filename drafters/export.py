"""Export a native drafter checkpoint in the layouts serving engines load.

    sglang  SGLang / official EAGLE-3 / SpecForge: config.json (LlamaForCausalLMEagle3) +
            model.safetensors with midlayer.*, fc, norm, lm_head, d2t, t2d
    vllm    vLLM speculators: config.json (speculators_model_type eagle3) + model.safetensors
            with layers.0.* instead of midlayer.*, plus the target's embed_tokens (with --target)
    native  a validated copy of the drafters checkpoint (any family)
    medusa  Medusa / TGI: config.json (medusa_num_heads, ...) + medusa_lm_head.safetensors; medusa
            checkpoints only (writer and independent reader: drafters.export_medusa)
    eagle1  official EAGLE-1 layout: config.json + fc.*, layers.0.*; eagle1 checkpoints trained on
            normed features only (writer and independent reader: drafters.export_eagle1)

Knows nothing about training, targets' weights or decoding. It refuses, before anything lands in
the output directory, every export an engine would load and then run with collapsed acceptance,
writes into a temporary sibling directory, has `drafters.export_check` (an independent reader)
reload the files and compare draft logits with the source checkpoint, and only then renames the
directory into place.

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
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafters.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_target,
    load_checkpoint,
    save_checkpoint,
    target_info,
)
from drafters.draft_vocab import DraftVocab, DraftVocabError
from drafters.eagle3 import Eagle3Config, Eagle3Drafter

FORMATS = ("sglang", "vllm", "native", "medusa", "eagle1")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
ENGINE_AUX_LAYERS = 3  # SGLang and vLLM build fc with in_features = 3 * target_hidden_size
SPECULATORS_VERSION = "0.5.0"  # first speculators release whose Eagle3 config has aux layer ids
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


class ExportError(ValueError):
    pass


@dataclass
class ExportResult:
    path: Path
    fmt: str
    dtype: str
    files: list[str]
    config: dict  # what was written to the config file
    check: object = None  # drafters.export_check.CheckReport


def export_checkpoint(ckpt_dir, fmt: str, out_dir, *, target=None, dtype: str = "fp32",
                      speculative_tokens: int = 3, verifier: str | None = None,
                      overwrite: bool = False) -> ExportResult:
    """target: a loaded drafters Target to validate against (else the checkpoint's target info)."""
    from drafters.export_check import check_export  # the independent reader

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "medusa":  # --verifier names the base model (base_model_name_or_path)
        from drafters.export_medusa import export_medusa

        return export_medusa(ckpt_dir, out_dir, target=target, dtype=dtype, base_model=verifier, overwrite=overwrite)
    if fmt == "eagle1":  # official EAGLE-1 layout: writer and independent reader in drafters.export_eagle1
        from drafters.export_eagle1 import export_eagle1

        return export_eagle1(ckpt_dir, out_dir, target=target, dtype=dtype, overwrite=overwrite)
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if speculative_tokens < 1:
        raise ExportError(f"speculative_tokens={speculative_tokens} must be >= 1")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected = preflight(ckpt, fmt, target)
    state = cast_floats(ckpt.state_dict, DTYPES[dtype])

    def write(payload: Path):
        config = _write(fmt, ckpt, state, payload, expected, dtype, speculative_tokens,
                        verifier or expected["name"], _embedding(fmt, target, DTYPES[dtype]))
        return config, check_export(payload, fmt, target=expected, reference=ckpt)

    config, report = write_staged(out_dir, ckpt_dir, fmt, write, overwrite)
    return ExportResult(path=out_dir, fmt=fmt, dtype=dtype, config=config, check=report,
                        files=exported_files(out_dir))


# ---- refusals: everything here runs before a byte is written ---------------------------------

def load_source(ckpt_dir) -> Checkpoint:
    """The checkpoint to export; refused if unreadable or holding NaN / inf weights."""
    from drafters.export_check import check_finite

    try:
        ckpt = load_checkpoint(ckpt_dir)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    check_finite(ckpt.state_dict, Path(ckpt_dir) / WEIGHTS_FILE)
    return ckpt


def preflight(ckpt: Checkpoint, fmt: str, target=None) -> dict:
    """-> the target facts to export against (target_info fields). Raises ExportError."""
    if ckpt.family != "eagle3" and fmt != "native":
        formats = {"eagle1": "eagle1 or native", "medusa": "medusa or native"}.get(ckpt.family, "native")
        raise ExportError(f"export of a {ckpt.family} checkpoint to {fmt} is not supported (sglang and vllm "
                          f"hold EAGLE-3 drafters); use --format {formats}")
    if target is not None:
        try:
            check_target(ckpt, target)
        except CheckpointError as err:
            raise ExportError(str(err)) from None
    expected = target_info(target) if target is not None else dict(ckpt.target)
    if ckpt.family != "eagle3":
        return expected
    missing = [k for k in ("num_layers", "hidden_size", "vocab_size", "max_position_embeddings")
               if not isinstance(expected.get(k), int)]
    if missing:
        raise ExportError(f"{ckpt.path}: the checkpoint's target info lacks {missing}, so the "
                          "export cannot be checked against its target; pass --target NAME")
    config = _eagle3_config(ckpt)
    problems = _target_problems(config, expected, fmt) + _weight_problems(ckpt, config)
    if problems:
        raise ExportError(f"refusing to export {ckpt.path} to {fmt}: an engine would load it and "
                          "lose acceptance silently:\n  - " + "\n  - ".join(problems))
    return expected


def _eagle3_config(ckpt: Checkpoint) -> Eagle3Config:
    try:
        return Eagle3Config(**ckpt.config)
    except TypeError as err:
        raise ExportError(f"{ckpt.path}: config is not an Eagle3Config ({err}); was it written "
                          "by another version of drafters?") from None


def _target_problems(c: Eagle3Config, t: dict, fmt: str) -> list[str]:
    problems = []
    for key in ("max_position_embeddings", "vocab_size", "hidden_size"):
        if getattr(c, key) != t[key]:
            problems.append(f"{key}: drafter config {getattr(c, key)} != target {t[key]} "
                            f"({t.get('name')!r})")
    num_layers = t["num_layers"]
    low, high = (0, num_layers) if fmt == "native" else (1, num_layers - 1)
    bad = [i for i in c.aux_layers if not low <= i <= high]
    if bad:
        problems.append(f"aux layers {c.aux_layers} (HF hidden_states indices): {bad} outside "
                        f"[{low}, {high}] for the {num_layers}-layer target"
                        + ("" if fmt == "native" else "; engines capture only the inputs of "
                           "decoder layers 1..L-1"))
    if sorted(set(c.aux_layers)) != list(c.aux_layers):
        problems.append(f"aux layers {c.aux_layers} must be distinct and ascending (low, mid, "
                        "high), the order fc was trained on")
    if fmt != "native" and len(c.aux_layers) != ENGINE_AUX_LAYERS:
        problems.append(f"{len(c.aux_layers)} aux layers: SGLang and vLLM build fc for exactly "
                        f"{ENGINE_AUX_LAYERS}")
    return problems


def _weight_problems(ckpt: Checkpoint, c: Eagle3Config) -> list[str]:
    state = ckpt.state_dict
    missing = [k for k in ("d2t", "t2d") if k not in state]
    if missing:
        return [f"no {' / '.join(missing)} tensor: engines would map draft id i to target id i"]
    problems = []
    try:
        DraftVocab.from_state_dict(state, source=str(ckpt.path),
                                   draft_vocab_size=c.draft_vocab_size,
                                   target_vocab_size=c.vocab_size)
    except DraftVocabError as err:
        problems.append(str(err))
    drafter = Eagle3Drafter(c)
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        problems.append(f"the state dict does not fit its config: {err}")
    return problems


# ---- writers ----------------------------------------------------------------------------------

def cast_floats(state: dict, dtype: torch.dtype) -> dict:
    # d2t (int64) and t2d (bool) keep their dtypes
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _embedding(fmt: str, target, dtype: torch.dtype):
    # vllm: the target's token embedding goes into the export (as speculators' own saves hold
    # it). speculators 0.9 fills a missing one from the verifier only if it is still NaN, which
    # it no longer is under transformers 5.x: it would draft on uninitialised memory. vLLM uses
    # the file's embedding when there is one: the same values. Without a target it is left out.
    return target.embed_tokens.weight.to(dtype) if fmt == "vllm" and target is not None else None


def _write(fmt, ckpt, state, payload: Path, expected, dtype, speculative_tokens, verifier,
           embedding=None) -> dict:
    if fmt == "native":
        save_checkpoint(payload, family=ckpt.family, config=ckpt.config, target=ckpt.target,
                        state_dict=state, extra=ckpt.extra)
        return json.loads((payload / "drafter.json").read_text())
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
    """The one decoder layer as Llama config fields. rope_theta / rope_scaling are the legacy
    keys: transformers 4.x (what the engines pin) reads them and 5.x converts them."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "vocab_size": c.vocab_size,  # the target's: embedding and t2d size
        "max_position_embeddings": c.max_position_embeddings,  # the target's
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,  # True makes SGLang use the embedding as lm_head
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }


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
        "norm_before_residual": False,  # residual on the un-normed h; vLLM defaults to True
        # EAGLE-3.1 norms this drafter has none of (speculators' trainer defaults two to True)
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),  # vLLM: HF index as is
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


# ---- atomic placement, and what --overwrite may replace -----------------------------------------
# Every export holds MARKER, written last, listing its files. --overwrite replaces a directory only
# when it holds nothing but those files (or nothing at all) and not the source checkpoint: never a
# training run, a checkpoint, a model directory or a file someone added.

MARKER = ".drafters-export.json"


def check_out_dir(out_dir: Path, source, overwrite: bool) -> None:
    """Raises ExportError unless out_dir is free or (overwrite) replaceable; deletes nothing."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not overwrite:
        raise ExportError(f"{out_dir} already exists; pass --overwrite to replace it or choose "
                          "another --out")
    problems = _not_replaceable(out_dir, Path(source))
    if problems:
        raise ExportError(f"refusing to replace {out_dir} (--overwrite): " + "; ".join(problems)
                          + f". --overwrite only replaces a directory an earlier export wrote (its "
                          f"{MARKER} lists its files); choose another --out, or move {out_dir} "
                          "away yourself")


def _not_replaceable(out_dir: Path, source: Path) -> list[str]:
    if out_dir.is_symlink() or not out_dir.is_dir():
        return ["it is not a directory" + (" (a symlink)" if out_dir.is_symlink() else "")]
    problems = []
    out, src = out_dir.resolve(), source.resolve()
    if out == src or out in src.parents:
        problems.append(f"it is or contains the source checkpoint {source}")
    entries = {p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()}
    foreign = sorted(entries - _marked_files(out_dir))
    if foreign:
        run = {"metrics.jsonl", "drafter.json"} & set(foreign) or any(n.startswith("checkpoint-")
                                                                      for n in foreign)
        problems.append(f"it holds {len(foreign)} entries no export wrote"
                        + (" (a training run or checkpoint)" if run else "") + ": "
                        + ", ".join(foreign[:8]) + (", ..." if len(foreign) > 8 else ""))
    return problems


def _marked_files(out_dir: Path) -> set[str]:
    # the plain files an earlier export listed in its marker (none without a readable marker)
    try:
        listed = json.loads((out_dir / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    names = {MARKER, *(n for n in listed if isinstance(n, str))}
    return {n for n in names if (out_dir / n).is_file() and not (out_dir / n).is_symlink()}


def exported_files(out_dir: Path) -> list[str]:
    return sorted(p.name for p in out_dir.iterdir() if p.name != MARKER)


def write_staged(out_dir: Path, source, fmt: str, write, overwrite: bool):
    """write(payload) writes and validates the export in a temporary sibling directory -> its
    result; then the marker is added and the directory renamed into place."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=_parent(out_dir)))
    try:
        payload = staging / "export"
        result = write(payload)
        marker = {"files": exported_files(payload), "format": fmt, "source": str(source)}
        (payload / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        check_out_dir(out_dir, source, overwrite)  # again: it may have changed meanwhile
        _move_into_place(payload, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent


def _move_into_place(payload: Path, out_dir: Path) -> None:
    if out_dir.exists():  # a replaceable earlier export: moved aside, so a crash keeps one of the two
        old = out_dir.with_name(f".{out_dir.name}.old-{payload.parent.name}")
        out_dir.rename(old)
        payload.rename(out_dir)
        shutil.rmtree(old)
    else:
        payload.rename(out_dir)


def describe(result: ExportResult) -> str:
    lines = [f"wrote {result.fmt} export ({result.dtype}) to {result.path}:"]
    lines += [f"  {name}" for name in result.files]
    if result.check is not None:
        lines.append(result.check.summary())
    return "\n".join(lines)
