"""DSpark (drafters.dspark): DFlash's block plus a Markov head and a confidence head.

- training (teacher-forced prev tokens, all blocks in one pass) == drafting one block on a cached context with
  the Markov bias of the same tokens, and W2 = 0 gives exactly DFlash's logits (DSpark starts as DFlash);
- the proposer drafts each node's children from its own token's bias: a chain is the greedy slot-by-slot chain,
  siblings' subtrees differ; sampled draft_probs are each node's own distribution;
- sampled decoding reproduces the target's distribution (chi-square); the confidence gate cuts chains and stays
  lossless;
- the tiny recipe trains through train/eagle.py (golden losses, resume draws the same anchors), the confidence
  loss is the BCE against 1 - TV; bad input gets one sentence.
Greedy == generate on chains and static trees, the export round trip and the fit refusal are
tests/test_contracts.py's; llama.cpp's acceptance against ours is tests/test_llama_cpp.py's.
"""

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (continuations, fit_drafter, fused_batch, save_drafter, train_tiny,  # tests/ on sys.path
                      untied_llama)
from test_sampling import first_two_tokens_pvalue
from transformers import GenerationConfig

from drafters.checkpoint import load_checkpoint, save_checkpoint
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.loading import load_proposer, proposer_from_checkpoint
from drafters.decode.sampling import SamplingConfig, warp
from drafters.decode.tree import parse_tree_spec
from drafters.dflash import DFlashCache, DFlashConfig, DFlashDrafter, block_prev_ids, sample_anchors
from drafters.draft_vocab import DraftVocab, build_draft_vocab
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.eagle3 import fuse_features
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.targets import TargetFeatures
from drafters.training.dflash import BlockLossOptions, block_loss
from drafters.training.loop import FeatureBatch
from drafters.training.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "dspark_tiny.yaml")
VOCAB, BLOCK, PROMPT = 259, 5, 12


def make_drafter(model, draft_vocab=64, seed=0, confidence=True) -> DSparkDrafter:
    config = DSparkConfig.from_target_config(model.config, draft_vocab, mask_token_id=0, num_layers=2,
                                             block_size=BLOCK, markov_rank=8, confidence_head=confidence)
    vocab = DraftVocab.from_used(torch.arange(3, 3 + draft_vocab), VOCAB)
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config, vocab).attach_head(model.get_output_embeddings().weight)
    with torch.no_grad():  # every weight off its initialisation, W2 off zero
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
    drafter = make_drafter(model)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    features = fuse_features(out.hidden_states, drafter.config.aux_layers)
    anchors, keep = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    return model, drafter, ids, loss_mask, features, out.logits, anchors, keep


