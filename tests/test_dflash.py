"""DFlash drafter (drafters.dflash), its objective (drafters.training.dflash) and its training through train/eagle.py: all blocks of a batch in one
pass == one block at a time on a cached context (the decoding path), and a leaky mask is caught; labels,
anchors and slot weights on hand-made inputs; the fused loss == the logits path == a hand computation;
golden losses of recipes/dflash_tiny.yaml, frozen target, checkpoint round trip, metrics, recipe checks."""

import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import train_tiny  # tests/ is on sys.path under pytest

from drafters import dflash
from drafters.checkpoint import load_checkpoint
from drafters.dflash import (
    DFlashCache,
    DFlashConfig,
    DFlashDrafter,
    block_attention_mask,
    eligible_anchors,
    sample_anchors,
)
from drafters.draft_vocab import DraftVocab
from drafters.eagle3 import fuse_features
from drafters.tiny import build_tiny_target
from drafters.losses import dpace_weights
from drafters.training.dflash import BlockLossOptions, block_loss, decay_weights
from drafters.training.loop import FeatureBatch
from drafters.training.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "dflash_tiny.yaml")
DATA = ROOT / "tests" / "data" / "tiny_conversations.jsonl"
VOCAB, BLOCK, STEPS = 259, 4, 6


def make_drafter(model, draft_vocab=64, block_size=BLOCK, num_layers=2, seed=0) -> DFlashDrafter:
    config = DFlashConfig.from_target_config(model.config, draft_vocab, mask_token_id=0, num_layers=num_layers,
                                             block_size=block_size)
    start = 3 if draft_vocab + 3 <= VOCAB else 0  # a reduced vocabulary skips the special ids
    vocab = DraftVocab.from_used(torch.arange(start, start + draft_vocab), VOCAB)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config, vocab).attach_head(model.get_output_embeddings().weight)
    with torch.no_grad():  # off the initialisation: norms away from 1, so a wrong norm shows
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.2)
    return drafter


@pytest.fixture(scope="module")
def setup(tiny_llama):
    model, _ = tiny_llama
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 24), generator=generator)
    loss_mask = torch.ones(2, 24, dtype=torch.long)
    loss_mask[:, :5] = 0  # a prompt
    loss_mask[1, 17:] = 0  # a shorter row (right padding)
    drafter = make_drafter(model)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    features = fuse_features(out.hidden_states, drafter.config.aux_layers)
    anchors, keep = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    return model, drafter, ids, loss_mask, features, out.logits, anchors, keep


def one_block_at_a_time(drafter, features, ids, embed, b, a):
    # the decoding path: context = features of positions 0..a-1 in the cache, then the block at a
    cache = DFlashCache()
    drafter.extend_context(features[b:b + 1, :a], cache)
    return drafter.draft(ids[b:b + 1, a], embed, cache)[1][0]  # (Bk-1, Vd)


@torch.no_grad()
def test_blocks_in_one_pass_equal_one_block_at_a_time_with_a_cached_context(setup):
    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    embed = model.get_input_embeddings()
    out = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep, return_logits=True)
    assert out.logits.shape == (2, anchors.shape[1], BLOCK - 1, 64)
    checked = 0
    for b in range(2):
        for n in range(anchors.shape[1]):
            if keep[b, n]:
                want = one_block_at_a_time(drafter, features, ids, embed, b, int(anchors[b, n]))
                torch.testing.assert_close(out.logits[b, n], want, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked >= 8


def leaky_context(anchors, keep, seq_len, block_size):  # WRONG: blocks also see the anchor's own feature
    mask = block_attention_mask(anchors, keep, seq_len, block_size)
    t = torch.arange(seq_len)
    at_anchor = (t[None, None] == anchors[..., None]).repeat_interleave(block_size, dim=1)  # (B, N*Bk, T)
    mask[:, 0, :, :seq_len] |= at_anchor
    return mask


def blocks_see_each_other(anchors, keep, seq_len, block_size):  # WRONG: every block slot is visible
    mask = block_attention_mask(anchors, keep, seq_len, block_size)
    mask[..., seq_len:] = True
    return mask


@pytest.mark.parametrize("wrong_mask", [leaky_context, blocks_see_each_other])
@torch.no_grad()
def test_the_comparison_catches_a_wrong_training_mask(setup, wrong_mask, monkeypatch):
    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    embed = model.get_input_embeddings()
    monkeypatch.setattr(dflash, "block_attention_mask", wrong_mask)
    out = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep, return_logits=True)
    worst = max(float((out.logits[b, n] - one_block_at_a_time(drafter, features, ids, embed, b, int(anchors[b, n])))
                      .abs().max()) for b in range(2) for n in range(anchors.shape[1]) if keep[b, n])
    assert worst > 1e-2


