"""EAGLE-1: alignment on a hand-made sequence, the self-fed chain == drafting with a KV cache, the frozen
head == the target's, golden losses of the tiny recipe, lossless decoding (greedy and sampled) with an
EAGLE-1 proposer, export to the official layout, clear refusals."""

import json
import math
import signal
from itertools import pairwise
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, target_info
from drafters.decode.decoder import speculative_generate
from drafters.eagle1 import Eagle1Config, Eagle1Drafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.layers import DraftKVCache, shift_left
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.export.eagle1 import check_eagle1_export, expected_shapes
from drafters.decode.proposers.loading import load_drafter_proposer, load_proposer
from drafters.training.recipe import RecipeError
from drafters.decode.sampling import SamplingConfig, warp
from drafters.targets import FrozenHead, Target
from drafters.tiny import build_tiny_target
from drafters.decode.tree import parse_tree_spec
from conftest import (continuations, fit_drafter, greedy_reference, save_drafter, train_tiny,  # tests/ on sys.path
                      untied_llama)
from drafters.errors import Stopped  # noqa: E402
from drafters.training import loop  # noqa: E402  (fit calls loop.train_loop: patched there)
from drafters.training.eagle1 import chain_loss
from drafters.training.loop import FeatureBatch
from test_sampling import chi_square_pvalue

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "eagle1_tiny.yaml")
DATA = ROOT / "tests" / "data" / "tiny_conversations.jsonl"
VOCAB, PROMPT, NEW = 259, 12, 30
TREES = ["chain:4", "static:eagle1", "dynamic:total=12,depth=4,topk=4"]

# Recorded once from the tiny recipe as it is (6 steps of batch 2 x grad_accum 2, normed features, noise
# 0.1 from the objective's own generator, lr 1e-3 with 2 warmup steps then cosine, clip_value 0.5, no norm
# clipping, seed 0), one CPU thread:
#   OMP_NUM_THREADS=1 python train/eagle.py recipes/eagle1_tiny.yaml output_dir=/tmp/e1tiny
#   -> the "loss" column of /tmp/e1tiny/metrics.jsonl (torch 2.13.0 CPU, transformers 5.23.0).
GOLDEN_LOSSES = [1.0037007331848145, 0.9647460579872131, 0.9353283047676086,
                 0.9006495475769043, 0.895370602607727, 0.8685475587844849]




def feature_of(target, ids, feature):
    # (B, T, h) the drafter's input feature, (B, T, V) the target's logits
    out = target.features(ids, pre_norm_last=feature == "pre_norm", logits=True)
    return (out.pre_norm_last if feature == "pre_norm" else out.last_hidden), out.logits


def new_drafter(target, feature="pre_norm", seed=0):
    torch.manual_seed(seed)
    config = Eagle1Config.from_target_config(target.config, feature)
    return Eagle1Drafter(config).attach_head(FrozenHead.from_target(target, feature))


# ---------------------------------------------------------------- alignment on a hand-made sequence


@pytest.fixture(scope="module")
def hand_made():
    # a hand-written prompt, then the target's own greedy reply: token t+2 = argmax of the target's logits
    # at t+1 on every reply token, so "predicts token t+2" can be checked exactly. This prompt's reply never
    # repeats a token twice in a row, so an off-by-one in either direction changes the predicted token.
    target = untied_llama()
    prompt = target.tokenizer("Q: colour? A:", return_tensors="pt").input_ids  # (1, P)
    ids = greedy_reference(target.model, prompt, 10)  # (1, P + 10)
    reply = ids[0, prompt.shape[1]:].tolist()
    assert all(a != b for a, b in pairwise(reply))
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt.shape[1]:] = 1  # the reply tokens are learnt
    features, logits = feature_of(target, ids, "pre_norm")
    assert ids[0, prompt.shape[1]:].tolist() == logits[0, prompt.shape[1] - 1:-1].argmax(-1).tolist()
    return target, ids, loss_mask, features, logits


def test_position_t_reads_feature_t_and_token_t_plus_1(hand_made):
    target, ids, loss_mask, features, logits = hand_made
    drafter, seen = new_drafter(target), []
    drafter.fc.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    chain_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, target.embed_tokens))
    h, fc_input = target.hidden_size, seen[0]  # (1, T, 2h) = cat(embed, feature), the official order
    for t in range(ids.shape[1] - 1):
        torch.testing.assert_close(fc_input[0, t, :h], target.embed_tokens(ids[0, t + 1]), atol=0, rtol=0)
        torch.testing.assert_close(fc_input[0, t, h:], features[0, t], atol=0, rtol=0)


