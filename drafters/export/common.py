"""What every export format shares: dtypes, errors and results, reading the source checkpoint, and
atomic placement of the output directory (staged in a temporary sibling, validated by the format's
independent reader, renamed into place; --overwrite replaces only an earlier export).
Knows nothing about any format's files."""

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafters.checkpoint import Checkpoint, CheckpointError, check_target, load_checkpoint, target_info
from drafters.draft_vocab import DraftVocabError
from drafters.dtypes import dtype_name, spellings
from drafters.errors import UserError
from drafters.export.reading import check_finite
from drafters.files import check_writable, move_dir_into_place
from drafters.layers import ENGINE_AUX_LAYERS
from drafters.registry import build_drafter, family_of

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
EXPORT_DTYPES = ("float32", "bfloat16")  # what engines load; drafters.dtypes names
EXPORT_DTYPE_SPELLINGS = spellings(EXPORT_DTYPES)  # float32, bfloat16, fp32, bf16 (eval/export.py --dtype)


class ExportError(UserError):
    pass


SILENT_LOSS = "an engine would load it and lose acceptance silently"


def refuse_export(source, fmt: str, problems: list[str], why: str | None = SILENT_LOSS) -> None:
    """Every writer's last check before a byte is written: the problems found, as one ExportError naming the source
    checkpoint and the format (nothing when there are none)."""
    if problems:
        raise ExportError(f"refusing to export {source} to {fmt}" + (f": {why}" if why else "") + ":\n  - "
                          + "\n  - ".join(problems))


def state_problems(config, state: dict) -> list[str]:
    """[] when `state` loads strictly into the drafter `config` describes, built as every loader builds it
    (drafters.registry.build_drafter, draft vocabulary included), else the one problem."""
    try:
        build_drafter(family_of(config), config, state, "the state dict")
    except (CheckpointError, DraftVocabError) as err:
        return [f"the state dict does not fit its config: {str(err).removeprefix('the state dict: ')}"]
    return []


def target_problems(c, target: dict, engines: str | None = "SGLang and vLLM") -> list[str]:
    """What an EAGLE-style drafter config `c` (its hidden_size, vocab_size, max_position_embeddings, aux_layers)
    gets wrong about the target facts `target` (export_target). engines: who reads the layout and builds fc for
    exactly ENGINE_AUX_LAYERS fused layers from the inputs of decoder layers 1..L-1 (HF hidden_states indices
    [1, L-1]); None for our own native layout, which takes any aux layers in [0, L]."""
    problems = [f"{key}: drafter config {getattr(c, key)} != target {target[key]} ({target.get('name')!r})"
                for key in ("max_position_embeddings", "vocab_size", "hidden_size") if getattr(c, key) != target[key]]
    num_layers = target["num_layers"]
    low, high = (0, num_layers) if engines is None else (1, num_layers - 1)
    bad = [i for i in c.aux_layers if not low <= i <= high]
    if bad:
        problems.append(f"aux layers {c.aux_layers} (HF hidden_states indices): {bad} outside [{low}, {high}] for "
                        f"the {num_layers}-layer target"
                        + ("" if engines is None else "; engines capture only the inputs of decoder layers 1..L-1"))
    if sorted(set(c.aux_layers)) != list(c.aux_layers):
        problems.append(f"aux layers {c.aux_layers} must be distinct and ascending (low, mid, high), the order fc "
                        "was trained on")
    if engines is not None and len(c.aux_layers) != ENGINE_AUX_LAYERS:
        problems.append(f"{len(c.aux_layers)} aux layers: {engines} build fc for exactly {ENGINE_AUX_LAYERS}")
    return problems


