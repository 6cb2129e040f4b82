"""What a llama.cpp round costs, without llama.cpp: the step-cost arithmetic over llama.cpp's own counters, the
break-even tau, and the serving options of eval/llama_cpp.py refused before anything loads. The same code against
a running llama-server is in tests/test_llama_cpp.py (the engine-bench test)."""

import pytest

from drafters.decode.engine_bench import PLAIN, Mode, ModeResult, break_even_tau, step_cost_ms
from drafters.engines.llama_cpp import Completion


def result(name, ms_per_token: list[float], drafted: int = 0, tokens: int = 10) -> ModeResult:
    """One completion per repeat, `tokens` tokens decoded in tokens * ms_per_token[r] ms."""
    r = ModeResult(Mode(name))
    for ms in ms_per_token:
        r.runs.append([Completion(tokens=list(range(tokens)), predicted_ms=ms * tokens, draft_n=drafted,
                                  draft_accepted=0)])
    return r


def test_step_cost_is_the_probe_minus_plain_within_each_repeat():
    # repeat 2 runs on a machine 1.5x slower for both modes: the difference is taken inside each repeat
    results = {PLAIN: result(PLAIN, [20.0, 30.0, 21.0]), "probe": result("probe", [23.0, 34.5, 24.5])}
    cost = step_cost_ms(results, "probe")
    assert cost["step_ms_runs"] == pytest.approx([3.0, 4.5, 3.5])
    assert cost["step_ms"] == pytest.approx(3.5)  # the median, not the mean (3.67)
    assert cost["plain_ms_per_token"] == pytest.approx(21.0)


def test_a_probe_that_drafted_is_refused():
    results = {PLAIN: result(PLAIN, [20.0]), "probe": result("probe", [23.0], drafted=4)}
    with pytest.raises(ValueError, match="drafted 4 tokens"):
        step_cost_ms(results, "probe")


def test_break_even_tau():
    # a target that gains nothing from batching (n tokens cost n single steps) and a free drafter:
    # a chain of n breaks even only if every draft is accepted, tau = n + 1
    serial = {n: 10.0 * n for n in range(1, 9)}
    assert [break_even_tau(serial, 10.0, n) for n in range(1, 8)] == pytest.approx([2, 3, 4, 5, 6, 7, 8])
    # a free batch (every forward costs one step): only the drafter's n steps must be paid back
    flat = {n: 10.0 for n in range(1, 9)}
    assert break_even_tau(flat, 10.0, 3, step_ms=2.0) == pytest.approx(1.6)
    assert break_even_tau(flat, 10.0, 1) == pytest.approx(1.0)


@pytest.mark.parametrize("argv, message", [
    (["--p-min", "0,1.5"], "--p-min '0,1.5': give one or more probabilities in [0, 1]"),
    (["--p-min", "x"], "--p-min 'x'"),
    (["--export-dtype", "f32,q4_0"], "--export-dtype 'f32,q4_0': give one or more of f32, f16, q8_0"),
    (["--drafter", "some/dir@0"], "after @ give draft lengths >= 1"),
    (["--drafter", "some/dir@2,x"], "after @ give draft lengths >= 1"),
    (["--offset", "-1"], "the offset must be >= 0"),
    (["--limit", "0"], "the limit >= 1"),
    (["--step-cost"], "give at least one --drafter"),
    (["--drafter", "some/dir@1", "--drafter", "some/dir/@3"], "a --drafter is given twice"),
    (["--ngram", "ngram-nope"], "--ngram 'ngram-nope': choose from"),
])
def test_bad_serving_options_get_one_sentence_before_anything_loads(argv, message, capsys, monkeypatch):
    from conftest import load_script

    script = load_script("eval/llama_cpp.py")
    monkeypatch.setattr(script, "load_target", lambda *a, **k: pytest.fail("loaded a target before checking"))
    assert script.main(["--target", "tiny-random-llama", "--weights", "f32", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
