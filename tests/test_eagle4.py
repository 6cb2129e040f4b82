"""EAGLE-4 (drafters.eagle4): an EAGLE-3 drafter with a sliding-window layer and a low-rank candidate head.

- the candidate head: at full rank A B = W (the SVD start); with k = the draft vocabulary every token is a candidate
  (recall 1, drafts = EAGLE-3's full head); a drafted row holds the full head's exact logits on the k candidates of
  the low-rank head and -inf elsewhere;
- the proposer: greedy decoding equals generate (chain, static and dynamic trees) with few candidates, so drafts
  outside them happen; sampled draft_probs are softmax over the candidates of the exact logits (the q the verifier
  reads) and sampled decoding keeps the target's distribution (chi-square);
- refusals before any work, one sentence naming the field: rank, window, candidates;
- the tiny recipe through train/train.py: both stages' golden losses, candidate recall in the evaluation.
Lossless greedy decoding from a trained checkpoint, the native export round trip and the fit refusal are
tests/test_contracts.py's.
"""

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import continuations, fit_drafter, fused_batch, save_drafter, train_tiny, untied_llama
from safetensors.torch import load_file, save_file
from test_sampling import first_two_tokens_pvalue

from drafters.checkpoint import load_checkpoint
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.eagle4 import draft_step_cost
from drafters.decode.proposers.loading import proposer_from_checkpoint
from drafters.decode.sampling import SamplingConfig
from drafters.draft_vocab import build_draft_vocab
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.export.eagle4 import read_eagle4_export
from drafters.export.reading import ExportCheckError
from drafters.eagle4 import Eagle4Config, Eagle4Drafter, candidate_recall
from drafters.targets import TargetFeatures
from drafters.training.eagle3 import TTTOptions, ttt_loss
from drafters.training.eagle4 import candidate_loss, train_candidate_head
from drafters.training.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "eagle4_tiny.yaml")
VOCAB, VD, PROMPT, NEW = 259, 32, 12, 30


def make_config(target, **fields) -> Eagle4Config:
    return Eagle4Config.from_target_config(target.config, VD, **{"rank": 8, "candidates": 4, "window": 8, **fields})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A drafter fitted for a few seconds (stage 1, then a few stage-2 steps) on the target's own continuations, with
    4 candidates of a rank-8 head: the full head's argmax is sometimes not a candidate."""
    target = untied_llama()
    sequences, loss_mask = continuations(target, PROMPT)  # (6, PROMPT + 40)
    vocab = build_draft_vocab([(sequences, loss_mask)], VOCAB, VD)
    torch.manual_seed(0)
    drafter = Eagle4Drafter(make_config(target), vocab)
    drafter.init_from_target(target.lm_head.weight, vocab)
    for p in drafter.candidate_parameters:
        p.requires_grad_(False)
    batch = fused_batch(target, sequences, loss_mask, drafter.config.aux_layers)
    fit_drafter(drafter, lambda _: ttt_loss(drafter, batch, TTTOptions(steps=3)).loss, 100)
    log = train_candidate_head(drafter, lambda b: (batch.features, None), batch.embed,
                               iter([{"input_ids": sequences, "loss_mask": loss_mask}] * 5), 5, 3e-3, 3, nullcontext)
    path = save_drafter(tmp_path_factory.mktemp("ckpt") / "eagle4", "eagle4", drafter.eval(), target, step=100)
    return target, sequences, path, batch, log


def ready(setup, tree):
    target, sequences, path, _, _ = setup
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree, seed=5)
    prompt = sequences[0, :PROMPT]
    with torch.no_grad():
        out = target.model(prompt[None], output_hidden_states=True)
    proposer.reset(prompt, TargetFeatures({i: out.hidden_states[i] for i in proposer.needs.layers},
                                          out.hidden_states[-1], None, out.logits))
    return proposer, prompt, int(sequences[0, PROMPT])


# ---------------------------------------------------------------- the candidate head


