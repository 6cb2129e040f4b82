"""eval/memory_bench.py: bad axes are refused in a sentence before any child starts, and the dense sizes it prints
for scale are the tensors' (its measurements are runs of drafters.training.scale.measure_step, tested there)."""

import pytest

from conftest import load_script  # tests/ is on sys.path under pytest

bench = load_script("eval/memory_bench.py")


@pytest.mark.parametrize("argv, message", [
    (["--families", "medusa"], "--families: ['medusa'] are not families this bench steps"),
    (["--seq", "2k"], "--seq, --vocab and --ttt take comma-separated integers"),
    (["--vocab-memory", "table,lazy"], "--vocab-memory table,lazy: use table, recompute or both"),
])
def test_bad_axes_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        bench.main(argv)


def test_the_dense_sizes_are_the_tensors_a_dense_step_would_hold():
    # (T, V) float32 logits: 8192 x 128000 x 4 B = 3.91 GiB; EAGLE-3's (T, kT) float32 mask at k = 7: 1.75 GiB
    assert bench.dense_gb({"family": "eagle3", "seq": 8192, "vocab": 128000, "ttt": 7}) == "3.91 / 1.75"
    assert bench.dense_gb({"family": "dflash", "seq": 8192, "vocab": 128000, "ttt": 7}) == "3.91 / -"


def test_the_estimate_alone_is_the_one_printed_beside_the_measured_step():
    # --estimate-only builds the drafter and estimates without running the step; the measured run (a child
    # process per setting) prints the same estimate next to its peak
    argv = ["--families", "eagle3,dflash", "--seq", "64", "--vocab", "512", "--ttt", "2", "--hidden", "32"]
    estimated, measured = bench.main([*argv, "--estimate-only"]), bench.main(argv)
    assert [r["status"] for r in measured] == ["ok", "ok"]
    for alone, beside in zip(estimated, measured):
        assert alone["estimate_gb"] > 0 and alone["estimate_gb"] == beside["estimate_gb"]
