"""eval/tau.py end to end on a tiny target, in-process; bad inputs fail clearly and write no JSON."""

import dataclasses
import json

import pytest
import torch

from drafters.decode.benches import BenchItem
from drafters.decode.decoder import RoundStats
from drafters.decode.sampling import SamplingConfig

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.decode import evaluate

TAU = load_script("eval/tau.py")  # the command line over evaluate.measure

FIELDS = {"target", "proposer", "bench", "tree", "tree_budget", "sampling", "max_new_tokens",
          "num_prompts", "skipped", "rounds", "tau", "per_depth_acceptance", "baseline",
          "speculative", "speedup", "time_per_round_ms", "model", "greedy_check", "per_prompt"}


@pytest.fixture
def bench(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "abc abc abc abc"},
            {"conversations": [{"role": "user", "content": "hello hello"},
                               {"role": "assistant", "content": "hi"},
                               {"role": "user", "content": "and again, hello"}]},
            {"prompt": "never reached with --limit 2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(bench, out, *extra):
    return TAU.main(["--target", "tiny-random-llama", "--bench", str(bench), "--limit", "2",
                     "--max-new-tokens", "16", "--threads", "1", "--json", str(out), *extra])


def test_prompt_lookup_end_to_end_writes_the_documented_json(bench, tmp_path, capsys):
    out = tmp_path / "out.json"
    report = run(bench, out, "--proposer", "prompt-lookup", "--tree", "chain:4")
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(report))
    assert FIELDS <= written.keys()
    assert written["num_prompts"] == 3  # item 1 + both user turns of item 2
    assert [p["turn"] for p in written["per_prompt"]] == [1, 1, 2]
    assert written["greedy_check"] == {"checked": 3, "mismatches": 0, "mismatched": []}
    assert written["tree_budget"] == {"draft_nodes_excl_root": 4, "nodes_incl_root": 5}
    assert written["baseline"]["tokens"] == written["speculative"]["tokens"] > 0
    assert written["rounds"] == sum(p["rounds"] for p in written["per_prompt"])
    assert 1 <= written["tau"] <= 5
    groups = written["by_answer_position"]  # 16 new tokens: every round starts in the first 32 of its answer
    assert [(g["start"], g["rounds"]) for g in groups] == [(0, written["rounds"])]
    assert groups[0]["tau"] == pytest.approx(written["tau"])
    assert groups[0]["per_depth_acceptance"] == pytest.approx(written["per_depth_acceptance"])
    assert 0 <= written["model"]["a_from_tau"] <= 1
    assert written["draft_vocab"] is None  # prompt lookup drafts any id
    assert "tau (accepted + bonus)" in capsys.readouterr().out
    assert not list(tmp_path.glob(".out.json.*"))  # no temp file left


def test_draft_model_tree_and_adaptive_chain(bench, tmp_path):
    tree = run(bench, tmp_path / "tree.json", "--proposer", "draft-model:tiny-random-llama",
               "--tree", "dynamic:total=8,depth=3,topk=2")
    assert tree["greedy_check"]["mismatches"] == 0
    assert tree["tau"] > 1.5  # the target drafting for itself
    adaptive = run(bench, tmp_path / "adaptive.json", "--proposer", "draft-model:tiny-random-llama",
                   "--tree", "chain:2", "--adaptive")
    assert adaptive["greedy_check"]["mismatches"] == 0
    assert max(p["tau"] for p in adaptive["per_prompt"]) > 3  # grew past the initial 2 + 1


def test_formula_helpers():
    assert evaluate.acceptance_from_tau(1.0, 4) == 0.0
    assert evaluate.acceptance_from_tau(5.0, 4) == 1.0
    a = evaluate.acceptance_from_tau(1 + 0.5 + 0.25 + 0.125, 3)
    assert abs(a - 0.5) < 1e-9
    assert abs(evaluate.expected_speedup(0.5, 3, 0.0) - 1.875) < 1e-9
    assert abs(evaluate.expected_speedup(1.0, 3, 1 / 3) - 2.0) < 1e-9