def test_full_rank_reproduces_the_head_and_all_candidates_draft_as_the_full_head(tiny_llama):
    model, _ = tiny_llama
    torch.manual_seed(0)
    drafter = Eagle4Drafter(make_config(model, rank=min(VD, 64), candidates=VD))  # rank min(Vd, h) = 32
    x = torch.randn(5, 7, 64)
    normed = drafter.head_input(x)
    torch.testing.assert_close(drafter.low_rank_logits(normed), drafter.compute_logits(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.draft_logits(x), drafter.compute_logits(x), atol=1e-5, rtol=1e-5)
    assert bool(candidate_recall(drafter.compute_logits(x), drafter.low_rank_logits(normed) * 0, VD).all())


def test_drafted_rows_are_the_exact_logits_of_the_low_rank_heads_top_k(tiny_llama):
    model, _ = tiny_llama
    torch.manual_seed(1)
    drafter = Eagle4Drafter(make_config(model, rank=2, candidates=5))
    x = torch.randn(3, 64)
    rows, full = drafter.draft_logits(x), drafter.compute_logits(x)  # (3, Vd)
    top = drafter.low_rank_logits(drafter.head_input(x)).topk(5).indices
    kept = torch.isfinite(rows)
    assert kept.sum(-1).tolist() == [5, 5, 5] and bool(kept.gather(1, top).all())
    torch.testing.assert_close(rows[kept], full[kept])
    recall = candidate_recall(full, drafter.low_rank_logits(drafter.head_input(x)), 5)
    assert recall.tolist() == (rows.argmax(-1) == full.argmax(-1)).tolist()  # the greedy draft is the full one iff hit


def test_stage_two_trains_only_the_factors_and_lowers_the_kl(setup):
    _, _, path, batch, log = setup
    assert log[-1]["loss"] < log[0]["loss"]
    assert max(log[-1]["candidate_recall"]) < 0.9  # candidates miss: the decoding tests meet drafts off the argmax
    drafter = proposer_from_checkpoint(load_checkpoint(path), setup[0], "chain:2").drafter
    out = candidate_loss(drafter.float().requires_grad_(True), batch, 3)
    out.loss.backward()
    trained = {name for name, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained == {"efficient_lm_head.weight", "efficient_lm_head_down_proj.weight"}


def test_the_draft_step_cost_is_the_candidate_heads():
    config = Eagle4Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, vocab_size=49152, draft_vocab_size=32000, max_position_embeddings=8192,
                          aux_layers=[2, 15, 27], rank=64, candidates=64)
    cost = draft_step_cost(config)
    assert cost == {"full_head": 576 * 32000, "candidate_head": 64 * (576 + 32000) + 64 * 576}
    assert cost["candidate_head"] / cost["full_head"] < 0.12


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("tree", ["chain:4", "static:eagle1", "dynamic:total=12,depth=4,topk=4"])
def test_greedy_matches_generate(setup, tree):
    target, sequences, path, _, _ = setup
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree)
    accepted = 0
    for row in range(2):
        out, stats = speculative_generate(target, proposer, sequences[row, :PROMPT], max_new_tokens=NEW)
        assert out.tolist() == sequences[row, :PROMPT + NEW].tolist()
        accepted += sum(stats.accepted)
    assert accepted > 0


@torch.no_grad()
def test_sampled_draft_probs_are_the_softmax_over_the_candidates(setup):
    proposer, prompt, pending = ready(setup, "static:[[0],[1],[2]]")
    tree = proposer.propose(prompt, pending, SamplingConfig(temperature=1.0))
    hidden, _ = proposer.draft_root(pending)  # the root pair again: the same row the children were drawn from
    drafter = proposer.drafter
    cand, exact = drafter.candidate_logits(drafter.head_input(hidden[0, -1]))
    q = torch.zeros(VOCAB)
    q[proposer.used[cand]] = exact.softmax(-1)
    for child in tree.children[0]:
        torch.testing.assert_close(tree.draft_probs[child], q, atol=1e-6, rtol=1e-5)
    assert int((q > 0).sum()) == drafter.config.candidates


@pytest.mark.slow
@torch.no_grad()
def test_sampled_decoding_reproduces_the_targets_distribution(setup):
    target, sequences, path, _, _ = setup
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, "chain:3", seed=5)
    pvalue, accepted = first_two_tokens_pvalue(target.model, proposer, sequences[3, :PROMPT])
    assert accepted > 40 and pvalue > 1e-3, (accepted, pvalue)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("fields, message", [
    ({"rank": 33}, r"rank=33 must be in \[1, 32\]: a rank-r head .* has rank at most min\(Vd, h\)"),
    ({"candidates": 0}, r"candidates=0 must be in \[1, 32\] \(the draft vocabulary\)"),
    ({"candidates": 33}, r"candidates=33 must be in \[1, 32\]"),
    ({"window": 1025}, r"sliding_window=1025 is larger than the context \(max_position_embeddings=1024\)"),
])
def test_bad_configs_are_refused_naming_the_field(tiny_llama, fields, message):
    with pytest.raises(ValueError, match=message):
        make_config(tiny_llama[0], **fields)


