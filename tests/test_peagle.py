"""P-EAGLE (drafters.peagle): EAGLE-3 drafting K tokens in one pass.

- training (every depth of the kept chains in one pass) == drafting: the committed pairs prefilled into a KV
  cache, then one pass [root pair ; K-1 mask slots]; a leaky chain mask is caught;
- conditional drop-token: depth d keeps ceil(n max(r^d, r_min)) chains, nested in depth d-1's, from eligible starts;
- the proposer: row d ranks every depth-d node's children, sampled draft_probs are those rows, sampled decoding
  reproduces the target's distribution (chi-square), dynamic trees decode greedily as generate;
- the tiny recipe through train/eagle.py (golden losses, resume draws the same chains); bad input gets one
  sentence; the vllm export needs the target and is refused by llama.cpp.
Greedy == generate on a chain and a static tree, the export round trip and the fit refusal are
tests/test_contracts.py's; speculators' own P-EAGLE reproducing our logits is tests/test_consumers.py's.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (continuations, fit_drafter, fused_batch, save_drafter, train_tiny,  # tests/ on sys.path
                      untied_llama)
from safetensors.torch import load_file, save_file
from test_sampling import first_two_tokens_pvalue
from transformers import GenerationConfig

from drafters import peagle
from drafters.checkpoint import load_checkpoint
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.loading import load_proposer, proposer_from_checkpoint
from drafters.decode.sampling import SamplingConfig, warp
from drafters.decode.tree import parse_tree_spec
from drafters.draft_vocab import DraftVocab, build_draft_vocab
from drafters.eagle3 import fuse_features
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.layers import DraftKVCache
from drafters.peagle import PEagleConfig, PEagleDrafter, chain_attention_mask, sample_chains
from drafters.targets import TargetFeatures
from drafters.training.loop import FeatureBatch
from drafters.training.peagle import parallel_loss
from drafters.training.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "peagle_tiny.yaml")
VOCAB, K, PROMPT = 259, 4, 12


def make_drafter(model, seed=0, **norms) -> PEagleDrafter:
    config = PEagleConfig.from_target_config(model.config, 64, depth=K, mask_token_id=1, **norms)
    torch.manual_seed(seed)
    drafter = PEagleDrafter(config, DraftVocab.from_used(torch.arange(3, 67), VOCAB))
    with torch.no_grad():  # off the initialisation: norms away from 1
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.2)
    return drafter.eval()


@pytest.fixture(scope="module")
def setup(tiny_llama):
    model, _ = tiny_llama
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(2, 24, dtype=torch.long)
    loss_mask[:, :5] = 0
    loss_mask[1, 17:] = 0
    drafter = make_drafter(model, norm_before_fc=True)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    features = fuse_features(out.hidden_states, drafter.config.aux_layers)
    starts, keep = sample_chains(loss_mask, K, 0.7, 0.2, torch.Generator().manual_seed(0))
    return model, drafter, ids, loss_mask, features, out.logits, starts, keep


@torch.no_grad()
def drafted(drafter, features, ids, embed, b, t):
    """The decoding path: pairs 0..t-1 prefilled, then one pass from the root pair (F_t, token t+1) -> (K, Vd)."""
    cache = DraftKVCache()
    if t:
        drafter.prefill(features[b:b + 1, :t], ids[b:b + 1, 1:t + 1], embed, cache)
    return drafter.draft(features[b:b + 1, t:t + 1], ids[b:b + 1, t + 1:t + 2], embed, cache)[1][0]


@torch.no_grad()
def chain_logits(drafter, features, ids, embed, starts, keep):
    """parallel_unroll's outputs regrouped per chain: {(b, n): (depths kept, Vd)} (depth 0 read at the start)."""
    seq_len, n = ids.shape[1], starts.shape[1]
    logits = drafter.compute_logits(drafter.parallel_unroll(features, ids, embed, starts, keep))
    out = {}
    for b in range(ids.shape[0]):
        for c in range(n):
            if not keep[b, 0, c]:
                continue
            depths = int(keep[b, :, c].sum())
            rows = [logits[b, int(starts[b, c])]] + [logits[b, seq_len + d * n + c] for d in range(depths)]
            out[(b, c)] = torch.stack(rows)
    return out


def test_training_chains_equal_one_pass_drafted_on_a_cached_prefix(setup):
    model, drafter, ids, _, features, _, starts, keep = setup
    embed = model.get_input_embeddings()
    chains = chain_logits(drafter, features, ids, embed, starts, keep)
    assert len(chains) >= 8 and max(len(v) for v in chains.values()) == K  # some chains reach depth K-1
    for (b, c), got in chains.items():
        want = drafted(drafter, features, ids, embed, b, int(starts[b, c]))
        torch.testing.assert_close(got, want[:len(got)], atol=1e-5, rtol=1e-5)