def oracle(drafter, predicted):
    # the backbone replaced by one that outputs `predicted` (B, T, h) whatever it reads
    drafter.backbone = lambda x, positions, past, mask: (predicted, (x[:, None], x[:, None]))
    return drafter


@torch.no_grad()
def test_position_t_is_scored_against_feature_and_logits_of_t_plus_1(hand_made):
    target, ids, loss_mask, features, logits = hand_made
    supervised = int(loss_mask[0, 2:].sum())  # position t counts iff token t+2 is learnt

    def score(predicted):
        drafter = oracle(new_drafter(target), predicted)
        return chain_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, target.embed_tokens),
                          feature_weight=1.0, token_weight=0.1)

    right = score(shift_left(features, 1))  # outputs the target's feature_{t+1} at t
    assert int(right.step_counts[0]) == supervised
    assert float(right.feature_losses[0]) == 0.0 and float(right.step_accuracies[0]) == 1.0
    rows = logits[0, 1:-1][loss_mask[0, 2:].bool()].float()  # (M, V) the target's rows t+1
    entropy = -(rows.softmax(-1) * rows.log_softmax(-1)).sum(-1).mean()  # soft CE at its minimum
    torch.testing.assert_close(right.token_losses[0], entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right.loss, 0.1 * entropy, atol=1e-6, rtol=1e-5)
    for wrong in (features, shift_left(features, 2)):  # off by one either way
        out = score(wrong)
        assert out.feature_losses[0] > 1e-6 and out.step_accuracies[0] < 0.5  # right: exactly 0 and 1
        assert out.token_losses[0] > right.token_losses[0]


@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-gemma3"])
@pytest.mark.parametrize("feature", ["pre_norm", "normed"])
def test_frozen_head_is_the_targets_head(request, name, feature):
    model, tokenizer = request.getfixturevalue(name.replace("-random-", "_"))  # tiny_llama / tiny_gemma3
    target = Target(model, tokenizer, name)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    values, logits = feature_of(target, ids, feature)
    torch.testing.assert_close(FrozenHead.from_target(target, feature)(values), logits, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_self_fed_chain_equals_drafting_with_a_kv_cache(hand_made):
    # step i of chain_loss at position t == the drafter stepped by hand on its own predicted features
    target, ids, loss_mask, features, logits = hand_made
    drafter, embed, steps = new_drafter(target).eval(), target.embed_tokens, 4
    out = chain_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), steps=steps, return_logits=True)
    for t in (0, 5, ids.shape[1] - 1 - steps):
        cache = DraftKVCache()
        hidden, step_logits = drafter.prefill(features[:, :t + 1], ids[:, 1:t + 2], embed, cache)
        reference, hidden = [step_logits[:, t]], hidden[:, t:t + 1]
        for i in range(1, steps):
            hidden, step_logits = drafter.step(hidden, ids[:, t + 1 + i:t + 2 + i], embed, cache,
                                               positions=torch.tensor([[t + i]]))
            reference.append(step_logits[:, 0])
        for i in range(steps):
            torch.testing.assert_close(out.step_logits[i][:, t], reference[i], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- train/eagle.py with drafter: eagle1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory, RECIPE, f"data.path={DATA}")


def test_reproduces_golden_losses(run):
    summary, output_dir = run
    assert summary.losses == pytest.approx(GOLDEN_LOSSES, rel=1e-4)
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # step_loss = [feature SmoothL1, token soft CE]; loss = 1.0 * feature + 0.1 * token
        assert len(row["step_loss"]) == 2 and len(row["step_acc"]) == 1
        assert row["step_loss_is"] == "feature, token"
        assert row["loss"] == pytest.approx(row["step_loss"][0] + 0.1 * row["step_loss"][1], rel=1e-5)


def test_the_tiny_recipes_drafter_exports_in_the_official_layout(run, tmp_path):
    # the default feature is the final-normed hidden state, the only one the official layout and engines run
    summary, output_dir = run
    assert summary.drafter.config.feature == "normed"
    result = export_checkpoint(output_dir / "checkpoint-final", "eagle1", tmp_path / "eagle1", target=summary.target)
    assert (tmp_path / "eagle1" / "config.json").is_file() and result.check is not None