def test_chain_tau_is_one_plus_the_sum_of_prefix_products():
    # drafters.acceptance: the tau_pred of every held-out evaluation and the closed form tau.py models with
    from drafters.acceptance import chain_tau, geometric_chain_tau

    assert chain_tau([]) == 1
    assert chain_tau([0.5, 0.4, 1.0]) == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 1.0)
    assert chain_tau([0.0, 1.0]) == 1  # nothing after a rejected draft counts
    assert geometric_chain_tau(0.5, 3) == pytest.approx(chain_tau([0.5] * 3))
    assert geometric_chain_tau(1.0, 2.5) == 3.5 and geometric_chain_tau(0.0, 4) == 1


@pytest.mark.parametrize("extra, message", [
    (["--bench", "no-such-bench"], "unknown bench 'no-such-bench'"),
    (["--proposer", "medusa-ish"], "unknown proposer 'medusa-ish'"),
    (["--tree", "chain:zero"], "bad tree spec 'chain:zero'"),
    (["--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--tree", "dynamic:total=8,depth=3,topk=2", "--adaptive"], "--adaptive needs a chain"),
    (["--target", "no-such-target"], "unknown target 'no-such-target'"),
    (["--proposer", "draft-model:"], "draft-model needs a model"),
    (["--tree", "chain:1100"], "--tree chain:1100 drafts 1100 tokens deep"),
    # --tree auto skipped that check, then built and timed chain:2000 for minutes (issue 38, fault 8)
    (["--tree", "auto", "--auto-candidates", "chain:2", "chain:2000"],
     "--auto-candidates chain:2000 drafts 2000 tokens deep: with --max-new-tokens 4 that needs 2004 positions"),
])
def test_bad_inputs_fail_clearly_and_leave_no_json(bench, tmp_path, extra, message):
    out = tmp_path / "out.json"
    args = ["--target", "tiny-random-llama", "--proposer", "prompt-lookup", "--bench", str(bench),
            "--max-new-tokens", "4", "--json", str(out)]
    with pytest.raises(SystemExit) as error:
        TAU.main(args + extra)
    assert message.replace("'", "") in str(error.value).replace("'", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]  # no JSON, no temp file


def test_checkpoint_for_another_target_is_refused(bench, tmp_path):
    checkpoint = tmp_path / "drafter"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 576, "vocab_size": 49152}))
    with pytest.raises(SystemExit, match="hidden_size: checkpoint 576 vs target 64"):
        run(bench, tmp_path / "out.json", "--proposer", str(checkpoint))
    assert not (tmp_path / "out.json").exists()