def leaky(starts, keep, seq_len):  # WRONG: deep slots also see the depth-0 slot after their chain's start
    mask = chain_attention_mask(starts, keep, seq_len)
    deeper, n = keep.shape[1], starts.shape[1]
    nxt = (torch.arange(seq_len)[None, None] == (starts[..., None] + 1))  # (B, N, T)
    mask[:, 0, seq_len:, :seq_len] |= nxt[:, None].expand(-1, deeper, -1, -1).reshape(len(starts), deeper * n, -1)
    return mask


def test_the_comparison_catches_a_leaky_chain_mask(setup, monkeypatch):
    model, drafter, ids, _, features, _, starts, keep = setup
    embed = model.get_input_embeddings()
    monkeypatch.setattr(peagle, "chain_attention_mask", leaky)
    chains = chain_logits(drafter, features, ids, embed, starts, keep)
    worst = max(float((got[1:] - drafted(drafter, features, ids, embed, b, int(starts[b, c]))[1:len(got)])
                      .abs().max()) for (b, c), got in chains.items() if len(got) > 1)
    assert worst > 1e-2


def test_drop_token_keeps_nested_fractions_of_eligible_starts():
    loss_mask = torch.zeros(3, 40, dtype=torch.long)
    loss_mask[0, 10:] = 1
    loss_mask[1, 30:] = 1
    loss_mask[2, 5:20] = 1
    starts, keep = sample_chains(loss_mask, 5, 0.7, 0.2, torch.Generator().manual_seed(1))
    eligible = [set(range(8, 38)), set(range(28, 38)), set(range(3, 18))]  # token t+2 learnt
    for b in range(3):
        n = len(eligible[b])
        for d in range(1, 5):
            kept = keep[b, d - 1]
            assert int(kept.sum()) == -(-n * max(0.7 ** d, 0.2) // 1)  # ceil
            assert {int(t) for t in starts[b][kept]} <= eligible[b]
            if d > 1:
                assert not (kept & ~keep[b, d - 2]).any()  # nested in depth d-1's
    again = sample_chains(loss_mask, 5, 0.7, 0.2, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], starts) and torch.equal(again[1], keep)


def test_the_loss_is_one_mean_over_every_counted_slot(setup):
    model, drafter, ids, loss_mask, features, logits, starts, keep = setup
    out = parallel_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, model.get_input_embeddings()), starts,
                        keep)
    mean = (out.step_losses * out.step_counts).sum() / out.step_counts.sum()  # per-depth means, count-weighted
    torch.testing.assert_close(out.loss, mean, atol=1e-5, rtol=1e-5)
    assert out.step_counts[0] > out.step_counts[1] > out.step_counts[-1] > 0  # fewer chains deeper


# ---------------------------------------------------------------- the proposer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    target = untied_llama()
    rows, loss_mask = continuations(target, PROMPT)
    vocab = build_draft_vocab([(rows, loss_mask)], VOCAB, 48)
    pconfig = PEagleConfig.from_target_config(target.config, 48, depth=K, mask_token_id=0)
    torch.manual_seed(0)
    drafter = PEagleDrafter(pconfig, vocab)
    drafter.init_from_target(target.lm_head.weight)
    batch = fused_batch(target, rows, loss_mask, pconfig.aux_layers)
    generator = torch.Generator().manual_seed(0)

    def loss(_):
        return parallel_loss(drafter, batch, *sample_chains(loss_mask, K, 0.7, 0.2, generator)).loss

    fit_drafter(drafter, loss, 100)
    return target, rows, save_drafter(tmp_path_factory.mktemp("peagle") / "ckpt", "peagle", drafter, target, step=100)


def ready(checkpoint, tree):
    target, rows, path = checkpoint
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree)
    prompt = rows[0, :PROMPT]
    with torch.no_grad():
        out = target.model(prompt[None], output_hidden_states=True)
    proposer.reset(prompt, TargetFeatures({i: out.hidden_states[i] for i in proposer.needs.layers},
                                          out.hidden_states[-1], None, out.logits))
    with torch.no_grad():
        fused = fuse_features(out.hidden_states, proposer.drafter.config.aux_layers)
        rows_by_hand = drafted(proposer.drafter, fused, torch.cat([prompt, rows[0, PROMPT:PROMPT + 1]])[None],
                               proposer.embed, 0, PROMPT - 1)  # (K, Vd)
    return proposer, prompt, int(rows[0, PROMPT]), rows_by_hand


@torch.no_grad()
def test_drafts_are_each_rows_argmax_and_sampled_probs_are_the_rows(checkpoint):
    proposer, prompt, pending, rows = ready(checkpoint, "static:[[0],[1],[0,0],[1,0],[0,0,0]]")
    tree = proposer.propose(prompt, pending, SamplingConfig())
    ranked = proposer.used[rows.argsort(-1, descending=True)]  # (K, Vd) target ids, best first
    assert tree.tokens.tolist() == [pending, int(ranked[0, 0]), int(ranked[0, 1]), int(ranked[1, 0]),
                                    int(ranked[1, 0]), int(ranked[2, 0])]
    sampling = SamplingConfig(temperature=0.7)
    tree = proposer.propose(prompt, pending, sampling)
    for node in range(1, tree.num_nodes):
        q = torch.zeros(VOCAB)
        q[proposer.used] = warp(rows[tree.depth_list[node] - 1], sampling)
        torch.testing.assert_close(tree.draft_probs[node], q, atol=1e-5, rtol=1e-4)


