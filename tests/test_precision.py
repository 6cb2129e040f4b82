"""dtype / mixed_precision `auto`: bf16 only where the hardware computes it (drafters.targets.resolve_precision)."""

from pathlib import Path

import pytest
import torch

from drafters import targets
from drafters.targets import bf16_is_native, load_target, resolve_precision


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU flags from Linux's /proc/cpuinfo")
def test_the_cpu_probe_agrees_with_the_cpu_flags():
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert bf16_is_native("cpu") == bool({"avx512_bf16", "amx_bf16"} & flags)


@pytest.mark.parametrize("native, expected", [(True, ("bfloat16", "bf16")), (False, ("float32", "no"))])
def test_auto_picks_bf16_only_where_it_is_native(monkeypatch, native, expected):
    monkeypatch.setattr(targets, "bf16_is_native", lambda device=None: native)
    dtype, mixed, line = resolve_precision("auto", "auto", "cpu")
    assert (dtype, mixed) == expected and "warning" not in line
    assert line.startswith(f"precision: target {expected[0]}, drafter autocast {expected[1]}")


def test_explicit_bf16_without_native_support_is_kept_but_warned(monkeypatch):
    monkeypatch.setattr(targets, "bf16_is_native", lambda device=None: False)
    dtype, mixed, line = resolve_precision("bfloat16", "bf16", "cpu")
    assert (dtype, mixed) == ("bfloat16", "bf16")
    assert "about 50x slower than float32: use dtype=auto mixed_precision=auto" in line
    assert resolve_precision("float32", "no", "cpu")[:2] == ("float32", "no")  # explicit choices stand


def test_load_target_resolves_auto():
    expected = torch.bfloat16 if bf16_is_native() else torch.float32
    assert load_target("tiny-random-llama", dtype="auto").dtype == expected
    with pytest.raises(targets.TargetError, match="choose one of auto, float32, bfloat16, float16, fp32, bf16, fp16"):
        load_target("tiny-random-llama", dtype="fp8")
    assert load_target("tiny-random-llama", dtype="bf16").dtype == torch.bfloat16  # drafters.dtypes spellings
