"""The reader toolkit every export format's independent reader shares (drafters.export.eagle3_reader for EAGLE-3,
drafters.export.dflash / eagle1 / medusa for theirs): the check error and report, JSON and safetensors files read
with errors that name the file, typed config fields, the Llama fields in their transformers 4.x and 5.x
spellings with LlamaConfig's defaults, a finite-weights check, and the drafter the tensors read back make (built
through drafters.registry, as every loader builds it). It holds no writer's table or name mapping:
a bug in a writer must not be able to hide itself in its reader.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from drafters.checkpoint import CheckpointError, nonfinite
from drafters.draft_vocab import DraftVocabError
from drafters.errors import UserError
from drafters.registry import build_drafter, family_of


class ExportCheckError(UserError):
    pass


@dataclass
class CheckReport:
    path: Path
    fmt: str
    family: str
    aux_layers_hf: list[int] | None  # as read back, converted to HF hidden_states indices
    engine_layer_ids: list[int] | None  # as written for the engine
    float_dtype: str | None
    num_tensors: int
    max_logit_diff: float | None  # vs the source with weights rounded to the export dtype
    max_logit_diff_vs_source: float | None  # vs the unrounded source (bf16 rounding shows here)

    def summary(self) -> str:
        lines = [f"validation ({self.fmt}, {self.family}): {self.num_tensors} tensors, "
                 f"floats {self.float_dtype}: config, names, shapes, dtypes OK"]
        if self.aux_layers_hf is not None:
            lines.append(f"  aux layers: HF hidden_states {self.aux_layers_hf} -> written "
                         f"{self.engine_layer_ids}")
        if self.max_logit_diff is not None:
            lines.append(f"  rebuilt drafter == source: max |logit diff| {self.max_logit_diff:.2e}"
                         f" (vs unrounded source {self.max_logit_diff_vs_source:.2e})")
        return "\n".join(lines)


# torch_dtype -> the float weights an export may hold; float16: what the EAGLE repository's checkpoints hold
# (our writers write float32 or bfloat16). The readers' own table, not drafters.dtypes, which the writers cast
# with: a wrong shared entry would pass writer and reader alike.
READER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# read_json, get_field and read_tensors: file parsing every format's reader shares (never a writer's table)

def read_json(file: Path, error=None, missing: str = "") -> dict:
    # error: the reader's ExportCheckError subclass; missing: said after "{file} is missing"
    error = error or ExportCheckError
    if not file.is_file():
        raise error(f"{file} is missing{missing}")
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise error(f"{file}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise error(f"{file}: want a JSON object, got {type(value).__name__}")
    return value


def get_field(config: dict, key: str, kind, where: str, *, equals=None):
    if key not in config:
        raise ExportCheckError(f"{where}: required field {key!r} is missing")
    value = config[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python: an int field must not be a bool and vice versa
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        names = "/".join(k.__name__ if k is not type(None) else "null" for k in kinds)
        raise ExportCheckError(f"{where}: field {key!r} = {value!r} should be {names}")
    if equals is not None and value != equals:
        raise ExportCheckError(f"{where}: field {key!r} = {value!r}, the format requires "
                               f"{equals!r}")
    return value


def int_list(config: dict, key: str, where: str) -> list[int]:
    value = get_field(config, key, list, where)
    if not value or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ExportCheckError(f"{where}: {key!r} = {value!r} should be a non-empty int list")
    return value


# ---- Llama fields in transformers 4.x and 5.x spellings, and LlamaConfig's defaults -------------
# Also read by the EAGLE-1 reader (drafters.export.eagle1): both layouts hold a one-layer LlamaConfig.

LLAMA_ROPE_THETA = 10000.0  # LlamaConfig's default base, in transformers 4.x and 5.x alike


def llama_default(config: dict, key: str, default: int, rule: str, where: str, defaults: list[str]) -> int:
    """An int field LlamaConfig derives when it is absent (head_dim, num_key_value_heads)."""
    if config.get(key) is not None:
        return get_field(config, key, int, where)
    defaults.append(f"{key} {default} ({rule})")
    return default


def note_defaults(defaults: list[str], where: str, notes: list[str]) -> None:
    if defaults:
        notes.append(f"{where}: not recorded, so the defaults its loaders apply: {'; '.join(defaults)}")


def rope_fields(config: dict, where: str, defaults: list[str]) -> dict:
    """-> {rope_theta, rope_scaling} from either spelling: transformers 4.x `rope_theta` +
    `rope_scaling` (null, or {rope_type (before 4.45: type), factor, ...}) or 5.x `rope_parameters`
    {rope_type, rope_theta, ...}. A config holding both (SpecForge under 5.x keeps `rope_theta`
    beside `rope_parameters`) must say the same in both. Neither: LlamaConfig's base 10000.0 and
    no scaling (the EAGLE repository's Llama-2 configs), appended to `defaults`."""
    theta = scaling = None
    if config.get("rope_theta") is not None:
        theta = float(get_field(config, "rope_theta", (int, float), where))
    if config.get("rope_scaling") is not None:
        scaling = _scaling(get_field(config, "rope_scaling", dict, where), f"{where} rope_scaling")
    if config.get("rope_parameters") is not None:
        rope = dict(get_field(config, "rope_parameters", dict, where))
        inner = f"{where} rope_parameters"
        if "rope_theta" not in rope:  # per layer type (Gemma-3 style): a Llama draft layer has one
            raise ExportCheckError(f"{inner}: {sorted(rope)} holds no rope_theta; want {{rope_type, "
                                   "rope_theta, ...}} for the drafter's one layer")
        new_theta = float(get_field(rope, "rope_theta", (int, float), inner))
        del rope["rope_theta"]
        new_scaling = _scaling(rope, inner)
        if theta is not None and theta != new_theta:
            raise ExportCheckError(f"{where}: rope_theta = {theta} but rope_parameters.rope_theta = "
                                   f"{new_theta}: the transformers 4.x and 5.x spellings disagree")
        if "rope_scaling" in config and scaling != new_scaling:
            raise ExportCheckError(f"{where}: rope_scaling = {config['rope_scaling']} but rope_parameters "
                                   f"= {config['rope_parameters']}: the transformers 4.x and 5.x spellings "
                                   "disagree")
        theta, scaling = new_theta, new_scaling
    if theta is None:
        theta = LLAMA_ROPE_THETA
        defaults.append(f"rope_theta {theta} (LlamaConfig's)")
    return {"rope_theta": theta, "rope_scaling": scaling}


def _scaling(rope: dict, where: str) -> dict | None:
    # the scaling parameters without the base; rope_type "default" (or none given) = no scaling = None
    rope = dict(rope)
    if "type" in rope:  # transformers 4.x before 4.45 named it type
        kind = rope.pop("type")
        if rope.setdefault("rope_type", kind) != kind:
            raise ExportCheckError(f"{where}: type {kind!r} and rope_type {rope['rope_type']!r} disagree")
    return rope if rope.get("rope_type", "default") != "default" else None


def config_dtype(config: dict, where: str) -> str | None:
    """The weights' dtype as the config states it: `torch_dtype` (transformers 4.x) or `dtype` (5.x);
    both must agree; None when neither is there (then the weights decide)."""
    found = {key: get_field(config, key, str, where) for key in ("torch_dtype", "dtype")
             if config.get(key) is not None}
    if len(set(found.values())) > 1:
        raise ExportCheckError(f"{where}: torch_dtype = {found['torch_dtype']!r} but dtype = "
                               f"{found['dtype']!r}: the transformers 4.x and 5.x spellings disagree")
    return next(iter(found.values()), None)


def read_tensors(file: Path, error=None, missing: str = "") -> dict[str, torch.Tensor]:
    error = error or ExportCheckError
    if not file.is_file():
        raise error(f"{file} is missing{missing}")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as err:
        raise error(f"{file}: not a readable safetensors file ({err})") from None


def check_finite(tensors: dict[str, torch.Tensor], where) -> None:
    # NaN compares False with everything: a NaN weight would pass every "diff > atol" test below
    bad = nonfinite(tensors)
    if bad:
        raise ExportCheckError(f"{where}: non-finite weights (NaN or inf) in {', '.join(bad[:6])}"
                               + (", ..." if len(bad) > 6 else "") + "; the drafter diverged or was "
                               "saved corrupted: export an earlier checkpoint or retrain")


def float_dtype(tensors: dict, stated: str | None, where, allowed: dict = READER_DTYPES, error=None) -> torch.dtype:
    """The one dtype of an export's weights, every tensor but the draft vocabulary's maps (d2t int64, t2d bool),
    which must be one of `allowed` (torch_dtype name -> dtype: an int8 weight is refused, not cast) and match the
    config's torch_dtype where it states one."""
    error = error or ExportCheckError
    floats = {v.dtype for k, v in tensors.items() if k not in ("d2t", "t2d")}
    if len(floats) != 1 or not floats <= set(allowed.values()):
        raise error(f"{where}: float tensors must all be {' or all '.join(allowed)}, got {sorted(map(str, floats))}")
    dtype = floats.pop()
    if stated is not None and allowed.get(stated) != dtype:
        raise error(f"{where}: config says torch_dtype {stated!r} but the weights are {dtype}")
    return dtype


def check_layout(tensors: dict, shapes: dict[str, tuple], layout: str, where, error=None) -> None:
    """The tensor names are exactly `shapes`' keys and each has its shape (derived from the config read back);
    else `error` naming the file, the layout, and what is missing, unexpected or misshapen."""
    error = error or ExportCheckError
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise error(f"{where}: tensor names do not match the {layout} layout: missing {missing}, unexpected "
                    f"{unexpected}")
    wrong = [f"{k} {tuple(tensors[k].shape)} (want {s})" for k, s in shapes.items() if tuple(tensors[k].shape) != s]
    if wrong:
        raise error(f"{where}: wrong shapes, derived from the config: {wrong}")


def rebuild(config, state: dict, where, error=None):
    """The drafter that tensors read back from an export make: the family's own constructor and a strict load
    (drafters.registry.build_drafter, as checkpoints and proposers build it), in float32 and eval mode. Tensors
    that do not fit the config read back -> `error` (the reader's ExportCheckError subclass) naming `where`."""
    floats = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    try:
        return build_drafter(family_of(config), config, floats, where).eval()
    except (CheckpointError, DraftVocabError, ValueError) as err:
        raise (error or ExportCheckError)(f"{where}: the tensors do not load into a {type(config).__name__} drafter: "
                                          f"{str(err).removeprefix(f'{where}: ')}") from None


def compare_with_source(rebuilt, config, state: dict, reference, dtype: torch.dtype, where, outputs,
                        what: str = "draft logits", error=None) -> tuple[float, float]:
    """The export read back against the checkpoint it was written from (`reference`, a drafters.checkpoint
    Checkpoint): the same config, the same draft vocabulary (d2t, t2d where the state holds them), and `outputs`
    (drafter -> a tensor or a list of them, on fixed random inputs; `what` they are, for the error) of the rebuilt drafter within 1e-5 of the
    source's with its weights rounded to the export's float dtype. -> (max |diff| against the rounded source,
    against the unrounded one: what the dtype's rounding costs)."""
    error = error or ExportCheckError
    source = type(config)(**reference.config)
    if asdict(source) != asdict(config):
        wrong = {k: (v, getattr(config, k)) for k, v in asdict(source).items() if getattr(config, k) != v}
        raise error(f"{where}: the config read back differs from the source's (source, export): {wrong}")
    for key in ("d2t", "t2d"):
        if key in state and not torch.equal(state[key], reference.state_dict[key]):
            raise error(f"{where}: {key} differs from the source checkpoint's draft vocabulary")
    rounded = {k: v.to(dtype) if v.is_floating_point() else v for k, v in reference.state_dict.items()}
    got, want, unrounded = (_as_list(outputs(drafter)) for drafter in (
        rebuilt, rebuild(config, rounded, where, error), rebuild(config, reference.state_dict, where, error)))
    diff = max((a - b).abs().max().item() for a, b in zip(got, want))
    if not diff <= 1e-5:  # NaN fails too
        raise error(f"{where}: the drafter rebuilt from the export gives {what} up to {diff:.3g} away from the "
                    "source checkpoint's (atol 1e-5)")
    return diff, max((a - b).abs().max().item() for a, b in zip(got, unrounded))


def _as_list(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
