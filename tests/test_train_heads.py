"""train/heads.py on the tiny recipes (Medusa-1 and Blockwise): golden losses, frozen target, only
the heads train, checkpoint round trip with the calibrated tree, per-head metrics, held-out
calibration; trained heads in the shared decoder stay lossless; bad recipes and checkpoints fail
clearly."""

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import (continuations, fit_drafter, greedy_reference, load_script, save_drafter,  # tests/ on sys.path
                      untied_llama)

from drafters.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from drafters.decode.decoder import speculative_generate
from drafters.heads import heads_loss
from drafters.training.heads_tree import expected_tau
from drafters.medusa import MedusaConfig, MedusaHeads
from drafters.decode.proposers.heads import HeadsProposer
from drafters.registry import load_drafter
from drafters.decode.proposers.loading import load_drafter_proposer, load_proposer
from drafters.training.recipe import RecipeError
from drafters.decode.sampling import SamplingConfig, warp
from drafters.targets import TargetFeatures, load_target
from drafters.tiny import build_tiny_target
from drafters.decode.tree import parse_tree_spec

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_conversations.jsonl"
K, STEPS, VOCAB = 3, 6, 259

# Recorded once from the tiny recipes as they are (6 steps of batch 2 x grad_accum 2, 3 heads, seed 0)
# with one CPU thread:
#   OMP_NUM_THREADS=1 python train/heads.py recipes/medusa_tiny.yaml output_dir=/tmp/m
#   -> the "loss" column of /tmp/m/metrics.jsonl (torch 2.13.0 CPU, transformers 5.23.0); same for
#   blockwise_tiny.yaml. Changing a recipe, the data, the batching, the heads' initialisation or
#   their loss changes them.
GOLDEN_LOSSES = {
    "medusa": [13.610015869140625, 13.55917739868164, 13.26508903503418, 13.224740982055664, 13.13717269897461,
               12.82944393157959],
    "blockwise": [5.580867290496826, 5.5523881912231445, 5.360175132751465, 5.326173782348633, 5.0674896240234375,
                  4.842193126678467],
}


@pytest.fixture(scope="module")
def heads_script():
    return load_script("train/heads.py")