def decoder_fields(c, model_type: str, num_layers: int, dtype: str) -> dict:
    """A drafter's decoder layers as the Hugging Face config fields every layout writes (Llama's for EAGLE-1 and
    EAGLE-3, Qwen3's for DFlash); each format adds its own keys. c: the drafter config; vocab_size and
    max_position_embeddings are the target's (embedding, t2d size, rope range). rope_theta / rope_scaling are the
    legacy keys: transformers 4.x (what the engines pin) reads them and 5.x converts them. dtype: a drafters.dtypes
    name (float32 | bfloat16), written as torch_dtype."""
    return {
        "model_type": model_type,
        "num_hidden_layers": num_layers,
        **{key: getattr(c, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "hidden_act", "vocab_size",
                                            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling")},
        "attention_bias": False,
        "tie_word_embeddings": False,  # True makes SGLang use the embedding as lm_head
        "torch_dtype": dtype,
    }


def export_dtype(dtype: str) -> str:
    """'fp32' / 'float32' -> 'float32', 'bf16' / 'bfloat16' -> 'bfloat16' (drafters.dtypes): what an
    export's weights are cast to and its config's torch_dtype says."""
    try:
        return dtype_name(dtype, EXPORT_DTYPES)
    except ValueError as err:
        raise ExportError(str(err)) from None


@dataclass
class ExportResult:
    path: Path
    fmt: str
    dtype: str
    files: list[str]
    config: dict  # what was written to the config file
    check: object = None  # drafters.export.eagle3_reader.CheckReport


def export_target(ckpt: Checkpoint, target=None) -> dict:
    """The target facts (target_info fields) to export against: a loaded target's, once it is checked
    against what the checkpoint records, else what the checkpoint records. Raises ExportError."""
    if target is None:
        return dict(ckpt.target)
    try:
        check_target(ckpt, target)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    return target_info(target)


def load_source(ckpt_dir) -> Checkpoint:
    """The checkpoint to export; refused if unreadable or holding NaN / inf weights."""
    try:
        ckpt = load_checkpoint(ckpt_dir)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    check_finite(ckpt.state_dict, Path(ckpt_dir) / WEIGHTS_FILE)
    return ckpt


def cast_floats(state: dict, dtype: torch.dtype) -> dict:
    # d2t (int64) and t2d (bool) keep their dtypes
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


# ---- atomic placement, and what --overwrite may replace -----------------------------------------
# Every export holds MARKER, written last, listing its files. --overwrite replaces a directory only
# when it holds nothing but those files (or nothing at all) and not the source checkpoint: never a
# training run, a checkpoint, a model directory or a file someone added.

MARKER = ".drafters-export.json"


def check_out_dir(out_dir: Path, source, overwrite: bool) -> None:
    """Raises ExportError unless out_dir is free or (overwrite) replaceable; deletes nothing. Its folder must be
    writable (OutputError): the export is staged beside out_dir and moved into place."""
    check_writable(Path(out_dir).parent, f"--out {out_dir}: its folder", directory=True)
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


def export_files(out_dir: Path, source, fmt: str, dtype: str, config: dict, tensors: dict, weights_file: str,
                 check, overwrite: bool) -> ExportResult:
    """A format of one config.json and one safetensors file: both written, check(payload) -> the report of
    the format's independent reader, then placed as write_staged does. dtype: as the caller named it."""

    def write(payload: Path):
        payload.mkdir()
        save_file(tensors, payload / weights_file, metadata={"format": "pt"})
        (payload / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return check(payload)

    report = write_staged(out_dir, source, fmt, write, overwrite)
    report.path = out_dir
    return ExportResult(path=out_dir, fmt=fmt, dtype=dtype, config=config, check=report,
                        files=exported_files(out_dir))


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
        move_dir_into_place(payload, out_dir, payload.parent.name)  # a replaceable earlier export
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent


def describe(result: ExportResult) -> str:
    lines = [f"wrote {result.fmt} export ({result.dtype}) to {result.path}:"]
    lines += [f"  {name}" for name in result.files]
    if result.check is not None:
        lines.append(result.check.summary())
    return "\n".join(lines)


def speculators_config(algorithm: str, speculative_tokens: int, verifier: str, architectures) -> dict:
    """speculators' `speculators_config` block, the same in every family's vllm layout: greedy proposals of
    `speculative_tokens` tokens, accepted by exact match, against the verifier model vLLM loads beside the drafter."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(architectures)}}