def test_dynamic_trees_decode_as_generate(checkpoint):
    target, rows, path = checkpoint
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, "dynamic:total=10,depth=4,topk=3")
    accepted = 0
    for i in range(3):
        prompt = rows[i, :PROMPT]
        out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=24)
        assert out.tolist() == target.model.generate(prompt[None], generation_config=config)[0].tolist()
        accepted += sum(stats.accepted)
    assert accepted > 0


@pytest.mark.parametrize("tree", ["chain:3"])  # the verifier is tree-independent
@torch.no_grad()
@pytest.mark.slow
def test_sampled_decoding_reproduces_the_targets_distribution(checkpoint, tree):
    target, rows, path = checkpoint
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree, seed=5)
    pvalue, accepted = first_two_tokens_pvalue(target.model, proposer, rows[3, :PROMPT])
    assert accepted > 40 and pvalue > 1e-3, (accepted, pvalue)


def test_refusals_name_the_depth_and_the_formats(checkpoint, tmp_path):
    target, _, path = checkpoint
    with pytest.raises(ValueError, match=r"chain:5 is 5 deep, but this P-EAGLE drafter drafts 4 tokens per pass"):
        proposer_from_checkpoint(load_checkpoint(path), target, "chain:5")
    with pytest.raises(ExportError, match="needs --target: speculators' P-EAGLE loads its token embedding"):
        export_checkpoint(path, "vllm", tmp_path / "a")
    with pytest.raises(ExportError, match=r"peagle checkpoint to llama.cpp is not supported .*use --format vllm"):
        export_checkpoint(path, "llama.cpp", tmp_path / "b", target=target)
    assert not any(tmp_path.iterdir())
    # the gate is DSpark's: a P-EAGLE drafter has no confidence head
    with pytest.raises(ValueError, match="only DSpark drafters have a confidence head, this is a PEagle drafter"):
        load_proposer(f"{path}:conf_min=0.5", target, parse_tree_spec("chain:4"))


def test_an_export_with_another_embedding_is_refused_where_it_would_draft(checkpoint, tmp_path):
    target, _, path = checkpoint
    export = export_checkpoint(path, "vllm", tmp_path / "vllm", target=target).path
    assert load_proposer(str(export), target, parse_tree_spec("chain:4")).drafter.config.depth == K  # as written
    tensors = load_file(export / "model.safetensors")
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] + 0.5
    save_file(tensors, export / "model.safetensors")
    with pytest.raises(ValueError, match=r"embed_tokens differ from target 'tiny-random-llama''s \(max \|diff\| 0.5\)"):
        load_proposer(str(export), target, parse_tree_spec("chain:4"))


# ---------------------------------------------------------------- trained through train/eagle.py


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory, RECIPE)


def test_reproduces_golden_losses(run):
    summary, _ = run
    golden = [5.571626, 5.566345, 5.556323, 5.55373, 5.552438, 5.549995]
    assert [round(x, 6) for x in summary.losses] == pytest.approx(golden, abs=2e-5)


def test_held_out_tau_is_reported_for_every_chain_length(run):
    _, out = run
    result = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    by_length = result["tau_pred_by_length"]
    assert len(by_length) == K and by_length == sorted(by_length) and by_length[-1] == result["tau_pred"]
    assert len(result["step_acc"]) == K and result["chains"] > 0


def test_resumed_run_draws_the_same_chains_and_ends_with_the_same_weights(trainer, run, tmp_path):
    summary, out = run
    shutil.copytree(out / "checkpoint-4", tmp_path / "checkpoint-4")
    resumed = trainer.main([RECIPE, f"output_dir={tmp_path}", "resume_from=latest"])
    final, again = load_checkpoint(out / "checkpoint-final"), load_checkpoint(tmp_path / "checkpoint-final")
    assert resumed.losses == summary.losses[4:]
    for key, value in final.state_dict.items():
        assert torch.equal(value, again.state_dict[key]), key


@pytest.mark.parametrize("override, message", [
    ("peagle.depth=1", r"peagle.depth=1 must be an integer in \[2, 64\]"),
    ("peagle.down_sample_ratio=0", r"peagle.down_sample_ratio=0.0 must be in \(0, 1\]"),
    ("peagle.eval_chains=0", "peagle.eval_chains=0 must be >= 1"),
    ("ttt_steps=0", "ttt_steps=0 is read by drafter: eagle3, eagle4 only, not peagle"),  # P-EAGLE has no unroll
])
def test_bad_peagle_values_fail_clearly(trainer, tmp_path, override, message):
    with pytest.raises(RecipeError, match=message):
        trainer.main([RECIPE, override, f"output_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())