@pytest.fixture(scope="module", params=["medusa", "blockwise"])
def run(request, heads_script, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp(request.param)
    recipe = str(ROOT / "recipes" / f"{request.param}_tiny.yaml")
    summary = heads_script.main([recipe, f"data.path={DATA}", f"output_dir={output_dir}"])
    return request.param, summary, output_dir


def test_reproduces_golden_losses(run):
    family, summary, output_dir = run
    assert summary.steps == STEPS
    assert summary.losses == pytest.approx(GOLDEN_LOSSES[family], rel=1e-4)
    assert [row["loss"] for row in read_jsonl(output_dir / "metrics.jsonl")] == summary.losses


def test_target_untouched_and_only_the_heads_train(run):
    family, summary, output_dir = run
    fresh, _ = build_tiny_target("tiny-random-llama")
    trained_with = summary.target.model.state_dict()
    assert trained_with.keys() == fresh.state_dict().keys()
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(trained_with[name], tensor), name  # bit-identical after training
    assert not any(p.requires_grad for p in summary.target.model.parameters())
    names = {name for name, _ in summary.drafter.named_parameters()}
    if family == "medusa":  # 2 separate blocks per head + each head's own LM head
        expected = {f"heads.{k}.blocks.{j}.linear.{p}" for k in range(K) for j in range(2) for p in ("weight", "bias")}
        expected |= {f"heads.{k}.lm_head.weight" for k in range(K)}
        head = summary.drafter.heads[0].lm_head.weight
        assert not torch.equal(head, summary.target.lm_head.weight)  # trained away from the target's copy
    else:  # one hidden layer; the vocabulary projection is the frozen target's
        expected = {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert names == expected
    assert load_checkpoint(output_dir / "checkpoint-final").state_dict.keys() == expected  # nothing of the target


def test_checkpoint_rebuilds_the_heads_and_carries_the_calibrated_tree(run):
    family, summary, output_dir = run
    ckpt = load_checkpoint(output_dir / "checkpoint-final", family=family)
    rebuilt = load_drafter(ckpt)
    for name, tensor in summary.drafter.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    assert ckpt.config["num_heads"] == K and ckpt.target["name"] == "tiny-random-llama"
    assert ckpt.extra["step"] == STEPS and ckpt.extra["tokens"] == summary.tokens > 0
    tree = ckpt.extra["tree"]
    assert tree == summary.eval["tree"] and tree["kind"] == "greedy" and 1 <= tree["draft_nodes"] <= 12
    assert json.loads((output_dir / "checkpoint-final" / "tree.json").read_text()) == tree["paths"]
    assert max(len(p) for p in tree["paths"]) <= K


def test_metrics_have_per_head_lists(run):
    family, _, output_dir = run
    rows = read_jsonl(output_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert len(row["step_loss"]) == len(row["step_acc"]) == len(row["step_acc_top5"]) == K
        assert row["step_loss_is"] == "per head"
        assert all(0 <= a <= b <= 1 for a, b in zip(row["step_acc"], row["step_acc_top5"]))
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and math.isfinite(row["grad_norm"])
        if family == "medusa":  # sum_k 0.8^k CE_k
            weighted = sum(0.8 ** k * loss for k, loss in enumerate(row["step_loss"]))
        else:  # sample_one: one head per micro-batch (2 per step), weight 1
            assert 1 <= sum(loss > 0 for loss in row["step_loss"]) <= 2
            weighted = sum(row["step_loss"])
        assert row["loss"] == pytest.approx(weighted, rel=1e-5)


def test_held_out_calibration(run):
    family, summary, output_dir = run
    results = read_jsonl(output_dir / "eval.jsonl")
    assert [r["step"] for r in results] == ([3, STEPS] if family == "medusa" else [STEPS])
    final = summary.eval
    assert final == results[-1]
    rank_acc = final["rank_acc"]  # (K, max(topk, 5))
    assert len(rank_acc) == K and all(len(row) == 5 for row in rank_acc)
    assert final["head_top1"] == [row[0] for row in rank_acc]
    assert final["head_top5"] == pytest.approx([sum(row[:5]) for row in rank_acc])
    assert all(sum(row) <= 1 + 1e-9 for row in rank_acc)  # ranks hold distinct tokens
    assert final["supervised"][0] > 0
    acc = [row[:4] for row in rank_acc]  # tree.topk: 4
    assert final["tau_pred"] == pytest.approx(expected_tau(final["tree"]["paths"], acc))
    assert final["tau_pred_chain"] == pytest.approx(1 + sum(math.prod(r[0] for r in rank_acc[:d])
                                                            for d in range(1, K + 1)))


# ---------------------------------------------------------------- decoding with trained heads




@pytest.mark.parametrize("tree", [None, "chain:3", "dynamic:total=8,depth=3,topk=3"])
def test_trained_checkpoint_decodes_losslessly(run, tree):
    # the checkpoint of the run, through the proposer registry; None = its calibrated tree
    _, _, output_dir = run
    target = untied_llama()
    prompts = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    references = greedy_reference(target.model, prompts, 20)
    path = output_dir / "checkpoint-final"
    proposer = (load_drafter_proposer(path, target) if tree is None
                else load_proposer(str(path), target, parse_tree_spec(tree)))
    for prompt, reference in zip(prompts, references):
        out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=20)
        assert out.tolist() == reference.tolist()
        assert 1 + sum(a + 1 for a in stats.accepted) == 20


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    # Medusa heads fitted for a few seconds to the untied target's own greedy continuations, so
    # drafts are often accepted and multi-token paths are exercised; saved as a checkpoint.
    target = untied_llama()
    references, loss_mask = continuations(target, 10, seed=1)  # (6, 50)
    hidden = target.features(references, logits=False).last_hidden
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=VOCAB, num_heads=K))
    heads.init_from_target(target.lm_head.weight)
    weights = {k: 0.8 ** k for k in range(K)}
    fit_drafter(heads, lambda _: heads_loss(heads, hidden, references, loss_mask, target.lm_head.weight,
                                            weights=weights).loss, 60)
    tree = {"kind": "greedy", "paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]], "expected_tau": 0, "draft_nodes": 5}
    return target, references, save_drafter(tmp_path_factory.mktemp("fitted") / "medusa", "medusa", heads, target,
                                            tree=tree)


@pytest.mark.parametrize("tree", [None, "chain:3", "static:[[0],[1],[2],[0,0],[1,0],[0,0,0]]",
                                  "dynamic:total=10,depth=3,topk=3"])
def test_fitted_heads_are_accepted_and_lossless(fitted, tree):
    target, references, path = fitted
    proposer = load_drafter_proposer(path, target, tree)
    taus = []
    for row in range(2):
        out, stats = speculative_generate(target, proposer, references[row, :10], max_new_tokens=30)
        assert out.tolist() == references[row, :40].tolist()
        taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.5  # fitted to these continuations: drafts are often accepted


@torch.no_grad()
def test_sampled_trees_say_what_they_were_drawn_from(fitted):
    # every draft at depth d was drawn from q = warp(head d-1's logits at x_t); draft_probs holds q
    target, references, path = fitted
    proposer = load_drafter_proposer(path, target, "static:[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]")
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    prompt = references[0, :10]
    out = target.model(prompt[None], output_hidden_states=True)
    proposer.reset(prompt, TargetFeatures({}, out.hidden_states[-1], None, out.logits))
    q = warp(proposer.head_logits(K), sampling)  # (K, V)
    for _ in range(5):
        tree = proposer.propose(prompt, 7, sampling)
        assert int(tree.tokens[0]) == 7
        for node in range(1, tree.num_nodes):
            depth = tree.depth_list[node]
            torch.testing.assert_close(tree.draft_probs[node], q[depth - 1])
            assert q[depth - 1][tree.tokens[node]] > 0
        assert all(len({int(tree.tokens[c]) for c in kids}) == len(kids) for kids in tree.children)
    generated, stats = speculative_generate(target, proposer, prompt, max_new_tokens=30, sampling=sampling,
                                            generator=torch.Generator().manual_seed(0))
    assert generated.shape == (40,) and 1 + sum(a + 1 for a in stats.accepted) == 30


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides, message", [
    (["num_heads=127"], "num_heads=127 needs data.max_length >= num_heads \\+ 2 = 129"),
    (["data.limit=4", "data.eval_rows=1", "num_heads=90"], "no training example has a target token at position >= 91"),
    (["blockwise.loss=sample_one"], "blockwise.loss=sample_one is read by drafter: blockwise only, not medusa"),
    (["tree.kind=cartesian", "tree.cartesian=[2, 2, 2, 2]"], "tree.cartesian=\\[2, 2, 2, 2\\] must list 1..num_heads=3"),
    (["drafter=eagle"], "drafter='eagle' is not a family this trainer trains; choose one of eagle3"),
    (["medusa.num_heads=3"], "unknown key 'num_heads'"),
])
def test_bad_recipes_fail_clearly(heads_script, tmp_path, overrides, message):
    recipe = str(ROOT / "recipes" / "medusa_tiny.yaml")
    with pytest.raises(RecipeError, match=message):
        heads_script.main([recipe, f"data.path={DATA}", f"output_dir={tmp_path}", *overrides])