@pytest.mark.parametrize("override, message", [
    ("eagle4.rank=65", r"eagle4.rank=65 must be in \[1, min\(draft vocabulary, hidden size\)\]"),
    ("eagle4.candidates=0", r"eagle4.candidates=0 must be in \[1, draft_vocab_size=64\]"),
    ("eagle4.candidates=65", r"eagle4.candidates=65 must be in \[1, draft_vocab_size=64\]"),
    ("eagle4.window=0", r"eagle4.window=0 must be >= 1 position, or null"),
    ("eagle4.stage2_steps=-1", r"eagle4.stage2_steps=-1 must be >= 0"),
])
def test_bad_eagle4_values_fail_before_any_work(trainer, tmp_path, override, message):
    with pytest.raises(RecipeError, match=message):
        trainer.main([RECIPE, override, f"output_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, message", [
    (["draft_vocab_size=259", "eagle4.rank=65"], r"eagle4.rank=65 is larger than the draft head \(259 x 64\), whose "
                                                 r"rank is at most 64"),
    (["eagle4.window=1025"],
     r"eagle4.window=1025 is larger than the target's context \(max_position_embeddings=1024\)"),
])
def test_what_needs_the_target_is_refused_before_training(trainer, tmp_path, overrides, message):
    with pytest.raises(RecipeError, match=message):
        trainer.main([RECIPE, *overrides, f"output_dir={tmp_path}"])
    assert not list(tmp_path.glob("checkpoint-*")) and not (tmp_path / "candidate_head.jsonl").exists()


# ---------------------------------------------------------------- trained through train/train.py


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory, RECIPE)


def test_reproduces_golden_losses(run):
    # recorded from the first run of recipes/eagle4_tiny.yaml (stage 1: the optimizer steps; stage 2: the candidate
    # head's KL at its steps)
    summary, out = run
    golden_stage1 = GOLDEN_STAGE1
    golden_stage2 = GOLDEN_STAGE2
    stage2 = [json.loads(line)["loss"] for line in (out / "candidate_head.jsonl").read_text().splitlines()]
    assert [round(x, 6) for x in summary.losses] == pytest.approx(golden_stage1, abs=2e-5)
    assert [round(x, 6) for x in stage2] == pytest.approx(golden_stage2, abs=2e-5)


def test_the_evaluation_reports_candidate_recall_per_depth(run):
    _, out = run
    result = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert len(result["candidate_recall"]) == 3 and all(0.9 <= r <= 1 for r in result["candidate_recall"])
    assert result["candidates"] == 8
    final = load_checkpoint(out / "checkpoint-final")
    assert final.config["sliding_window"] == 16 and final.config["layer_types"] == ["sliding_attention"]
    assert final.state_dict["efficient_lm_head.weight"].shape == (64, 16)


# ---------------------------------------------------------------- export


def test_the_vllm_export_carries_the_candidate_head_and_reads_back(setup, tmp_path):
    target, _, path, _, _ = setup
    export = export_checkpoint(path, "vllm", tmp_path / "vllm", target=target).path
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle4"] and config["speculators_model_type"] == "eagle4"
    assert config["candidate_head"] == {"rank": 8, "num_candidates": 4}
    assert config["transformer_layer_config"]["layer_types"] == ["sliding_attention"]
    assert config["transformer_layer_config"]["sliding_window"] == 8
    tensors = load_file(export / "model.safetensors")
    assert tensors["efficient_lm_head.weight"].shape == (VD, 8)  # A
    assert tensors["efficient_lm_head_down_proj.weight"].shape == (8, 64)  # B
    c, state, embedding, _ = read_eagle4_export(export)
    source = load_checkpoint(path)
    assert c.rank == 8 and c.candidates == 4 and embedding is not None
    assert all(torch.equal(state[k], v) for k, v in source.state_dict.items())
    del tensors["efficient_lm_head_down_proj.weight"]
    save_file(tensors, export / "model.safetensors")
    with pytest.raises(ExportCheckError, match="efficient_lm_head_down_proj.weight"):
        read_eagle4_export(export)


@pytest.mark.parametrize("fmt, engine", [("sglang", "SGLang's LlamaForCausalLMEagle3"),
                                         ("llama.cpp", "its EAGLE-3 graph")])
def test_engines_without_a_candidate_head_are_refused_in_one_sentence(setup, tmp_path, fmt, engine):
    target, _, path, _, _ = setup
    sentence = rf"^an EAGLE-4 drafter cannot be exported to {fmt}: {engine} has no candidate head, .*; use " \
        r"--format vllm \(LlamaForCausalLMEagle4\) or native$"
    with pytest.raises(ExportError, match=sentence):
        export_checkpoint(path, fmt, tmp_path / fmt, target=target)
    assert not any(tmp_path.iterdir())


GOLDEN_STAGE1 = [2.452211, 3.005314, 3.299941, 2.878261, 3.002203, 3.061183]  # recorded from the first run
GOLDEN_STAGE2 = [0.009544, 0.00897, 0.0044, 0.004081]
