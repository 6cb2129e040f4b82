"""--tree auto (drafters.decode.autotree): the acceptance model, the choice on synthetic costs, and
eval/tau.py end to end on the tiny target. No timed assertions: where a test needs one outcome of
the choice it fixes the measured cost of plain generate by monkeypatching."""

import dataclasses
import json

import pytest
import torch

from conftest import load_script  # tests/ is on sys.path under pytest

from drafters.decode import autotree

TAU = load_script("eval/tau.py")  # the command line over evaluate.measure
from drafters.decode.autotree import Probe, RankCounts, Recorder, expected_tau, interpolate, predict
from drafters.decode.tree import Tree


def chain(k):  # parent list of a chain of k drafts
    return tuple(range(-1, k))


# ---------------------------------------------------------------- the acceptance model


def test_expected_tau_of_chains_and_trees():
    rates = [[0.5, 0.3], [0.5, 0.2]]
    assert expected_tau(rates, chain(2)) == pytest.approx(1 + 0.5 + 0.25)
    # root -> (rank 0, rank 1); rank 0 -> one child: siblings add, depths multiply
    assert expected_tau(rates, (-1, 0, 0, 1)) == pytest.approx(1 + 0.5 + 0.3 + 0.5 * 0.5)
    assert expected_tau(rates, chain(4)) == pytest.approx(1.75)  # depths never observed: never accepted
    assert expected_tau(rates, (-1,)) == 1.0  # a root-only round (no lookup match) still commits the bonus


def test_rank_counts_from_recorded_rounds():
    # root 10 -> [20 (rank 0), 21 (rank 1)]; 20 -> [30]
    tree = Tree(torch.tensor([10, 20, 21, 30]), torch.tensor([-1, 0, 0, 1]))

    class Fixed:
        needs = None

        def propose(self, context, pending, sampling):
            return tree

        def update(self, *args):
            pass

    counts = RankCounts()
    recorder = Recorder(Fixed(), counts)
    for committed in ([10, 21], [10, 20, 30], [10]):  # rank 1 at d1; rank 0 at d1 and d2; a miss at d1
        recorder.propose(torch.tensor([1, 2]), 10, None)
        recorder.update(torch.tensor(committed), None, 99)
    assert counts.rounds == 3
    assert counts.hits == [[1, 1], [1]] and counts.exposed == [[3, 3], [1]]
    rates = counts.rates()
    assert rates[0] == pytest.approx([1 / 4, 1 / 4]) and rates[1] == [0.5]  # hits / (exposed + 1)
    assert recorder.shapes == [(-1, 0, 0, 1)] * 3


def test_rates_of_one_depth_never_sum_past_one():
    counts = RankCounts(hits=[[5, 3]], exposed=[[9, 3]])  # 0.5, then 0.75 seen on fewer rounds
    assert counts.rates() == [[0.5, 0.5]]


def test_interpolate_is_linear_between_and_beyond_the_grid():
    grid = {1: 10.0, 4: 16.0, 8: 24.0}
    assert interpolate(grid, 1) == 10.0 and interpolate(grid, 8) == 24.0
    assert interpolate(grid, 2.5) == pytest.approx(13.0)
    assert interpolate(grid, 12) == pytest.approx(32.0)


# ---------------------------------------------------------------- the choice on synthetic costs

DYNAMIC_SHAPE = (-1, 0, 0, 1, 1, 3, 5)  # 6 drafts, depth 4: a top-2 split at depths 1 and 2


def probes(draft_ms_per_depth):
    out = [Probe(f"chain:{k}", draft_ms_per_depth * k, 0.1, [chain(k)] * 3) for k in range(1, 7)]
    return out + [Probe("dynamic:total=6,depth=4,topk=2", draft_ms_per_depth * 4, 0.1, [DYNAMIC_SHAPE])]


def flat_rates(top1, second=0.0, depths=6):
    return [[top1, second]] * depths


def test_cheap_drafter_and_high_acceptance_pick_a_deep_tree():
    # a GPU-like machine: verification barely grows with the node count, drafting is nearly free
    verify = {1: 10.0, 8: 10.5, 64: 12.0}
    rows = predict(probes(0.2), flat_rates(0.9, 0.05), verify, generate_ms_per_token=10.0)
    assert rows[0].spec == "chain:6"
    assert rows[0].tau == pytest.approx(1 + sum(0.9 ** d for d in range(1, 7)))
    assert [r.tokens_per_s for r in rows] == sorted((r.tokens_per_s for r in rows), reverse=True)


def test_second_ranks_make_the_tree_win_where_the_chain_stalls():
    verify = {1: 10.0, 8: 10.5, 64: 12.0}
    rows = predict(probes(0.2), [[0.5, 0.4]] * 6, verify, generate_ms_per_token=10.0)
    assert rows[0].spec.startswith("dynamic:")