def test_checkpoint_and_held_out_evaluation(run):
    summary, output_dir = run
    ckpt = load_checkpoint(output_dir / "checkpoint-final", family="eagle1")
    assert sorted(ckpt.state_dict) == sorted(Eagle1Drafter(Eagle1Config(**ckpt.config)).state_dict())
    assert "fc.bias" in ckpt.state_dict and not [k for k in ckpt.state_dict if "embed" in k or "lm_head" in k
                                                  or "input_layernorm" in k]
    rebuilt = Eagle1Drafter(Eagle1Config(**ckpt.config))
    rebuilt.load_state_dict(ckpt.state_dict)
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in summary.drafter.state_dict().items())
    evals = [json.loads(line) for line in (output_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [3, 6] and evals[-1] == summary.eval
    accuracy = summary.eval["step_acc"]
    assert len(accuracy) == 3 and summary.eval["supervised"] > 0  # eagle1.eval_steps: 3
    assert summary.eval["tau_pred"] == pytest.approx(1 + sum(math.prod(accuracy[:k]) for k in range(1, 4)))
    fresh, _ = build_tiny_target("tiny-random-llama")
    assert all(torch.equal(summary.target.model.state_dict()[k], v) for k, v in fresh.state_dict().items())


def test_resumed_run_reproduces_the_uninterrupted_losses(trainer, tmp_path, monkeypatch):
    # interrupted after step 4 (Ctrl-C saves a resumable checkpoint), then resumed: the noise generator's
    # state travels with the run state, so steps 5-6 draw the same noise as in the uninterrupted run
    inner = loop.train_loop

    def interrupted(run, *args, **kwargs):
        periodic = run.periodic

        def stop(step, total, position):
            periodic(step, total, position)
            if step == 4:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C

        run.periodic = stop
        return inner(run, *args, **kwargs)

    monkeypatch.setattr(loop, "train_loop", interrupted)
    with pytest.raises(Stopped, match="resume_from"):
        trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path}"])
    monkeypatch.setattr(loop, "train_loop", inner)
    trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path}", "resume_from=latest"])
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(GOLDEN_LOSSES, rel=1e-6)


@pytest.mark.parametrize("override, message", [
    ("eagle1.noise=-0.1", "eagle1.noise=-0.1 must be >= 0"),
    ("eagle1.feature_weight=0 eagle1.token_weight=0", "not both 0"),
    ("layers=[1,2,3]", "EAGLE-1 reads the last hidden state only"),
    ("optim.clip_value=0", "optim.clip_value"),
])
def test_bad_eagle1_recipe_values_fail_clearly(trainer, tmp_path, override, message):
    with pytest.raises(RecipeError, match=message):
        trainer.main([RECIPE, f"output_dir={tmp_path}", *override.split()])


# ---------------------------------------------------------------- decoding with an EAGLE-1 proposer


@pytest.fixture(scope="module", params=["pre_norm", "normed"])
def trained(request, tmp_path_factory):
    target = untied_llama()
    references, loss_mask = continuations(target, PROMPT)  # (6, PROMPT + 40)
    drafter = new_drafter(target, request.param)
    with torch.no_grad():
        features, logits = feature_of(target, references, request.param)
    batch = FeatureBatch(features, references, logits, loss_mask, target.embed_tokens)
    fit_drafter(drafter, lambda _: chain_loss(drafter, batch).loss, 150)
    path = save_drafter(tmp_path_factory.mktemp("eagle1") / request.param, "eagle1", drafter, target)
    return target, references, path


@pytest.mark.parametrize("tree", TREES)
def test_greedy_matches_generate(trained, tree):
    target, references, path = trained
    proposer = load_proposer(str(path), target, parse_tree_spec(tree))  # via FAMILY_PROPOSERS["eagle1"]
    taus = []
    for row in range(2):
        out, stats = speculative_generate(target, proposer, references[row, :PROMPT], max_new_tokens=NEW)
        assert out.tolist() == references[row, :PROMPT + NEW].tolist()
        taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.5  # trained on these continuations: drafts are often accepted


