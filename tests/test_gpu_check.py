"""eval/gpu_check.py, the prepared GPU check, in its CPU mode: the same code at tiny shapes, so it cannot rot between
the rare sessions that have a GPU. Also what it must say without a GPU, what an out-of-memory setting becomes, and the
FLOP count it reports MFU from."""

import json

import pytest
import torch
from conftest import load_script  # tests/ is on sys.path under pytest

from drafters.registry import FAMILIES
from drafters.training import scale

gpu_check = load_script("eval/gpu_check.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    assert gpu_check.main(["--cpu", "--out", str(out)]) == 0
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_cpu_mode_checks_every_family(report):
    rows = {r["family"]: r for r in report["correctness"]}
    assert sorted(rows) == sorted(FAMILIES)
    for family, row in rows.items():
        assert row["passed"] and row["resume_bitwise"] and row["resume_max_abs_diff"] == 0.0, family
        assert row["fp32_identical"] == row["decodes"] == 2 * len(gpu_check.TREES), family


@pytest.mark.slow
def test_cpu_mode_measures_training_steps_and_the_verify_cost(report):
    rows = {r["setting"]: r for r in report["training"]}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values())
    ttt7, ttt3 = (rows[f"eagle3 T=64 ttt_steps={k} V=512"] for k in (7, 3))
    # the counted FLOPs follow the unroll: 7 TTT steps run more drafter matmuls than 3, the target's are equal
    assert ttt7["flops_per_token"]["drafter forward+backward"] > ttt3["flops_per_token"]["drafter forward+backward"]
    assert ttt7["flops_per_token"]["target forward"] == ttt3["flops_per_token"]["target forward"]
    # the target forward of a Llama without its head: 2 x the decoder layers' weights per token (the tiny shape's
    # attention runs in the CPU's fused kernel, which torch's counter does not count)
    shape = scale.SHAPES["tiny"]
    h, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    assert ttt7["flops_per_token"]["target forward"] == 2 * L * (2 * h * h + 2 * h * kv + 3 * h * f)
    assert report["limits"][-1]["setting"].endswith("V=1024")  # Qwen's vocabulary row, at the tiny scale
    verify = report["verify"]
    assert sorted(map(int, verify["ms"])) == list(gpu_check.CPU_SCALE["verify"])
    assert verify["relative"]["1"] == 1.0
    assert all("chain" in p["what"] or "tree" in p["what"] for p in verify["projected"])


def test_without_a_gpu_the_check_says_so_and_exits_non_zero(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--cpu" in err and err.count("\n") == 1
    assert not (tmp_path / "gpu_check.json").exists()


def test_an_unknown_section_is_refused_before_anything_runs(tmp_path, capsys):
    assert gpu_check.main(["--cpu", "--sections", "training,speed", "--out", str(tmp_path)]) == 2
    assert "--sections: unknown ['speed']" in capsys.readouterr().err


def test_an_old_transformers_is_named_before_anything_runs(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(gpu_check.CheckError, match=r"transformers 5.17.0 is installed.*>=5.20"):
        gpu_check.check_environment(cpu=True)


def test_out_of_memory_is_a_row_naming_the_largest_live_tensor(monkeypatch):
    """A step that runs out of memory becomes a row with what it asked for and the largest tensors it held; the
    next setting still runs."""
    target = scale.random_target(scale.SHAPES["tiny"], dtype=torch.bfloat16, device="cpu")
    real_step = scale.one_step

    def step_that_runs_out(objective, inputs, optimizer, batch, embed, device):
        held = torch.zeros(1024, 3000)  # noqa: F841 (alive in this frame when the error is raised: 11.7 MiB)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB. GPU 0 has a total ...")

    setting = scale.StepSetting("eagle3", 32, ("ttt_steps=2",), draft_vocab=64)
    monkeypatch.setattr(scale, "one_step", step_that_runs_out)
    row = scale.measure_step(setting, target, steps=1, warmup=0)
    assert row.status == "out of memory" and row.tokens_per_s is None
    assert "in the training step: asked for 14.00 GiB more" in row.detail
    assert "largest live tensors: (1024, 3000) float32 0.01 GiB" in row.detail
    monkeypatch.setattr(scale, "one_step", real_step)
    assert scale.measure_step(setting, target, steps=1, warmup=0).status == "ok"


def test_attention_flops_count_grouped_query_heads_as_broadcast():
    # against torch's own formula on the equivalent multi-head shapes (k / v repeated to every query head)
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k = (2, 8, 5, 16), (2, 2, 7, 16)
    full = (2, 8, 7, 16)
    assert scale.sdpa_forward_flops(q, k, k) == sdpa_flop_count(q, full, full)
    assert scale.sdpa_backward_flops(q, q, k, k) == sdpa_backward_flop_count(q, q, full, full)


def test_a_setting_predicted_to_outlast_the_budget_is_not_run():
    ref = scale.StepResult("eagle3 T=2048", "t", ms={"step": 200.0}, flops_per_token={"step": 1e10},
                           attention_flops=0.25 * 1e10 * 2048)
    # a quarter of the work grows as T^2: 16x the length costs 0.75 * 16 + 0.25 * 256 = 76x
    assert scale.predicted_seconds(ref, 32768, 2048) == pytest.approx(0.2 * 76)
    row = gpu_check.limit_row(scale.StepSetting("eagle3", 32768), [ref.__dict__], {"training": [
        scale.StepSetting("eagle3", 2048)], "budget_s": 10}, None, None, lambda *_: None)
    assert row["status"] == "not run" and row["predicted_s"] == pytest.approx(15.2)