def test_expensive_drafter_picks_a_short_chain():
    # a CPU-like machine: every node costs verification time and every depth a drafter step
    verify = {1: 11.0, 2: 12.0, 4: 14.0, 8: 18.0, 64: 74.0}
    rows = predict(probes(2.0), flat_rates(0.7), verify, generate_ms_per_token=10.0)
    assert rows[0].spec in ("chain:1", "chain:2", "chain:3")


def test_expensive_drafter_and_low_acceptance_pick_no_speculation():
    verify = {1: 11.0, 2: 12.0, 4: 14.0, 8: 18.0, 64: 74.0}
    rows = predict(probes(10.0), flat_rates(0.3), verify, generate_ms_per_token=10.0)
    assert rows[0].spec == autotree.NO_SPECULATION
    assert rows[0].tau == 1.0 and rows[0].tokens_per_s == pytest.approx(100.0)


def test_checkpoint_step_accuracy_is_read_when_recorded(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "drafter.json").write_text(json.dumps({"extra": {"eval": {"step_acc": [0.4, 0.2]}}}))
    assert autotree.checkpoint_rates(str(path)) == [[0.4], [0.2]]
    assert autotree.checkpoint_rates(str(path) + "+prompt-lookup") == [[0.4], [0.2]]
    (path / "drafter.json").write_text(json.dumps({"extra": {"eval": None}}))
    assert autotree.checkpoint_rates(str(path)) is None
    assert autotree.checkpoint_rates("prompt-lookup") is None


# ---------------------------------------------------------------- eval/tau.py --tree auto, tiny target

CANDIDATES = ["--auto-candidates", "chain:1", "chain:3", "dynamic:total=6,depth=3,topk=2"]