@pytest.mark.parametrize("trained", ["pre_norm"], indirect=True)  # verification ignores the feature kind
@torch.no_grad()
@pytest.mark.slow
def test_sampled_decoding_reproduces_the_target_distribution(trained):
    # chi-square on (token 1, token 2) of 600 sampled generations, as tests/test_sampling.py: the EAGLE-1
    # drafts (sampled siblings without replacement, static tree) must not bias what the target emits
    target, references, path = trained
    proposer = load_drafter_proposer(path, target, "static:[[0],[1],[0,0],[1,0]]")
    model, cfg, prompt = target.model, SamplingConfig(temperature=1.0, top_k=4), references[0, :PROMPT]
    p1 = warp(model(prompt[None]).logits[0, -1], cfg)
    firsts = p1.nonzero().flatten().tolist()
    p2 = {x: warp(model(torch.cat([prompt, torch.tensor([x])])[None]).logits[0, -1], cfg) for x in firsts}
    columns = {x: p2[x].nonzero().flatten().tolist() for x in firsts}
    gen, counts = torch.Generator().manual_seed(3), torch.zeros(len(firsts), 4)
    for _ in range(600):
        out, _ = speculative_generate(model, proposer, prompt, max_new_tokens=2, sampling=cfg, generator=gen)
        x1, x2 = out[-2:].tolist()
        counts[firsts.index(x1), columns[x1].index(x2)] += 1
    exact = torch.stack([p1[x] * p2[x][columns[x]] for x in firsts])
    assert chi_square_pvalue(counts.flatten(), exact.flatten()) > 1e-3


# ---------------------------------------------------------------- export to the official EAGLE-1 layout


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_round_trip(trained, tmp_path, dtype):
    target, references, path = trained
    if path.name == "pre_norm":
        with pytest.raises(ExportError, match="feature 'pre_norm'.*eagle1.feature=normed"):
            export_checkpoint(path, "eagle1", tmp_path / "out", target=target)
        assert not (tmp_path / "out").exists()
        return
    result = export_checkpoint(path, "eagle1", tmp_path / "out", target=target, dtype=dtype)
    assert result.files == ["config.json", "model.safetensors"] and result.check.max_logit_diff <= 1e-5
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bias"] is True
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == VOCAB
    assert config["max_position_embeddings"] == target.max_position_embeddings
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_shapes(config)
    report = check_eagle1_export(tmp_path / "out", target=target_info(target), reference=load_checkpoint(path))
    assert report.max_logit_diff <= 1e-5
    if dtype == "fp32":  # the export drafts like the checkpoint: same output, same rounds
        exported = load_proposer(str(tmp_path / "out"), target, parse_tree_spec("chain:4"))
        native = load_proposer(str(path), target, parse_tree_spec("chain:4"))
        prompt = references[1, :PROMPT]
        (a, sa), (b, sb) = (speculative_generate(target, p, prompt, max_new_tokens=NEW) for p in (exported, native))
        assert a.tolist() == b.tolist() == references[1, :PROMPT + NEW].tolist() and sa.accepted == sb.accepted


@pytest.mark.parametrize("trained", ["normed"], indirect=True)  # exports need normed features
def test_export_reader_catches_a_missing_tensor(trained, tmp_path):
    target, _, path = trained
    out = export_checkpoint(path, "eagle1", tmp_path / "out", target=target).path
    tensors = load_file(out / "model.safetensors")
    del tensors["fc.bias"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['fc.bias'\]"):
        check_eagle1_export(out)


# ---------------------------------------------------------------- checkpoints of another family or target


def test_checkpoint_of_another_family_or_target_is_refused(tmp_path):
    target = untied_llama()
    eagle3 = Eagle3Config.from_target_config(target.config, draft_vocab_size=32)
    save_checkpoint(tmp_path / "e3", family="eagle3", config=asdict(eagle3), target=target_info(target),
                    state_dict=Eagle3Drafter(eagle3).state_dict())
    with pytest.raises(CheckpointError, match="a 'eagle3' checkpoint, expected 'eagle1'"):
        load_drafter_proposer(tmp_path / "e3", target, "chain:3", family="eagle1")
    with pytest.raises(ExportError, match="export of a eagle3 checkpoint to eagle1"):
        export_checkpoint(tmp_path / "e3", "eagle1", tmp_path / "out", target=target)
    config = Eagle1Config.from_target_config(target.config)
    small = replace(config, hidden_size=32, intermediate_size=64)  # right target info, wrong drafter
    save_checkpoint(tmp_path / "h32", family="eagle1", config=asdict(small), target=target_info(target),
                    state_dict=Eagle1Drafter(small).state_dict())
    with pytest.raises(CheckpointError, match="hidden_size: drafter 32 vs target 64"):
        load_drafter_proposer(tmp_path / "h32", target, "chain:3")
    state = {k: v for k, v in Eagle1Drafter(config).state_dict().items() if k != "fc.bias"}
    save_checkpoint(tmp_path / "partial", family="eagle1", config=asdict(config), target=target_info(target),
                    state_dict=state)
    with pytest.raises(CheckpointError, match="(?s)weights do not match.*fc.bias"):
        load_drafter_proposer(tmp_path / "partial", target, "chain:3")