@torch.no_grad()
def test_context_in_chunks_equals_one_prefill(setup):
    model, drafter, ids, _, features, *_ = setup
    embed = model.get_input_embeddings()
    whole, chunks = DFlashCache(), DFlashCache()
    drafter.extend_context(features[:1, :15], whole)
    for a, b in [(0, 6), (6, 7), (7, 15)]:
        drafter.extend_context(features[:1, a:b], chunks)
    for k1, k2 in zip(whole.keys + whole.values, chunks.keys + chunks.values):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)  # GEMMs over 6 vs 15 rows: fp32 rounding
    _, got = drafter.draft(ids[:1, 15], embed, chunks)
    torch.testing.assert_close(got, drafter.draft(ids[:1, 15], embed, whole)[1])


def test_anchors_are_eligible_distinct_sorted_and_reproducible():
    loss_mask = torch.zeros(3, 12, dtype=torch.long)
    loss_mask[0, 4:10] = 1  # eligible: 4..8 (a and a+1 learnt)
    loss_mask[1, 2:4] = 1  # eligible: 2 only
    # row 2: nothing learnt -> no block
    assert eligible_anchors(loss_mask)[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    anchors, keep = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(0))
    assert anchors.shape == keep.shape == (3, 3)
    assert keep.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    row = anchors[0].tolist()
    assert len(set(row)) == 3 and row == sorted(row) and set(row) <= {4, 5, 6, 7, 8}
    assert anchors[1, 0] == 2
    again, _ = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    draws = {tuple(sample_anchors(loss_mask, 3, torch.Generator().manual_seed(s))[0][0].tolist()) for s in range(40)}
    assert len(draws) > 5  # random, not the first three


def test_slot_weights_decay_from_the_first_draft():
    w = decay_weights(5, 2.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])


@torch.no_grad()
def test_labels_are_the_targets_rows_before_each_slot(tiny_llama):
    # hand-made target logits: row r's argmax is token 10 + r; anchors 2 and 5 of a 10-token row whose
    # tokens 3..8 are learnt: slot j of the block at a is labelled 10 + (a + j - 1), counted iff token a + j
    # is learnt and inside the row
    model, _ = tiny_llama
    drafter = make_drafter(model, draft_vocab=VOCAB)  # full vocabulary: draft id == target id
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.zeros(1, 10, dtype=torch.long)
    loss_mask[0, 3:9] = 1
    target_logits = torch.full((1, 10, VOCAB), -5.0)
    target_logits[0, torch.arange(10), 10 + torch.arange(10)] = 5.0
    features = torch.randn(1, 10, 3 * 64)
    anchors, keep = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    out = block_loss(drafter, FeatureBatch(features, ids, target_logits, loss_mask, model.get_input_embeddings()),
                     anchors, keep, return_logits=True)
    # block at 2: slots 1..3 -> tokens 3, 4, 5 (all learnt) -> rows 2, 3, 4
    # block at 5: slots 1..3 -> tokens 6, 7, 8 (learnt) -> rows 5, 6, 7
    assert out.labels[0].tolist() == [[12, 13, 14], [15, 16, 17]]
    loss_mask[0, 7] = 0  # token 7 no longer learnt: slot 2 of the block at 5 is not counted
    out = block_loss(drafter, FeatureBatch(features, ids, target_logits, loss_mask, model.get_input_embeddings()),
                     anchors, keep, return_logits=True)
    assert out.labels[0].tolist() == [[12, 13, 14], [15, -1, 17]]
    assert out.step_counts.tolist() == [2, 1, 2] and out.step_supervised.tolist() == [2, 1, 2]
    # the block's own tokens: the anchor, then masks
    assert dflash.block_ids(ids, anchors, BLOCK, 0)[0].tolist() == [[int(ids[0, 2]), 0, 0, 0],
                                                                    [int(ids[0, 5]), 0, 0, 0]]