@torch.no_grad()
def test_training_blocks_equal_one_block_drafted_with_the_markov_bias_of_the_true_tokens(setup):
    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    embed = model.get_input_embeddings()
    out = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep, return_logits=True)
    prev = block_prev_ids(ids, anchors, BLOCK)
    checked = 0
    for b in range(2):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            if not keep[b, n] or a + BLOCK > ids.shape[1]:
                continue
            cache = DFlashCache()
            drafter.extend_context(features[b:b + 1, :a], cache)
            normed, _ = drafter.draft(ids[b:b + 1, a], embed, cache)
            assert prev[b, n].tolist() == ids[b, a:a + BLOCK - 1].tolist()  # slot j's prev: token a+j-1
            want = drafter.slot_logits(normed[0, 1:], ids[b, a:a + BLOCK - 1])
            torch.testing.assert_close(out.logits[b, n], want, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked >= 6


@torch.no_grad()
def test_zero_markov_weights_give_dflash_logits_and_a_fresh_drafter_starts_there(tiny_llama):
    model, _ = tiny_llama
    dflash_config = DFlashConfig.from_target_config(model.config, 64, mask_token_id=0, num_layers=2, block_size=BLOCK)
    config = DSparkConfig(**asdict(dflash_config), markov_rank=8)
    vocab = DraftVocab.from_used(torch.arange(3, 67), VOCAB)
    torch.manual_seed(0)
    plain = DFlashDrafter(dflash_config, vocab).attach_head(model.get_output_embeddings().weight)
    torch.manual_seed(0)
    spark = DSparkDrafter(config, vocab).attach_head(model.get_output_embeddings().weight)
    assert not spark.markov_head.markov_w2.weight.any()  # W2 starts at zero
    features = torch.randn(1, 9, 3 * 64)
    caches = DFlashCache(), DFlashCache()
    for drafter, cache in zip((plain, spark), caches):
        drafter.extend_context(features, cache)
    pending = torch.tensor([7])
    _, base = plain.draft(pending, model.get_input_embeddings(), caches[0])
    spark_normed, _ = spark.draft(pending, model.get_input_embeddings(), caches[1])
    torch.testing.assert_close(spark.slot_logits(spark_normed[0, 1:], torch.tensor([7, 8, 9, 10])), base[0])


def test_confidence_loss_is_the_bce_against_one_minus_total_variation(setup):
    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    embed = model.get_input_embeddings()
    without = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                         BlockLossOptions(confidence_weight=0.0))
    weighted = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                          BlockLossOptions(confidence_weight=2.0))
    # by hand: sum_j w_j sum BCE(conf_j, 1 - TV(q_j, p_j)) / sum_j w_j count_j over the counted slots
    out = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep, return_logits=True)
    counted = out.labels >= 0  # (B, N, Bk-1)
    normed = drafter.block_unroll(features, ids, embed, anchors, keep)[:, :, 1:]
    prev = block_prev_ids(ids, anchors, BLOCK)
    from drafters.dflash import block_label_mask, block_label_rows
    from drafters.training.dflash import decay_weights, supervised_block_targets

    index, (target_p, _) = supervised_block_targets(drafter, logits, block_label_rows(anchors, BLOCK),
                                                    block_label_mask(anchors, keep, loss_mask, BLOCK), ids.shape[1])
    w = decay_weights(BLOCK, 4.0)[1:]
    total, bce = 0.0, 0.0
    for j in range(BLOCK - 1):
        c = counted[:, :, j]
        q = torch.softmax(out.logits[:, :, j][c], -1)
        accept = 1 - 0.5 * (q - target_p[index[:, :, j][c]]).abs().sum(-1)
        conf = drafter.confidence_logits(normed[:, :, j][c], prev[:, :, j][c])
        bce = bce + w[j] * F.binary_cross_entropy_with_logits(conf, accept.detach(), reduction="sum")
        total = total + w[j] * c.sum()
    torch.testing.assert_close(weighted.loss - without.loss, 2.0 * bce / total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weighted.step_losses, without.step_losses)  # the CE parts are unchanged


@torch.no_grad()
def test_dpace_weighs_the_markov_biased_slots_and_keeps_the_decayed_confidence_loss(setup):
    # weighting=dpace on DSpark: the CE part is D-PACE's weighted mean over the slots' logits WITH the Markov bias
    # (by hand below), and the confidence term is the decay's, as without D-PACE
    from drafters.dflash import block_label_mask, block_label_rows
    from drafters.training.dflash import supervised_block_targets

    model, drafter, ids, loss_mask, features, logits, anchors, keep = setup
    embed, alpha = model.get_input_embeddings(), 0.5
    dp0 = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                     BlockLossOptions(confidence_weight=0.0, weighting="dpace", dpace_alpha=alpha), return_logits=True)
    index, (target_p, _) = supervised_block_targets(drafter, logits, block_label_rows(anchors, BLOCK),
                                                    block_label_mask(anchors, keep, loss_mask, BLOCK), ids.shape[1])
    num, den = 0.0, 0.0
    for b in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            prefix, slots = 1.0, []
            for j in range(BLOCK - 1):
                if dp0.labels[b, n, j] < 0:
                    continue
                log_q = dp0.logits[b, n, j].log_softmax(-1)
                prefix *= (1 - alpha) * float(log_q[dp0.labels[b, n, j]].exp()) + alpha
                slots.append((prefix, float(-(target_p[index[b, n, j]] * log_q).sum())))
            for i, (_, ce) in enumerate(slots):
                weight = sum(prefix for prefix, _ in slots[i:])
                num, den = num + weight * ce, den + weight
    assert den > 0
    torch.testing.assert_close(dp0.loss, torch.as_tensor(num / den, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    dp2 = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                     BlockLossOptions(confidence_weight=2.0, weighting="dpace", dpace_alpha=alpha))
    without = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                         BlockLossOptions(confidence_weight=0.0))
    weighted = block_loss(drafter, FeatureBatch(features, ids, logits, loss_mask, embed), anchors, keep,
                          BlockLossOptions(confidence_weight=2.0))
    torch.testing.assert_close(dp2.loss - dp0.loss, weighted.loss - without.loss, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- the proposer


def trained(tmp_path_factory, steps=100):
    target = untied_llama()
    rows, loss_mask = continuations(target, PROMPT)
    vocab = build_draft_vocab([(rows, loss_mask)], VOCAB, 48)
    dconfig = DSparkConfig.from_target_config(target.config, 48, mask_token_id=0, num_layers=1, block_size=BLOCK,
                                              markov_rank=8, confidence_head=True)
    torch.manual_seed(0)
    drafter = DSparkDrafter(dconfig, vocab).attach_head(target.lm_head.weight)
    batch = fused_batch(target, rows, loss_mask, dconfig.aux_layers)
    generator = torch.Generator().manual_seed(0)  # the anchors
    fit_drafter(drafter, lambda _: block_loss(drafter, batch, *sample_anchors(loss_mask, 16, generator)).loss, steps)
    return target, rows, save_drafter(tmp_path_factory.mktemp("dspark") / "ckpt", "dspark", drafter, target, step=steps)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained(tmp_path_factory)


def ready(checkpoint, tree, **options):
    target, rows, path = checkpoint
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree, **options)
    prompt = rows[0, :PROMPT]
    with torch.no_grad():
        out = target.model(prompt[None], output_hidden_states=True)
    layers = proposer.needs.layers
    proposer.reset(prompt, TargetFeatures({i: out.hidden_states[i] for i in layers}, out.hidden_states[-1], None,
                                          out.logits))
    return proposer, prompt, int(rows[0, PROMPT])


