"""Every shipped accelerate configuration trains on 2 CPU processes (gloo) with only its device fields swapped, and
equals one process with the same global batch; resuming from a mid-run checkpoint equals the uninterrupted run;
the exported drafter reloads.

One process with grad_accum=2 sees the same micro-batches per optimizer step as two processes with grad_accum=1
(accelerate deals the sampler's batches out round-robin), so weights, the logged loss curve and the token
counts must agree up to float summation order: the gradients of two micro-batches are summed in another order
(all-reduce or reduce-scatter instead of accumulation), ~1 ulp per step on a 6-step run. Resume is bitwise: the
resumed run restores the same shards, optimizer state, RNG and data position.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.training.launch import SHIPPED, on_cpus

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = SHIPPED
COMMON = ["recipes/eagle3_tiny.yaml", "eval_every=0", "threads=1"]
# engine -> (shipped configuration, what the trainer prints for it); the MULTI_GPU file runs as gloo DDP on CPUs
ENGINES = {"ddp": ("ddp_8gpu.yaml", "MULTI_CPU"), "zero2": ("zero2_8gpu.yaml", "DEEPSPEED"),
           "zero3": ("zero3_8gpu.yaml", "DEEPSPEED"), "fsdp2": ("fsdp_8gpu.yaml", "FSDP")}


def on_two_cpus(config: dict) -> dict:
    return on_cpus(config, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: dict, tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    path = tmp_path / f"accelerate-{os.getpid()}-{len(list(tmp_path.glob('accelerate-*')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path),
                           "--main_process_port", str(free_port()), "train/eagle.py", *COMMON, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir, checkpoint="checkpoint-final"):
    return load_file(run_dir / checkpoint / "model.safetensors")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    # the one-process baseline every engine is compared with, trained once
    out = tmp_path_factory.mktemp("one")
    load_script("train/eagle.py").main([*COMMON, f"output_dir={out}", "grad_accum=2", "save_every=0"])
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_each_shipped_engine_on_two_processes_equals_one_resumes_and_exports(engine, one, tmp_path):
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed", reason="pip install -e .[test] installs deepspeed")
    name, printed = ENGINES[engine]
    config = on_two_cpus(yaml.safe_load((CONFIGS / name).read_text()))
    run = tmp_path / "run"
    done = launch(config, tmp_path, f"output_dir={run}", "grad_accum=1", "save_every=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"2 process(es), {printed}" in done.stdout
    a, b = weights(one), weights(run)
    assert a.keys() == b.keys() and all(b[k].shape == a[k].shape for k in a)  # whole tensors, not shards
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    ra, rb = rows(one), rows(run)
    assert [r["tokens"] for r in rb] == [r["tokens"] for r in ra]  # all processes' tokens counted
    assert [r["loss"] for r in rb] == pytest.approx([r["loss"] for r in ra], rel=1e-5)
    assert len(rb[-1]["peak_rss_gb_per_process"]) == 2 and min(rb[-1]["peak_rss_gb_per_process"]) > 0

    # resume from the middle into a new directory: bitwise the uninterrupted run's weights
    resumed = tmp_path / "resumed"
    done = launch(config, tmp_path, f"output_dir={resumed}", "grad_accum=1", "save_every=0",
                  f"resume_from={run / 'checkpoint-2'}", "trust_checkpoint=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    c = weights(resumed)
    for key in b:
        assert torch.equal(c[key], b[key]), key

    # the checkpoint exports and the export reads back as the same drafter
    from drafters.checkpoint import load_checkpoint
    from drafters.export.eagle3_reader import check_export
    from drafters.export.dispatch import export_checkpoint

    out = export_checkpoint(run / "checkpoint-final", "vllm", tmp_path / "export").path
    assert check_export(out, "vllm", reference=load_checkpoint(run / "checkpoint-final")).max_logit_diff <= 1e-5


def test_the_cpu_zero2_file_is_the_shipped_one_with_its_device_fields_swapped():
    shipped = on_two_cpus(yaml.safe_load((CONFIGS / "zero2_8gpu.yaml").read_text()))
    assert yaml.safe_load((CONFIGS / "zero2_cpu2.yaml").read_text()) == shipped


def test_every_shipped_configuration_is_run_here():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted([*(n for n, _ in ENGINES.values()),
                                                                      "zero2_cpu2.yaml"])


@pytest.mark.parametrize("env, recipe, message", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, [], "set fsdp_version: 2 in its fsdp_config"),
    ({"ACCELERATE_USE_FSDP": "true"}, [], "set fsdp_version: 2"),  # v1 is accelerate's default
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, ["mixed_precision=no"],
     'set mixed_precision: "no" in the accelerate config, or the recipe\'s mixed_precision=bf16'),
])
def test_a_launch_this_machine_cannot_run_gets_one_sentence(env, recipe, message, monkeypatch):
    # what `accelerate launch` passes every process from the config file, checked before the Accelerator starts
    from drafters.training.launch import check_launch_config
    from drafters.training.families import load_recipe
    from drafters.training.recipe import RecipeError

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_launch_config(load_recipe([str(ROOT / "recipes/eagle3_tiny.yaml"), *recipe]), gpu=False)
    for key in env:
        monkeypatch.delenv(key)
    check_launch_config(load_recipe([str(ROOT / "recipes/eagle3_tiny.yaml"), *recipe]), gpu=False)  # clean


def test_a_recipes_auto_precision_takes_a_plain_launchs_no(monkeypatch):
    # `accelerate launch train/eagle.py recipes/eagle3_smollm2.yaml` without a config file passes mixed_precision
    # "no"; the recipe's auto (bf16 on a CPU with avx512_bf16) takes it instead of refusing the documented command
    from drafters.training.families import load_recipe
    from drafters.training.launch import launch_precision
    from drafters.training.recipe import RecipeError

    recipe = load_recipe([str(ROOT / "recipes/eagle3_tiny.yaml"), "mixed_precision=auto"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert launch_precision(recipe) == "no"
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert launch_precision(recipe) in ("bf16", "no")  # no launch: the machine decides
    # an explicit recipe value against the launch is still refused in one sentence
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    with pytest.raises(RecipeError, match="the accelerate config asks mixed_precision: no"):
        launch_precision(load_recipe([str(ROOT / "recipes/eagle3_tiny.yaml"), "mixed_precision=bf16"]))


def test_the_frozen_target_loads_as_the_recipe_says_under_a_zero3_launch(tmp_path):
    # accelerate registers a ZeRO-3 config with transformers; from_pretrained would then build the target under
    # deepspeed.zero.Init (partitioned, in the engine's dtype). The trainer loads it outside that.
    pytest.importorskip("deepspeed", reason="pip install -e .[test] installs deepspeed")
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from drafters.targets import load_target
    from drafters.training.launch import outside_zero3

    load_target("tiny-random-llama").model.save_pretrained(tmp_path / "target")
    load_target("tiny-random-llama").tokenizer.save_pretrained(tmp_path / "target")
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    with outside_zero3():
        assert not is_deepspeed_zero3_enabled()
        target = load_target(str(tmp_path / "target"), dtype="bfloat16")
    assert is_deepspeed_zero3_enabled()  # restored for the engine
    assert all(p.dtype == torch.bfloat16 and p.numel() > 0 and not hasattr(p, "ds_id")
               for p in target.model.parameters())
    del config
