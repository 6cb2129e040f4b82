"""Two-process data-parallel training on CPU (gloo) equals one process with the same global batch.

torchrun starts 2 processes of train/eagle.py; one process with grad_accum=2 sees the same
micro-batches per optimizer step (accelerate deals the sampler's batches out round-robin), so the
weights, the logged loss curve and the token counts must agree up to float summation order.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_script  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["recipes/eagle3_tiny.yaml", "save_every=0", "eval_every=0", "threads=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    # the one-process baseline both launchers are compared with, trained once
    out = tmp_path_factory.mktemp("one")
    load_script("train/eagle.py").main([*COMMON, f"output_dir={out}", "grad_accum=2"])
    return out


def test_two_process_ddp_matches_one_process_with_the_same_global_batch(one, tmp_path):
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "train/eagle.py", *COMMON, f"output_dir={two}",
                           "grad_accum=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a = load_file(one / "checkpoint-final" / "model.safetensors")
    b = load_file(two / "checkpoint-final" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    ra, rb = rows(one), rows(two)
    assert [r["tokens"] for r in rb] == [r["tokens"] for r in ra]  # all processes' tokens counted
    assert [r["loss"] for r in rb] == pytest.approx([r["loss"] for r in ra], rel=1e-5)
    assert [a for r in rb for a in r["step_acc"]] == pytest.approx([a for r in ra for a in r["step_acc"]], abs=1e-6)


def test_two_process_deepspeed_zero2_on_cpu_matches_one_process(one, tmp_path):
    pytest.importorskip("deepspeed", reason="pip install -e .[test] installs deepspeed")
    two = tmp_path / "zero2"
    # the launch line of recipes/accelerate/zero2_cpu2.yaml, so the config file users copy is what runs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           "recipes/accelerate/zero2_cpu2.yaml", "--main_process_port", str(free_port()),
                           "train/eagle.py", *COMMON, f"output_dir={two}", "grad_accum=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es), DEEPSPEED" in done.stdout
    a = load_file(one / "checkpoint-final" / "model.safetensors")
    b = load_file(two / "checkpoint-final" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    assert [r["loss"] for r in rows(two)] == pytest.approx([r["loss"] for r in rows(one)], rel=1e-5)