@torch.no_grad()
def by_hand(proposer, pending):
    normed, base = proposer.drafter.draft(torch.tensor([pending]), proposer.embed, proposer.cache)
    return normed[0, 1:], base[0]  # (B-1, h), (B-1, Vd)


@torch.no_grad()
def test_chain_is_drafted_slot_by_slot_on_its_own_argmax(checkpoint):
    proposer, prompt, pending = ready(checkpoint, "chain:4")
    tree = proposer.propose(prompt, pending, SamplingConfig())
    _, base = by_hand(proposer, pending)
    prev, want = pending, [pending]
    for j in range(4):
        bias, _ = proposer.drafter.markov_head(torch.tensor([prev]))
        prev = int(proposer.used[(base[j] + bias[0]).argmax()])
        want.append(prev)
    assert tree.tokens.tolist() == want


@torch.no_grad()
def test_siblings_propose_their_children_from_their_own_tokens(checkpoint):
    proposer, prompt, pending = ready(checkpoint, "static:[[0],[1],[0,0],[1,0]]")
    tree = proposer.propose(prompt, pending, SamplingConfig())
    _, base = by_hand(proposer, pending)
    for child, parent in ((3, 1), (4, 2)):  # the best child of each depth-1 node, from that node's token
        bias, _ = proposer.drafter.markov_head(tree.tokens[parent:parent + 1])
        assert int(tree.tokens[child]) == int(proposer.used[(base[1] + bias[0]).argmax()])
    # sampled: every node was drawn from its parent's own distribution q_d(. | the parent's token)
    sampling = SamplingConfig(temperature=0.8)
    tree = proposer.propose(prompt, pending, sampling)
    for node in range(1, tree.num_nodes):
        parent = int(tree.parents[node])
        bias, _ = proposer.drafter.markov_head(tree.tokens[parent:parent + 1])
        q = torch.zeros(VOCAB)
        q[proposer.used] = warp(base[tree.depth_list[node] - 1] + bias[0], sampling)
        torch.testing.assert_close(tree.draft_probs[node], q, atol=1e-5, rtol=1e-4)
    assert not torch.equal(tree.draft_probs[3], tree.draft_probs[4])  # two parents' tokens, two distributions


@pytest.mark.parametrize("tree", ["chain:4", "static:[[0],[1],[0,0],[1,0]]"])
def test_greedy_decoding_equals_generate_with_and_without_the_gate(checkpoint, tree):
    target, rows, path = checkpoint
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    gates = ({}, {"conf_min": 0.5}, {"conf_min": 0.93}, {"conf_min": 0.95})  # none, some and every draft cut
    for options in gates if tree.startswith("chain") else ({},):
        proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree, **options)
        for i in range(3):
            prompt = rows[i, :PROMPT]
            out, _ = speculative_generate(target, proposer, prompt, max_new_tokens=24)
            assert out.tolist() == target.model.generate(prompt[None], generation_config=config)[0].tolist()