@pytest.fixture
def bench(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc abc abc abc", "hello hello")))
    return path


def run(bench, out, *extra):
    return TAU.main(["--target", "tiny-random-llama", "--proposer", "draft-model:tiny-random-llama",
                     "--bench", str(bench), "--max-new-tokens", "12", "--threads", "1", "--tree", "auto",
                     "--auto-probe-tokens", "8", "--json", str(out), *CANDIDATES, *extra])


def test_auto_runs_the_chosen_tree_greedy_identical(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(autotree, "time_generate", lambda *a, **k: 1e9)  # generate can never win
    report = run(bench, tmp_path / "out.json")
    auto = report["tree_auto"]
    assert report["tree"] == auto["chosen"] == auto["measured"] != autotree.NO_SPECULATION
    assert report["greedy_check"] == {"checked": 2, "mismatches": 0, "mismatched": []}
    specs = [c["spec"] for c in auto["candidates"]]
    assert sorted(specs) == sorted(CANDIDATES[1:] + [autotree.NO_SPECULATION])
    assert auto["acceptance_source"].startswith("calibration")
    # the target drafting for itself: every rank-0 draft is accepted (n of n, reported as n / (n + 1))
    rates = auto["acceptance_by_depth_and_rank"]
    assert rates[0][0] > 0.9 and all(row[0] >= 0.5 for row in rates[:3])
    chain3 = next(c for c in auto["candidates"] if c["spec"] == "chain:3")
    assert chain3["tau"] > 3.0
    assert set(auto["verify_ms_by_nodes"]) >= {1, 2, 4}
    assert json.loads((tmp_path / "out.json").read_text())["tree_auto"]["chosen"] == auto["chosen"]
    assert "<- chosen" in capsys.readouterr().out


def test_auto_says_plainly_when_generate_wins(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(autotree, "time_generate", lambda *a, **k: 1e-6)  # generate always wins
    report = run(bench, tmp_path / "out.json")
    assert report["speculated"] is False and report["tree_auto"]["chosen"] == autotree.NO_SPECULATION
    assert "NO SPECULATION is predicted fastest" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["speculated"] is False
    anyway = run(bench, tmp_path / "anyway.json", "--speculate-anyway")
    assert anyway["tree_auto"]["chosen"] == autotree.NO_SPECULATION
    assert anyway["tree"] == anyway["tree_auto"]["measured"] in CANDIDATES[1:]
    assert anyway["greedy_check"]["mismatches"] == 0


def test_checkpoint_acceptance_is_used_when_asked(bench, tmp_path, monkeypatch):
    from drafters.checkpoint import save_checkpoint, target_info
    from drafters.draft_vocab import build_draft_vocab
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from drafters.targets import load_target

    target = load_target("tiny-random-llama")
    vocab = build_draft_vocab(torch.ones(target.vocab_size), target.vocab_size, size=64)
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(target.config, draft_vocab_size=64), vocab)
    drafter.init_from_target(target.lm_head.weight, vocab)
    checkpoint = tmp_path / "eagle3"
    save_checkpoint(checkpoint, family="eagle3", config=dataclasses.asdict(drafter.config),
                    target=target_info(target), state_dict=drafter.state_dict(),
                    extra={"eval": {"step_acc": [0.5, 0.25, 0.1]}})
    monkeypatch.setattr(autotree, "time_generate", lambda *a, **k: 1e9)
    args = ["--proposer", str(checkpoint), "--auto-acceptance", "checkpoint"]
    report = TAU.main(["--target", "tiny-random-llama", "--bench", str(bench), "--max-new-tokens", "8",
                       "--threads", "1", "--tree", "auto", "--auto-probe-tokens", "6", *CANDIDATES, *args])
    auto = report["tree_auto"]
    assert auto["acceptance_source"].startswith("checkpoint")
    assert auto["acceptance_by_depth_and_rank"] == [[0.5], [0.25], [0.1]]
    chain3 = next(c for c in auto["candidates"] if c["spec"] == "chain:3")
    assert chain3["tau"] == pytest.approx(1 + 0.5 + 0.125 + 0.0125)
    assert report["greedy_check"]["mismatches"] == 0


@pytest.mark.parametrize("extra, message", [
    (["--adaptive"], "--adaptive needs a chain"),
    (["--auto-candidates", "chain:zero"], "bad tree spec 'chain:zero'"),
    (["--auto-probe-tokens", "0"], "--auto-probe-tokens must be >= 1, got 0"),  # was: every candidate skipped,
    (["--auto-prompts", "0"], "--auto-prompts must be >= 1, got 0"),  # then "NO SPECULATION"; was: all prompts
])
def test_bad_auto_options_fail_before_loading(bench, tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        TAU.main(["--target", "no-such-target", "--proposer", "prompt-lookup", "--bench", str(bench),
                  "--tree", "auto", *extra])


def test_no_prediction_when_no_candidate_could_run(bench, tmp_path):
    heads = tmp_path / "medusa"  # 3 heads: no tree deeper than 3
    load_script("train/heads.py").main(["recipes/medusa_tiny.yaml", f"output_dir={heads}", "max_steps=2",
                                        "save_every=0", "eval_every=0"])
    with pytest.raises(SystemExit, match=r"no candidate tree could be run with this proposer \(chain:5: .*chain:6: "):
        TAU.main(["--target", "tiny-random-llama", "--proposer", str(heads / "checkpoint-final"), "--bench",
                  str(bench), "--max-new-tokens", "8", "--threads", "1", "--tree", "auto", "--auto-candidates",
                  "chain:5", "chain:6", "--speculate-anyway", "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_checkpoint_acceptance_without_a_record_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit, match="records no held-out per-step accuracy"):
        TAU.main(["--target", "tiny-random-llama", "--proposer", "prompt-lookup", "--bench", str(bench),
                  "--tree", "auto", "--auto-acceptance", "checkpoint", "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_heads_drafter_skips_trees_deeper_than_its_heads(bench, tmp_path, monkeypatch):
    # a 3-head Medusa drafter cannot draft depth 4: the calibration tree is made shallower and the
    # deeper candidates are skipped, with the reason in the table
    from dataclasses import asdict

    from drafters.checkpoint import save_checkpoint, target_info
    from drafters.medusa import MedusaConfig, MedusaHeads
    from drafters.targets import load_target

    target = load_target("tiny-random-llama")
    config = MedusaConfig.from_target_config(target.config, num_heads=3, num_layers=1, share_lm_head=False)
    save_checkpoint(tmp_path / "medusa", family="medusa", config=asdict(config), target=target_info(target),
                    state_dict=MedusaHeads(config).state_dict())
    monkeypatch.setattr(autotree, "time_generate", lambda *a, **k: 1e9)
    report = TAU.main(["--target", "tiny-random-llama", "--proposer", str(tmp_path / "medusa"), "--bench", str(bench),
                       "--max-new-tokens", "8", "--threads", "1", "--tree", "auto", "--auto-probe-tokens", "6",
                       "--auto-candidates", "chain:2", "chain:4", "dynamic:total=6,depth=3,topk=2"])
    auto = report["tree_auto"]
    assert auto["calibration"]["tree"] == "dynamic:total=60,depth=3,topk=10"
    assert list(auto["skipped_candidates"]) == ["chain:4"]
    assert report["tree"] in ("chain:2", "dynamic:total=6,depth=3,topk=2")
    assert report["greedy_check"]["mismatches"] == 0
