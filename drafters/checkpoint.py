"""The native drafter checkpoint, shared by every drafter family.

A checkpoint is a directory:

    drafter.json        {"format": "drafters/1", "family": "eagle3" | "eagle1" | "medusa" | ...,
                         "config": {family config}, "target": {what the drafter was built for},
                         "extra": {recipe, step, metrics, ...}}
    model.safetensors   the drafter's own tensors only (never the target's embedding or LM head
                        unless the family trains its own copy), plus buffers such as d2t / t2d

It is written atomically: into a temporary sibling directory, then renamed over the destination,
so a crash or a full disk never leaves a half-written checkpoint where a reader looks. This module
knows nothing about the families: it stores their config dicts and state dicts as given.
"""

import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from drafters.errors import UserError
from drafters.files import move_dir_into_place
from drafters.fingerprint import outer_rows_fingerprint, weights_fingerprint

FORMAT = "drafters/1"
CONFIG_FILE, WEIGHTS_FILE = "drafter.json", "model.safetensors"
# What a drafter must agree on with the target it runs against (see `check_target`).
TARGET_FIELDS = ("model_type", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings")


class CheckpointError(UserError):
    pass


@dataclass
class Checkpoint:
    path: Path
    family: str
    config: dict
    target: dict
    extra: dict
    state_dict: dict[str, torch.Tensor]


def target_info(target) -> dict:
    """What a checkpoint records about its target (a drafters `Target`)."""
    config = target.config.get_text_config()
    return {
        "name": target.name,
        "model_type": config.model_type,
        "architectures": list(getattr(target.config, "architectures", None) or []),
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        # the first fingerprint (embedding, LM head and final norm rows only), kept for the versions that read only
        # it: they would refuse a checkpoint whose "fingerprint" they cannot reproduce
        "fingerprint": outer_rows_fingerprint(target),
        "weights_fingerprint": target_fingerprint(target),
    }


def target_fingerprint(target) -> str:
    """A fingerprint of every weight tensor of the target (drafters.fingerprint: each tensor's name, shape and a strided
    sample of its values, rounded to bf16 so that the same weights loaded in float32 or bfloat16 agree): another model
    of the same shape (a fine-tune, a merged LoRA, another seed) differs. 16 hex digits."""
    return weights_fingerprint(target.model)


def save_checkpoint(path, *, family: str, config: dict, target: dict, state_dict: dict,
                    extra: dict | None = None, write_more: Callable[[Path], None] | None = None,
                    tmp: Path | None = None) -> Path:
    """write_more(tmp_dir) adds files (e.g. the trainer state for resuming) inside the same atomic
    write; tmp: an empty directory to write into (multi-process saves agree on it), else a new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent)) if tmp is None else Path(tmp)
    try:
        if write_more is not None:
            write_more(tmp)
        # safetensors wants contiguous tensors that share no storage
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": FORMAT, "family": family})
        meta = {"format": FORMAT, "family": family, "config": config, "target": target, "extra": extra or {}}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _fsync_tree(tmp)
        move_dir_into_place(tmp, path, str(os.getpid()))  # replaces an existing checkpoint
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_checkpoint(path, *, family: str | None = None) -> Checkpoint:
    path = Path(path)
    meta_path = path / CONFIG_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a drafters checkpoint (no {CONFIG_FILE}); pass the directory "
                              "a training run wrote, e.g. runs/<name>/checkpoint-final")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{meta_path}: not valid JSON ({err}); the checkpoint is corrupt") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, this version reads {FORMAT!r}")
    for key in ("family", "config", "target"):
        if key not in meta:
            raise CheckpointError(f"{meta_path}: missing field {key!r}; the checkpoint is corrupt")
    if family is not None and meta["family"] != family:
        raise CheckpointError(f"{path}: a {meta['family']!r} checkpoint, expected {family!r}")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{path}: {WEIGHTS_FILE} is missing; the checkpoint is incomplete")
    try:
        state_dict = load_file(weights)
    except SafetensorError as err:
        raise CheckpointError(f"{weights}: cannot be read ({err}); the checkpoint is truncated or corrupt") from None
    bad = nonfinite(state_dict)
    if bad:  # a NaN passes every "diff > tol" test and drafts nothing: measured, it would look like tau 1.0
        raise CheckpointError(f"{weights}: non-finite weights (NaN or inf) in {', '.join(bad[:6])}"
                              + (", ..." if len(bad) > 6 else "") + "; the drafter diverged or was saved corrupted: "
                              "use an earlier checkpoint or retrain")
    return Checkpoint(path, meta["family"], meta["config"], meta["target"], meta.get("extra", {}), state_dict)


def nonfinite(tensors: dict) -> list[str]:
    """'name (k of n)' for each floating tensor holding NaN or inf."""
    return [f"{name} ({int((~t.isfinite()).sum())} of {t.numel()})" for name, t in tensors.items()
            if t.is_floating_point() and not bool(t.isfinite().all())]


def check_target(checkpoint: Checkpoint, target, *, other_weights: str = "refuse") -> None:
    """Refuse to run a drafter against a target it was not built for (silent acceptance collapse). A target of the
    same shape with other weights (see `weights_differ`) is refused, or with other_weights="warn" (measuring tau) said
    in one line."""
    have = target_info(target)
    wrong = [f"{k}: checkpoint {checkpoint.target.get(k)} vs target {have[k]}"
             for k in TARGET_FIELDS if checkpoint.target.get(k) != have[k]]
    if wrong:
        raise CheckpointError(f"{checkpoint.path} was trained for target {checkpoint.target.get('name')!r}, "
                              f"which does not match {target.name!r}: " + "; ".join(wrong))
    message = weights_differ(checkpoint.target, have)
    if message is None:
        return
    if other_weights == "warn":
        print(f"warning: {checkpoint.path} {message}; {OTHER_WEIGHTS_TAU}")
        return
    raise CheckpointError(f"{checkpoint.path} {message}. Use the target it was trained on")


OTHER_WEIGHTS_TAU = "tau measured here is not that drafter's on its own target"


def weights_differ(recorded: dict, have: dict) -> str | None:
    """Why the target whose target_info is `have` is another model than the one a checkpoint recorded (`recorded`,
    its "target" record), both of the same shape: "was trained on target ... with other weights than ...", or None.
    Compared: the weights fingerprint (every tensor). A checkpoint written before it records only the first
    fingerprint (embedding, LM head and final norm rows): compared the old way, blind to the decoder layers; one
    from before any fingerprint passes."""
    key = next((k for k in ("weights_fingerprint", "fingerprint") if recorded.get(k) is not None), None)
    if key is None or recorded[key] == have[key]:
        return None
    same_outer = key == "weights_fingerprint" and recorded.get("fingerprint") == have["fingerprint"]
    return (f"was trained on target {recorded.get('name')!r} with other weights than {have['name']!r} (weights "
            f"fingerprint {recorded[key]} vs {have[key]}): the same shape, another model"
            + (" (the same embedding and LM head: a fine-tune of one base, e.g. a merged LoRA)" if same_outer else "")
            + "; its drafts are for that one")


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def damage(path) -> str | None:
    """What makes a checkpoint directory unreadable, from headers only (cheap): drafter.json must
    parse, every *.safetensors be as long as its header says, every torch file (*.bin, *.pkl, *.pt,
    e.g. an optimizer state) end in its zip directory, which a truncated write loses. None: complete."""
    path = Path(path)
    try:
        json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"{path / CONFIG_FILE}: unreadable ({err})"
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if file.suffix == ".safetensors":
            problem = _safetensors_damage(file)
        elif file.suffix in (".bin", ".pkl", ".pt"):
            problem = None if zipfile.is_zipfile(file) else "truncated or corrupt (no zip directory at its end)"
        else:
            continue
        if problem:
            return f"{file}: {problem}"
    return None


def _safetensors_damage(file: Path) -> str | None:
    # layout: 8-byte little-endian header length n, n bytes of JSON header, then the tensors' bytes
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n)) if len(head) == 8 else None
        except ValueError:
            header = None
    if not isinstance(header, dict):
        return "truncated or corrupt header"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    size = file.stat().st_size
    return f"truncated ({size} bytes, its header needs {8 + n + end})" if size < 8 + n + end else None


STEP_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def step_checkpoints(run_dir) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoint-<step> directories of a run, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if (m := STEP_CHECKPOINT.fullmatch(p.name)) and (p / CONFIG_FILE).is_file()]
    return sorted(found)


def prune_checkpoints(run_dir, keep_last: int) -> list[Path]:
    """Deletes all but the newest `keep_last` checkpoint-<step> directories (checkpoint-final and
    anything else is never touched); 0 keeps all. -> the deleted paths."""
    if keep_last <= 0:
        return []
    doomed = [path for _, path in step_checkpoints(run_dir)[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
