"""eval/equal_time.py: the steps a run gets from its probe (seconds per step after the first two), the runs it
reads back instead of retraining, and its refusals. The training itself is train/eagle.py's (tested elsewhere)."""

import json

import pytest
from conftest import ROOT, load_script

equal_time = load_script("eval/equal_time.py")


def test_seconds_per_step_skips_the_first_step():
    rows = [{"step": 1, "elapsed_s": 9.0}, {"step": 2, "elapsed_s": 10.0}, {"step": 6, "elapsed_s": 12.0}]
    assert equal_time.seconds_per_step(rows) == 0.5  # (12 - 10) / (6 - 2): start-up and warm-up excluded


@pytest.mark.parametrize("argv, message", [
    (["--budget-s", "0", "--out", "o", "--run", "a r.yaml"], "--budget-s must be > 0"),
    (["--budget-s", "10", "--out", "o", "--run", "only-a-name"], "NAME RECIPE"),
    (["--budget-s", "10", "--out", "o", "--run", "a r.yaml", "--run", "a s.yaml"], "distinct NAME"),
])
def test_bad_runs_are_refused_in_one_sentence(argv, message, capsys):
    with pytest.raises(SystemExit):
        equal_time.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_finished_run_is_read_back_not_retrained(tmp_path, monkeypatch):
    # the tiny recipe trained once by the script, then the same command again: nothing new is trained
    out = tmp_path / "side"
    argv = ["--budget-s", "2", "--probe-steps", "4", "--out", str(out),
            "--run", f"tiny {ROOT / 'recipes' / 'eagle3_tiny.yaml'} threads=1"]
    first = equal_time.main(argv)
    assert first[0]["steps"] == first[0]["planned_steps"] >= 1
    assert first[0]["tau_pred"] == json.loads((out / "tiny" / "eval.jsonl").read_text().splitlines()[-1])["tau_pred"]
    monkeypatch.setattr(equal_time, "train", lambda *a: pytest.fail("retrained a finished run"))
    assert equal_time.main(argv) == first