@torch.no_grad()
def test_fused_loss_equals_the_logits_path_and_a_hand_computation(setup):
    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    drafter = make_drafter(model, draft_vocab=VOCAB)  # every target argmax is in the vocabulary: all counted
    embed, gamma = model.get_input_embeddings(), 2.0
    fused = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                       BlockLossOptions(gamma=gamma))
    plain = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                       BlockLossOptions(gamma=gamma), return_logits=True)
    torch.testing.assert_close(fused.loss, plain.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.step_losses, plain.step_losses, atol=1e-5, rtol=1e-5)
    # by hand: sum over counted slots of w_j * CE(softmax(target row a+j-1) || draft) / sum of their w_j
    num, den = 0.0, 0.0
    for b in range(2):
        for n in range(anchors.shape[1]):
            for j in range(1, BLOCK):
                a = int(anchors[b, n])
                if not keep[b, n] or a + j >= ids.shape[1] or not loss_mask[b, a + j]:
                    assert plain.labels[b, n, j - 1] == -1
                    continue
                p = logits[b, a + j - 1].softmax(-1)
                ce = -(p * plain.logits[b, n, j - 1].log_softmax(-1)).sum()
                num, den = num + math.exp(-(j - 1) / gamma) * ce, den + math.exp(-(j - 1) / gamma)
    assert den > 0
    torch.testing.assert_close(plain.loss, torch.as_tensor(num / den, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    hard = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                      BlockLossOptions(gamma=gamma, labels="argmax"))  # CE against the one-hot argmax: another loss
    assert not torch.isclose(hard.loss, plain.loss) and hard.loss > 0


def test_dpace_weights_on_hand_made_blocks():
    # q = (0.5, 0.2, 0.9), alpha 0.5: s = (0.75, 0.6, 0.95), P = (0.75, 0.45, 0.4275), w_j = sum_{m >= j} P_m
    q = torch.tensor([[[0.5, 0.2, 0.9]]])
    every = torch.ones(1, 1, 3, dtype=torch.bool)
    torch.testing.assert_close(dpace_weights(q, every, 0.5), torch.tensor([[[1.6275, 0.8775, 0.4275]]]))
    # slot 2 not counted: s_2 = 1 (P carries through) and P_2 is left out of the sums
    middle_out = torch.tensor([[[True, False, True]]])
    torch.testing.assert_close(dpace_weights(q, middle_out, 0.5), torch.tensor([[[0.75 + 0.7125, 0.7125, 0.7125]]]))
    # alpha 1: every prefix is 1, a slot weighs the counted slots from it to the block's end
    torch.testing.assert_close(dpace_weights(q, middle_out, 1.0), torch.tensor([[[2.0, 1.0, 1.0]]]))


@torch.no_grad()
def test_dpace_loss_equals_a_hand_computation(setup):
    # per block: q_j = softmax(draft logits of slot j)[target argmax], s_j = (1 - alpha) q_j + alpha at counted slots,
    # P_j = prod s, w_j = sum_{m >= j, counted} P_m; loss = sum over counted slots of w_j CE_j / sum of their w_j
    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    drafter = make_drafter(model, draft_vocab=VOCAB)
    embed, alpha = model.get_input_embeddings(), 0.3
    out = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                     BlockLossOptions(weighting="dpace", dpace_alpha=alpha), return_logits=True)
    num, den = 0.0, 0.0
    for b in range(2):
        for n in range(anchors.shape[1]):
            prefix, slots = 1.0, []
            for j in range(1, BLOCK):
                a = int(anchors[b, n])
                if not keep[b, n] or a + j >= ids.shape[1] or not loss_mask[b, a + j]:
                    continue
                p, log_q = logits[b, a + j - 1].softmax(-1), out.logits[b, n, j - 1].log_softmax(-1)
                prefix *= (1 - alpha) * float(log_q[p.argmax()].exp()) + alpha
                slots.append((prefix, float(-(p * log_q).sum())))
            for i, (_, ce) in enumerate(slots):
                weight = sum(prefix for prefix, _ in slots[i:])
                num, den = num + weight * ce, den + weight
    assert den > 0
    torch.testing.assert_close(out.loss, torch.as_tensor(num / den, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    decayed = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep)
    assert not torch.isclose(decayed.loss, out.loss)  # another weighting, another loss
    torch.testing.assert_close(out.step_losses, decayed.step_losses, atol=1e-5, rtol=1e-5)  # the same slots' CE


@pytest.mark.parametrize("rows", [1, 5])
def test_the_label_side_in_chunks_gives_the_same_loss_and_gradients(setup, rows, monkeypatch):
    # the target's full-vocabulary logits at the supervised rows are computed `rows` at a time (LabelLogits through
    # drafters.losses.label_chunks), never all at once: the loss and every gradient equal the whole tensor's
    import drafters.losses as losses
    from drafters.losses import LabelLogits

    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    embed = model.get_input_embeddings()
    hidden = model(ids, output_hidden_states=True).hidden_states[-1].detach()

    def loss_and_grads(target_logits):
        drafter.zero_grad()
        out = block_loss(drafter, FeatureBatch(features, ids, target_logits, loss_mask, embed), anchors, keep)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    whole, whole_grads = loss_and_grads(logits)
    monkeypatch.setattr(losses, "LABEL_CHUNK_ROWS", rows)
    chunked, chunked_grads = loss_and_grads(LabelLogits(hidden, model.get_output_embeddings()))
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    assert whole_grads.keys() == chunked_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6)


