"""The frozen target split across processes (split_target=true, drafters.training.launch.split_target): its decoder
layers sharded with FSDP2 over 2 CPU processes (gloo). The features are one process's bit for bit, each process holds
half of the layers, a training run with it equals one process, and what it cannot run under is refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.checkpoint import target_info
from drafters.targets import load_target
from drafters.training.recipe import RecipeError
from test_distributed import CONFIGS, free_port, launch, on_two_cpus, one, rows, weights  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from split_features import LAYERS, fixed_ids  # noqa: E402


def split_features(tmp_path: Path, target: str) -> tuple[dict, dict]:
    out = tmp_path / "split"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "tests/helpers/split_features.py", str(out), target],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(f"{out}.safetensors"), json.loads(Path(f"{out}.json").read_text())


def assert_features_equal(split: dict, target) -> None:
    ids, mask = fixed_ids()
    first = target.features(ids, mask, layers=LAYERS, pre_norm_last=True, logits=True)
    second = target.features(ids[:, :9], mask[:, :9], layers=LAYERS, logits=True)
    for i in LAYERS:
        assert torch.equal(split[f"hidden_{i}"], first.hidden_states[i]), i
    assert torch.equal(split["last"], first.last_hidden) and torch.equal(split["pre_norm"], first.pre_norm_last)
    assert torch.equal(split["logits"], first.logits) and torch.equal(split["second_logits"], second.logits)


def test_two_processes_compute_one_processs_features_holding_half_the_layers(tmp_path):
    split, info = split_features(tmp_path, "tiny-random-llama")
    target = load_target("tiny-random-llama")
    assert_features_equal(split, target)
    layers = sum(p.numel() for p in target.decoder_layers.parameters())
    outer = info["whole"] - layers  # embeddings (tied head) and final norm: whole on every process
    assert info["whole"] == sum(p.numel() for p in target.model.parameters()) and not info["read_by_shards"]
    assert info["held"] == [outer + layers // 2] * 2  # every tensor of these layers has an even first dimension
    assert info["fingerprint"] == target_info(target)["weights_fingerprint"]  # the layers' samples kept before


def test_a_model_directory_is_read_shard_by_shard_into_the_same_features(tmp_path):
    # odd widths: torch.chunk gives process 0 one row more of the (129, 64) MLP matrices than process 1
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafters.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=129, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    split, info = split_features(tmp_path, str(tmp_path / "target"))
    target = load_target(str(tmp_path / "target"))
    assert_features_equal(split, target)
    assert info["read_by_shards"]
    up = 129 * 64 * 2 * 8  # gate_proj and up_proj of 8 layers: 65 rows on process 0, 64 on process 1
    assert info["held"][0] - info["held"][1] == up // 129
    outer = info["whole"] - sum(p.numel() for p in target.decoder_layers.parameters())
    assert sum(info["held"]) == info["whole"] + outer  # the layers once between the two, the outer parts twice
    assert info["fingerprint"] == target_info(target)["weights_fingerprint"]  # the layers' samples read from files


def test_a_run_with_the_target_split_trains_as_one_process(one, tmp_path):  # noqa: F811  (the fixture)
    config = on_two_cpus(yaml.safe_load((CONFIGS / "ddp_8gpu.yaml").read_text()))
    run = tmp_path / "run"
    done = launch(config, tmp_path, f"output_dir={run}", "grad_accum=1", "split_target=true", "eval_every=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target: decoder layers split across 2 processes: each holds" in done.stdout
    a, b = weights(one), weights(run)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    assert [r["loss"] for r in rows(run)] == pytest.approx([r["loss"] for r in rows(one)], rel=1e-5)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals][:1] == [3] and all(e["tau_pred"] >= 1 for e in evals)


def test_what_a_split_target_cannot_run_under_is_refused(tmp_path):
    eagle = load_script("train/eagle.py")
    common = ["recipes/eagle3_tiny.yaml", "max_steps=1", "split_target=true"]
    with pytest.raises(RecipeError, match="this launch has one: start several"):
        eagle.main([*common, f"output_dir={tmp_path / 'one'}"])
    with pytest.raises(RecipeError, match="a run from a feature store loads none of the target's decoder layers"):
        eagle.main([*common, f"output_dir={tmp_path / 'store'}", f"features.dir={tmp_path / 'store-dir'}"])
    with pytest.raises(RecipeError, match=r"^\S+eagle3_tiny.yaml: split_target=true is for online training"):
        load_script("train/features.py").main([*common, f"features.dir={tmp_path / 'features'}"])
