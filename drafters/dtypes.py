"""The one dtype vocabulary. Names are torch's: float32, bfloat16, float16, as recipes (`dtype`,
`features.dtype`), targets, the offline feature store and exported configs' `torch_dtype` write them. The
short spellings fp32 / bf16 / fp16 (eval/export.py's --dtype) name the same dtypes wherever a name is read.
Autocast's `mixed_precision` (no / bf16 / fp16) is accelerate's setting, not a dtype name.
"""

from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DtypeName = Literal["float32", "bfloat16", "float16"]  # recipe fields; the keys of DTYPES
SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def spellings(allowed=tuple(DTYPES)) -> list[str]:
    # every name that reads as one of `allowed`: torch's first, then the short ones
    return [*allowed, *(short for short, name in SHORT_NAMES.items() if name in allowed)]


def dtype_name(name: str, allowed=tuple(DTYPES), *, also: tuple[str, ...] = ()) -> str:
    """'bf16' or 'bfloat16' -> 'bfloat16'. ValueError naming every accepted spelling (`also`: other
    words the caller accepts before asking, e.g. 'auto') unless `name` is one of `allowed`."""
    canonical = SHORT_NAMES.get(name, name) if isinstance(name, str) else None
    if canonical not in allowed:
        raise ValueError(f"dtype {name!r} not supported: choose one of {', '.join([*also, *spellings(allowed)])}")
    return canonical


def torch_dtype(name: str, allowed=tuple(DTYPES)) -> torch.dtype:
    return DTYPES[dtype_name(name, allowed)]