def test_state_dict_names_are_the_serving_names(setup):
    drafter = setup[1]
    layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
             "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
             "post_attention_layernorm"]
    want = {"fc.weight", "hidden_norm.weight", "norm.weight", "d2t", "t2d"}
    want |= {f"layers.{i}.{name}.weight" for i in range(2) for name in layer}
    assert set(drafter.state_dict()) == want  # no LM head, no embedding: both are the target's


def test_logits_need_the_targets_head(tiny_llama):
    config = DFlashConfig.from_target_config(tiny_llama[0].config, 64, mask_token_id=0)
    with pytest.raises(RuntimeError, match="attach_head"):
        DFlashDrafter(config).compute_logits(torch.zeros(1, 64))


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 1}, "block_size=1 must be >= 2"),
    ({"num_layers": 0}, "num_layers=0 must be >= 1"),
    ({"mask_token_id": 259}, r"mask_token_id=259 must be a token id in \[0, 259\)"),
    ({"layers": [2, 4, 9]}, "DFlash: .*HF hidden_states indices"),
])
def test_config_refuses_what_cannot_work(tiny_llama, kwargs, message):
    kwargs = {"mask_token_id": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_target_config(tiny_llama[0].config, 64, **kwargs)


# ---------------------------------------------------------------- train/eagle.py drafter: dflash

# Recorded once from recipes/dflash_tiny.yaml as it is (6 steps of batch 2 x grad_accum 2, block 4, 2
# layers, 8 anchors per row, gamma 4, draft vocab 259, lr 1e-3 with 2 warmup steps then cosine, seed 0)
# with one CPU thread:
#   OMP_NUM_THREADS=1 python train/eagle.py recipes/dflash_tiny.yaml output_dir=/tmp/dft
#   -> the "loss" column of /tmp/dft/metrics.jsonl (torch 2.13.0 CPU, transformers 5.23.0).
# The tiny random target's distributions are nearly uniform (ln 259 = 5.557): the losses sit near it.
GOLDEN_LOSSES = [5.567648887634277, 5.563053131103516, 5.556520938873291, 5.554569244384766,
                 5.554736614227295, 5.5525102615356445]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory, RECIPE, f"data.path={DATA}")


def test_reproduces_golden_losses(run):
    summary, output_dir = run
    assert summary.steps == STEPS
    assert summary.losses == pytest.approx(GOLDEN_LOSSES, rel=1e-5)
    assert [row["loss"] for row in read_jsonl(output_dir / "metrics.jsonl")] == summary.losses