def test_prompts_longer_than_the_context_are_counted_skips(tmp_path):
    bench = tmp_path / "long.jsonl"
    bench.write_text(json.dumps({"prompt": "x" * 1100}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    report = TAU.main(["--target", "tiny-random-llama", "--proposer", "prompt-lookup", "--bench",
                       str(bench), "--max-new-tokens", "8", "--json", str(tmp_path / "out.json")])
    assert report["num_prompts"] == 1
    assert report["skipped"][0]["id"] == "1" and report["skipped"][0]["context"] == 1024
    bench.write_text(json.dumps({"prompt": "x" * 1100}) + "\n")
    with pytest.raises(SystemExit, match="every prompt was skipped"):
        TAU.main(["--target", "tiny-random-llama", "--proposer", "prompt-lookup", "--bench",
                  str(bench), "--json", str(tmp_path / "none.json")])
    assert not (tmp_path / "none.json").exists()


def test_a_tree_too_deep_for_the_context_is_named_not_the_prompts(bench, tmp_path):
    # chain:1000 with 30-token prompts used to be "every prompt was skipped (longer than the context)"
    with pytest.raises(SystemExit, match=r"--tree chain:1020 drafts 1020 tokens deep: with --max-new-tokens 16 that "
                                         r"needs 1036 positions beyond the prompt, and tiny-random-llama has 1024; use "
                                         "a shallower tree"):
        run(bench, tmp_path / "deep.json", "--proposer", "prompt-lookup", "--tree", "chain:1020")
    with pytest.raises(SystemExit, match=r"every prompt was skipped: prompt \+ --max-new-tokens 16 \+ tree depth 1000 "
                                         r"exceed the context of tiny-random-llama \(1024 positions; the first prompt "
                                         r"needed \d+\).*or a shallower tree"):
        run(bench, tmp_path / "deep.json", "--proposer", "prompt-lookup", "--tree", "chain:1000")
    assert not (tmp_path / "deep.json").exists()


def test_a_greedy_mismatch_is_recorded_and_loud(capsys):
    run = evaluate.Run()
    prompt, base, spec = torch.tensor([1, 2]), torch.tensor([1, 2, 5, 6, 7]), torch.tensor([1, 2, 5, 9, 7])
    item = BenchItem("q1", "c", ("t",))
    evaluate.record(run, item, 0, prompt, base, 1.0, spec, RoundStats(), 1.0, SamplingConfig())
    assert run.mismatches == [{"id": "q1", "turn": 1, "first_difference": 1}]
    assert "MISMATCH" in capsys.readouterr().err


def test_the_draft_vocabulary_counts_answer_tokens_only():
    run = evaluate.Run()
    prompt, spec = torch.tensor([1, 2]), torch.tensor([1, 2, 5, 6, 7])
    evaluate.record(run, BenchItem("q1", "c", ("t",)), 0, prompt, None, 0.0, spec, RoundStats(), 1.0,
                    SamplingConfig(), draftable=torch.tensor([1, 5, 7]))  # id 1 is in the prompt, not the answer
    evaluate.record(run, BenchItem("q2", "c", ("t",)), 0, prompt, None, 0.0, spec, RoundStats(), 1.0,
                    SamplingConfig(), draftable=torch.tensor([6]))
    assert [p["in_draft_vocab"] for p in run.prompts] == [2, 1]
    assert evaluate.draft_vocab_coverage(run.prompts) == {"answer_tokens": 6, "in_vocab": 3, "share": 0.5}
    assert evaluate.draft_vocab_coverage(run.prompts[:0]) is None


def test_a_trained_eagle3_checkpoint_is_a_proposer(bench, tmp_path):
    # A native EAGLE-3 checkpoint directory plugs into --proposer; greedy output still equals generate.
    from drafters.checkpoint import save_checkpoint, target_info
    from drafters.draft_vocab import build_draft_vocab
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from drafters.targets import load_target

    target = load_target("tiny-random-llama")
    vocab = build_draft_vocab(torch.ones(target.vocab_size), target.vocab_size, size=64)
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(target.config, draft_vocab_size=64), vocab)
    drafter.init_from_target(target.lm_head.weight, vocab)
    save_checkpoint(tmp_path / "eagle3", family="eagle3", config=dataclasses.asdict(drafter.config),
                    target=target_info(target), state_dict=drafter.state_dict())
    report = run(bench, tmp_path / "e3.json", "--proposer", str(tmp_path / "eagle3"), "--tree",
                 "dynamic:total=6,depth=3,topk=2")
    assert report["greedy_check"]["mismatches"] == 0 and report["rounds"] > 0
    # the share of the answers' tokens its 64-id vocabulary holds, counted here on generate's own answer
    one = run(bench, tmp_path / "e3-one.json", "--proposer", str(tmp_path / "eagle3"), "--tree", "chain:2",
              "--limit", "1")
    prompt = torch.tensor(evaluate.render_prompt(target.tokenizer, evaluate.load_bench(str(bench))[0], []))
    answer, _ = evaluate.baseline(target, prompt, 16, SamplingConfig(), seed=0)
    answer = answer[prompt.numel():]
    held = int(torch.isin(answer, vocab.used).sum())
    assert 0 < held < answer.numel()  # a test that can tell a count from "all" or "none"
    assert one["draft_vocab"] == {"answer_tokens": answer.numel(), "in_vocab": held, "share": held / answer.numel()}


def test_shards_merge_to_the_unsharded_run(bench, tmp_path):
    # --shard splits bench items; --merge must give exactly the unsharded tau and per-depth rates
    limit = ["--limit", "3", "--proposer", "prompt-lookup", "--tree", "chain:3"]
    whole = run(bench, tmp_path / "whole.json", *limit)
    parts = [run(bench, tmp_path / f"part{i}.json", *limit, "--shard", f"{i}/2", "--no-baseline")
             for i in range(2)]
    assert [p["num_prompts"] for p in parts] == [2, 2]  # items 0, 2 | item 1 (two turns)
    assert all(p["speedup"] is None and p["greedy_check"] is None for p in parts)
    merged = TAU.main(["--merge", str(tmp_path / "part0.json"), str(tmp_path / "part1.json"),
                       "--json", str(tmp_path / "merged.json")])
    assert merged["rounds"] == whole["rounds"]
    assert merged["tau"] == pytest.approx(whole["tau"], abs=1e-12)
    assert merged["per_depth_acceptance"] == pytest.approx(whole["per_depth_acceptance"], abs=1e-12)
    assert [(g["start"], g["rounds"]) for g in merged["by_answer_position"]] == \
        [(g["start"], g["rounds"]) for g in whole["by_answer_position"]]
    assert [g["tau"] for g in merged["by_answer_position"]] == \
        pytest.approx([g["tau"] for g in whole["by_answer_position"]], abs=1e-12)
    assert sorted((p["id"], p["turn"], p["rounds"]) for p in merged["per_prompt"]) == \
        sorted((p["id"], p["turn"], p["rounds"]) for p in whole["per_prompt"])


def test_merge_refuses_reports_of_different_runs(bench, tmp_path):
    run(bench, tmp_path / "a.json", "--proposer", "prompt-lookup", "--tree", "chain:3", "--no-baseline")
    run(bench, tmp_path / "b.json", "--proposer", "prompt-lookup", "--tree", "chain:4", "--no-baseline")
    with pytest.raises(SystemExit, match="not a shard of the same run.*tree"):
        TAU.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")])


@pytest.mark.parametrize("extra, message", [(["--shard", "2/2"], "--shard"),
                                            (["--no-baseline", "--temperature", "1"], "--no-baseline")])
def test_bad_shard_and_baseline_options(bench, tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        run(bench, tmp_path / "x.json", "--proposer", "prompt-lookup", *extra)


def test_a_nan_drafter_is_refused_naming_the_tensor_not_measured_as_tau_1(bench, tmp_path):
    from safetensors.torch import load_file, save_file

    from drafters.checkpoint import save_checkpoint, target_info
    from drafters.draft_vocab import build_draft_vocab
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from drafters.targets import load_target

    target = load_target("tiny-random-llama")
    vocab = build_draft_vocab(torch.ones(target.vocab_size), target.vocab_size, size=64)
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(target.config, draft_vocab_size=64), vocab)
    save_checkpoint(tmp_path / "eagle3", family="eagle3", config=dataclasses.asdict(drafter.config),
                    target=target_info(target), state_dict=drafter.state_dict())
    weights = tmp_path / "eagle3" / "model.safetensors"
    tensors = load_file(weights)
    tensors["fc.weight"][0, 0] = float("nan")  # used to report "tau 1.000, greedy == generate 6/6 OK"
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=r"model.safetensors: non-finite weights \(NaN or inf\) in fc.weight \(1 of"):
        run(bench, tmp_path / "nan.json", "--proposer", str(tmp_path / "eagle3"), "--tree", "chain:2")
    assert not (tmp_path / "nan.json").exists()


def test_rounds_are_grouped_by_where_their_answer_stood():
    from drafters.acceptance import position_acceptance

    # answer 0: rounds accepting 3, 0, 2 start at tokens 0, 4, 5; answer 1: 1, 3, 3 start at 0, 2, 6 (buckets of 4)
    groups = position_acceptance([3, 0, 2, 1, 3, 3], [3] * 6, [3, 3], bucket=4)
    assert [(g["start"], g["rounds"]) for g in groups] == [(0, 3), (4, 3)]
    assert groups[0]["tau"] == pytest.approx((4 + 2 + 4) / 3) and groups[1]["tau"] == pytest.approx((1 + 3 + 4) / 3)
    assert groups[0]["per_depth_acceptance"] == pytest.approx([1.0, 2 / 3, 2 / 3])  # accepted 3, 1, 3
    assert groups[1]["per_depth_acceptance"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])  # accepted 0, 2, 3
    with pytest.raises(ValueError, match="6 rounds, 6 depths, but the answers hold 5 rounds"):
        position_acceptance([3, 0, 2, 1, 3, 3], [3] * 6, [3, 2], bucket=4)