def test_the_confidence_gate_drafts_less_and_is_refused_where_it_cannot_work(checkpoint):
    target, rows, path = checkpoint
    drafted = {}
    for conf_min in (0.0, 0.9, 0.93, 0.95, 1.0):
        proposer = proposer_from_checkpoint(load_checkpoint(path), target, "chain:4", conf_min=conf_min)
        _, stats = speculative_generate(target, proposer, rows[1, :PROMPT], max_new_tokens=24)
        drafted[conf_min] = sum(size - 1 for size in stats.tree_sizes)  # draft nodes, root excluded
    counts = list(drafted.values())
    assert counts == sorted(counts, reverse=True) and counts[0] > 0 and drafted[1.0] == 0  # sigmoid < 1
    with pytest.raises(ValueError, match="cuts chains only; use a tree spec chain:K"):
        proposer_from_checkpoint(load_checkpoint(path), target, "static:[[0],[1]]", conf_min=0.5)
    # the command-line spelling (eval/tau.py --proposer DIR:conf_min=P) builds the same gate
    gated = load_proposer(f"{path}:conf_min=0.95", target, parse_tree_spec("chain:4"))
    assert gated.conf_min == 0.95
    with pytest.raises(ValueError, match=r"conf_min=2 in .*want a confidence in \[0, 1\]"):
        load_proposer(f"{path}:conf_min=2", target, parse_tree_spec("chain:4"))


def test_the_gate_needs_a_dspark_drafter_with_a_confidence_head(checkpoint, tmp_path):
    target, _, path = checkpoint
    ckpt = load_checkpoint(path)
    config = {**ckpt.config, "confidence_head": False}
    state = {k: v for k, v in ckpt.state_dict.items() if not k.startswith("confidence_head.")}
    bare = save_checkpoint(tmp_path / "bare", family="dspark", config=config, target=ckpt.target, state_dict=state)
    with pytest.raises(ValueError, match="conf_min needs a DSpark drafter trained with a confidence head"):
        load_proposer(f"{bare}:conf_min=0.5", target, parse_tree_spec("chain:4"))
    load_proposer(str(bare), target, parse_tree_spec("chain:4"))  # without the gate it drafts as usual


@pytest.mark.parametrize("tree", ["static:[[0],[1],[0,0],[1,0]]"])  # siblings drawn from their own tokens' biases
@torch.no_grad()
@pytest.mark.slow
def test_sampled_decoding_reproduces_the_targets_distribution(checkpoint, tree):
    target, rows, path = checkpoint
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree, seed=5)
    pvalue, accepted = first_two_tokens_pvalue(target.model, proposer, rows[3, :PROMPT])
    assert accepted > 40 and pvalue > 1e-3, (accepted, pvalue)


def test_trees_deeper_than_the_block_and_engine_formats_without_dspark_are_refused(checkpoint, tmp_path):
    target, _, path = checkpoint
    with pytest.raises(ValueError, match=r"chain:5 is 5 deep.*block_size - 1 = 4"):
        proposer_from_checkpoint(load_checkpoint(path), target, "chain:5")
    with pytest.raises(ExportError, match=r"dspark checkpoint to sglang is not supported .*use --format vllm or llama.cpp"):
        export_checkpoint(path, "sglang", tmp_path / "out", target=target)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- trained through train/eagle.py


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory, RECIPE)


def test_reproduces_golden_losses(run):
    summary, _ = run
    golden = [6.658979, 6.177681, 5.901916, 5.918477, 5.90082, 5.896304]  # CE + the confidence BCE
    assert [round(x, 6) for x in summary.losses] == pytest.approx(golden, abs=2e-5)


def test_resumed_run_draws_the_same_anchors_and_ends_with_the_same_weights(trainer, run, tmp_path):
    summary, out = run
    shutil.copytree(out / "checkpoint-4", tmp_path / "checkpoint-4")
    resumed = trainer.main([RECIPE, f"output_dir={tmp_path}", "resume_from=latest"])
    final, again = load_checkpoint(out / "checkpoint-final"), load_checkpoint(tmp_path / "checkpoint-final")
    assert resumed.losses == summary.losses[4:]
    for key, value in final.state_dict.items():
        assert torch.equal(value, again.state_dict[key]), key


@pytest.mark.parametrize("override, message", [
    ("dspark.markov_rank=0", "dspark.markov_rank=0 must be an integer >= 1 .*use drafter: dflash"),
    ("dspark.variant=gated", "dspark.variant='gated' must be one of vanilla"),
    ("dspark.confidence_weight=-1", "dspark.confidence_weight=-1.0 must be >= 0"),
    ("dflash.block_size=1", "dflash.block_size=1 must be >= 2"),
])
def test_bad_dspark_values_fail_clearly(trainer, tmp_path, override, message):
    with pytest.raises(RecipeError, match=message):
        trainer.main([RECIPE, override, f"output_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())