def test_target_weights_unchanged(run):
    summary, _ = run
    fresh, _ = build_tiny_target("tiny-random-llama")
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(summary.target.model.state_dict()[name], tensor), name
    assert not any(p.requires_grad for p in summary.target.model.parameters())
    head = summary.target.lm_head.weight
    assert torch.equal(summary.drafter.head, head[summary.drafter.draft_vocab.used])  # the frozen head rows


def test_checkpoint_rebuilds_the_trained_drafter(run):
    summary, output_dir = run
    checkpoint = load_checkpoint(output_dir / "checkpoint-final", family="dflash")
    config = checkpoint.config
    assert (config["block_size"], config["num_hidden_layers"], config["aux_layers"]) == (4, 2, [2, 4, 5])
    assert config["mask_token_id"] == 0  # <|endoftext|>: no training row contains it
    assert not [k for k in checkpoint.state_dict if "embed" in k or "head" in k], "the target's own weights"
    assert checkpoint.extra["step"] == STEPS and checkpoint.extra["recipe"]["dflash"]["anchors"] == 8
    rebuilt = DFlashDrafter(DFlashConfig(**config)).attach_head(summary.target.lm_head.weight)
    rebuilt.load_state_dict(checkpoint.state_dict)
    trained = summary.drafter
    features = torch.randn(1, 9, 3 * 64, generator=torch.Generator().manual_seed(1))
    embed = summary.target.embed_tokens
    with torch.no_grad():
        outs = []
        for drafter in (trained, rebuilt):
            cache = DFlashCache()
            drafter.extend_context(features, cache)
            outs.append(drafter.draft(torch.tensor([65]), embed, cache)[1])
    assert torch.equal(*outs)
    assert asdict(trained.config) == config


def test_metrics_and_held_out_evaluation(run):
    summary, output_dir = run
    rows = read_jsonl(output_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert len(row["step_loss"]) == len(row["step_acc"]) == BLOCK - 1  # one per drafted slot
        assert min(row["step_loss"]) - 1e-4 <= row["loss"] <= max(row["step_loss"]) + 1e-4  # a weighted mean
    results = read_jsonl(output_dir / "eval.jsonl")
    assert [r["step"] for r in results] == [3, STEPS]
    final = summary.eval
    assert final == results[-1] and final["blocks"] == 4 * 8  # 4 held-out rows, 8 anchors each
    assert len(final["step_acc"]) == BLOCK - 1 and 1 <= final["tau_pred"] <= BLOCK


def test_resumed_run_draws_the_same_anchors_and_ends_with_the_same_weights(trainer, run, tmp_path):
    # the run's checkpoint-4 holds the anchor generator's state (a buffer of the objective): resuming it
    # must redo steps 5 and 6 exactly (tests/test_resume.py does the same for EAGLE-3, killed mid-run)
    summary, output_dir = run
    copy = shutil.copytree(output_dir, tmp_path / "resumed")
    shutil.rmtree(copy / "checkpoint-final")
    resumed = trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={copy}", "resume_from=latest"])
    assert resumed.losses == summary.losses
    want, got = (load_checkpoint(d / "checkpoint-final").state_dict for d in (output_dir, copy))
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("override, message", [
    ("dflash.block_size=1", "dflash.block_size=1 must be >= 2"),
    ("dflash.anchors=0", "dflash.anchors=0 must be >= 1"),
    ("dflash.gamma=0", "dflash.gamma=0.0 must be > 0|dflash.gamma=0 must be > 0"),
    ("dflash.labels=hard", "dflash.labels"),
    ("dflash.weighting=focal", "'focal' is not one of 'decay', 'dpace'"),
    ("dflash.dpace_alpha=2", r"dflash.dpace_alpha=2.0 must be in \[0, 1\]"),
    ("dflash.mask_token_id=300", "dflash.mask_token_id=300 is not a token id of the target"),
])
def test_bad_dflash_values_fail_clearly(trainer, tmp_path, override, message):
    with pytest.raises(RecipeError, match=message):
        trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path}", override])


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