def test_checkpoint_target_mismatch_and_bad_trees_fail_clearly(fitted, tmp_path):
    target, _, path = fitted
    gemma = load_target("tiny-random-gemma3")  # same hidden and vocab sizes, another model
    with pytest.raises(CheckpointError, match="model_type: checkpoint llama vs target gemma3_text"):
        load_proposer(str(path), gemma, parse_tree_spec("chain:2"))
    ckpt = load_checkpoint(path)
    save_checkpoint(tmp_path / "wide", family="medusa", config={**ckpt.config, "hidden_size": 32},
                    target=ckpt.target, state_dict=ckpt.state_dict)
    with pytest.raises(CheckpointError, match="weights do not match the drafter config"):
        load_drafter_proposer(tmp_path / "wide", target, "chain:2")
    narrow = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=VOCAB, num_heads=K))  # fits its config, not the target
    save_checkpoint(tmp_path / "narrow", family="medusa", config=asdict(narrow.config), target=ckpt.target,
                    state_dict=narrow.state_dict())
    with pytest.raises(CheckpointError, match="hidden_size: drafter 32 vs target 64"):
        load_drafter_proposer(tmp_path / "narrow", target, "chain:2")
    with pytest.raises(ValueError, match="tree of depth 4 for a drafter with 3 heads"):
        load_drafter_proposer(path, target, "chain:4")
    save_checkpoint(tmp_path / "untreed", family="medusa", config=ckpt.config, target=ckpt.target,
                    state_dict=ckpt.state_dict)
    with pytest.raises(CheckpointError, match="no calibrated tree in the checkpoint"):
        load_drafter_proposer(tmp_path / "untreed", target)
    with pytest.raises(RuntimeError, match="call reset"):
        HeadsProposer(load_drafter(ckpt), target.lm_head.weight, parse_tree_spec("chain:2")).propose(
            torch.tensor([1, 2]), 3, SamplingConfig())


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
