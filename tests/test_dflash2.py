"""DFlash2 (drafters.dflash2): DFlash's block plus two-tap dynamic convolutions and a pairwise path selector.

- the convolution: a fresh one is the identity (DFlash2 starts as the DFlash of the same weights), it is causal
  inside a block and never crosses blocks, so training (every block side by side) == drafting one block;
- the selector: Viterbi == brute force over all k^D paths, a zero pairwise term drafts each slot's argmax, the
  drafter's best path maximises the chain's log-probability; the pairwise cross-entropy trains the codebooks;
- decoding: greedy == generate on tiny random targets of 5 architectures (chain = Viterbi, walk chain, static and
  dynamic trees), sampled draft_probs are each node's own q_d(. | its token) over the top-k, sampled decoding keeps
  the target's distribution (chi-square);
- refusals before any work, one sentence naming the field; the tiny recipe's golden losses, resume, export round trip.
Lossless greedy decoding from the trained checkpoint, the export through the decoder's loader and the fit refusal are
also tests/test_contracts.py's.
"""

import itertools
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import continuations, fit_drafter, fused_batch, save_drafter, target_features, train_tiny
from safetensors.torch import load_file, save_file
from test_sampling import first_two_tokens_pvalue

from drafters.checkpoint import load_checkpoint
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.loading import load_proposer, proposer_from_checkpoint
from drafters.decode.sampling import SamplingConfig, warp
from drafters.dflash import DFlashCache, DFlashDrafter, block_ids, block_positions, sample_anchors
from drafters.dflash2 import DFlash2Config, DFlash2Drafter, DynamicConv, viterbi
from drafters.eagle3 import fuse_features
from drafters.export.common import ExportError
from drafters.export.dflash2 import read_dflash2_export
from drafters.export.dispatch import export_checkpoint
from drafters.export.reading import ExportCheckError
from drafters.targets import Target
from drafters.tiny import build_tiny_architecture
from drafters.training.dflash import BlockLossOptions, block_loss
from drafters.training.dflash2 import selector_loss
from drafters.training.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "dflash2_tiny.yaml")
VOCAB, BLOCK, PROMPT, NEW = 259, 5, 12, 20
ARCHITECTURES = ["llama", "qwen3", "mistral-window", "olmo2", "gemma2"]


def make_config(model, **fields) -> DFlash2Config:
    return DFlash2Config.from_target_config(model.config, VOCAB, **{
        "mask_token_id": 0, "num_layers": 2, "block_size": BLOCK, "selector_rank": 8, "path_top_k": 4, **fields})


def perturbed(drafter, seed=1, scale=0.2):
    """Every weight off its initialisation (the convolutions off the identity, the gate off zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return drafter.eval()


def fit(target, sequences, loss_mask, steps=40, **fields) -> DFlash2Drafter:
    """A drafter trained for a few seconds on the target's own continuations: DFlash's block loss + the selector's."""
    torch.manual_seed(0)
    drafter = DFlash2Drafter(make_config(target.model, **fields)).attach_head(target.lm_head.weight)
    batch = fused_batch(target, sequences, loss_mask, drafter.config.aux_layers)
    generator, options = torch.Generator().manual_seed(0), BlockLossOptions(extra_loss=selector_loss)
    return fit_drafter(drafter, lambda _: block_loss(drafter, batch, *sample_anchors(loss_mask, 16, generator),
                                                     options).loss, steps)


# ---------------------------------------------------------------- the dynamic convolution


@torch.no_grad()
def test_a_fresh_dflash2_backbone_computes_dflash(tiny_llama):
    model, _ = tiny_llama
    config = make_config(model)
    torch.manual_seed(0)
    dflash = perturbed(DFlashDrafter(config)).attach_head(model.get_output_embeddings().weight)
    dflash2 = DFlash2Drafter(config).attach_head(model.get_output_embeddings().weight)
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    features = torch.randn(1, 9, 3 * 64)

    def drafted(drafter):
        cache = DFlashCache()
        drafter.extend_context(features, cache)
        return drafter.draft(torch.tensor([7]), model.get_input_embeddings(), cache)[1]

    torch.testing.assert_close(drafted(dflash2), drafted(dflash), atol=0, rtol=0)
    dflash2.layers[0].mlp_conv.base_kernel[1, 1] += 0.1  # control: a tap on the slot before changes the drafts
    assert not torch.allclose(drafted(dflash2), drafted(dflash))


@torch.no_grad()
def test_the_convolution_is_causal_inside_a_block_and_never_crosses_blocks():
    conv = perturbed(DynamicConv(hidden_size=32, kernel_size=2, group_size=8, block_size=4), scale=0.5)
    x = torch.randn(1, 8, 32)  # two blocks of 4
    y = x.clone()
    y[0, 5] += 1.0  # block 1, slot 1
    out_x, out_y = conv(torch.tanh, x), conv(torch.tanh, y)
    changed = (out_x - out_y).abs().amax(-1)[0] > 0  # (8,)
    # slot 1, the slot after it (the tap before the sublayer) and the one after that (the tap after it): causal, and
    # inside its own block
    assert changed.tolist() == [False] * 5 + [True] * 3
    z = x.clone()
    z[0, 3] += 1.0  # block 0's last slot: block 1's first slot must not see it
    assert torch.equal(conv(torch.tanh, z)[0, 4:], out_x[0, 4:])


@torch.no_grad()
def test_training_blocks_equal_one_block_drafted_on_its_context(tiny_llama):
    model, _ = tiny_llama
    torch.manual_seed(0)
    drafter = perturbed(DFlash2Drafter(make_config(model))).attach_head(model.get_output_embeddings().weight)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    features = fuse_features(model(ids, output_hidden_states=True).hidden_states, drafter.config.aux_layers)
    anchors, keep = torch.tensor([[4, 9, 15]]), torch.ones(1, 3, dtype=torch.bool)
    embed = model.get_input_embeddings()
    unrolled = drafter.block_unroll(features, ids, embed, anchors, keep)  # (1, 3, Bk, h)
    assert block_ids(ids, anchors, BLOCK, 0)[0, 1, 0] == ids[0, 9] and block_positions(anchors, BLOCK)[0, 2, 0] == 15
    for n, a in enumerate(anchors[0].tolist()):
        cache = DFlashCache()
        drafter.extend_context(features[:, :a], cache)
        normed, _ = drafter.draft(ids[:, a], embed, cache)
        torch.testing.assert_close(unrolled[0, n], normed[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the path selector


def test_viterbi_equals_brute_force_over_every_path():
    gen = torch.Generator().manual_seed(0)
    for depth, k in [(1, 5), (2, 3), (4, 3), (5, 2)]:
        first, steps = torch.randn(k, generator=gen), torch.randn(depth - 1, k, k, generator=gen)

        def score(path):
            return float(first[path[0]] + sum(steps[d, path[d], path[d + 1]] for d in range(depth - 1)))

        best = max(itertools.product(range(k), repeat=depth), key=score)
        assert viterbi(first, steps).tolist() == list(best)


@torch.no_grad()
def test_the_drafters_best_path_maximises_the_chains_log_probability(tiny_llama):
    model, _ = tiny_llama
    torch.manual_seed(0)
    drafter = perturbed(DFlash2Drafter(make_config(model)), scale=1.0).attach_head(model.get_output_embeddings().weight)
    normed, anchor = torch.randn(3, 64), 11
    unary = drafter.compute_logits(normed)  # (3, Vd)
    values, cand = unary.topk(4, dim=-1)
    ids = drafter.target_ids(cand)

    def logprob(path):  # sum_d log q_d(x_d | x_{d-1}), x_0 = the anchor
        prev = [anchor] + [int(ids[d, path[d]]) for d in range(2)]
        return sum(float(drafter.transition_logprobs(normed[d], values[d], cand[d],
                                                     torch.tensor([prev[d]]))[0, path[d]]) for d in range(3))

    best = max(itertools.product(range(4), repeat=3), key=logprob)
    assert drafter.best_path(normed, unary, anchor).tolist() == [int(ids[d, best[d]]) for d in range(3)]


@torch.no_grad()
def test_a_zero_pairwise_term_drafts_each_slots_argmax(tiny_llama):
    model, _ = tiny_llama
    torch.manual_seed(0)
    drafter = perturbed(DFlash2Drafter(make_config(model, path_top_k=6)), scale=1.0)
    drafter.attach_head(model.get_output_embeddings().weight)
    normed = torch.randn(4, 64)
    unary = drafter.compute_logits(normed)
    assert drafter.best_path(normed, unary, 5).tolist() != unary.argmax(-1).tolist()  # control: the term matters
    drafter.candidate_selector.hidden_projection.weight.zero_()  # H = 0: no pairwise term
    assert drafter.best_path(normed, unary, 5).tolist() == unary.argmax(-1).tolist()


def test_the_selector_loss_is_the_pairwise_cross_entropy_and_trains_the_codebooks(tiny_llama):
    model, _ = tiny_llama
    target = Target(model, None, "tiny-random-llama")
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    drafter = perturbed(DFlash2Drafter(make_config(model))).attach_head(model.get_output_embeddings().weight).train()
    batch = fused_batch(target, ids, mask, drafter.config.aux_layers)
    anchors, keep = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    plain = block_loss(drafter, batch, anchors, keep).loss
    captured = {}

    def spy(d, slots, weights, total):
        captured["args"] = (slots, weights, total)
        captured["value"] = selector_loss(d, slots, weights, total, weight=2.0)
        return captured["value"]

    both = block_loss(drafter, batch, anchors, keep, BlockLossOptions(extra_loss=spy)).loss
    torch.testing.assert_close(both, plain + captured["value"])
    with torch.no_grad():  # by hand, slot by slot: -log softmax over the top-k (the label in) of U + <P[a] * H n, S[b]>
        slots, weights, total = captured["args"]
        selector, by_hand = drafter.candidate_selector, 0.0
        for b, n, j in slots.counted.nonzero().tolist():
            x, a = slots.normed[b, n, j], int(slots.prev[b, n, j])
            y = int(slots.argmax_draft[slots.index[b, n, j]])
            u = drafter.compute_logits(x)
            cand = u.topk(drafter.config.path_top_k).indices.tolist()
            cand = cand if y in cand else cand[:-1] + [y]
            gate = selector.hidden_projection.weight @ x
            s = torch.stack([u[c] + (selector.predecessor_codebook[a] * gate * selector.successor_codebook[c]).sum()
                             for c in cand])
            by_hand += float(weights[j] * -s.log_softmax(0)[cand.index(y)])
        assert slots.counted.sum() > 8
        torch.testing.assert_close(float(captured["value"]), 2.0 * by_hand / float(total), atol=1e-5, rtol=1e-5)
    both.backward()
    grads = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.kernel_projection.weight",
            "layers.1.mlp_conv.base_kernel"} <= grads


# ---------------------------------------------------------------- decoding on 5 architectures


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request, tmp_path_factory):
    target = Target(*build_tiny_architecture(request.param), request.param)
    sequences, loss_mask = continuations(target, PROMPT, rows=4)  # (4, PROMPT + 40) greedy generate
    drafter = fit(target, sequences, loss_mask)
    assert drafter.candidate_selector.hidden_projection.weight.abs().sum() > 0  # the pairwise term is live
    path = save_drafter(tmp_path_factory.mktemp("ckpt") / request.param, "dflash2", drafter, target, step=40)
    return target, sequences, path


@pytest.mark.parametrize("tree", ["chain:4", "chain:4+walk", "static:[[0],[1],[0,0],[1,0],[0,0,0]]",
                                  "dynamic:total=8,depth=4,topk=3"])
def test_greedy_matches_generate(arch, tree):
    target, sequences, path = arch
    ckpt = load_checkpoint(path)
    if tree.endswith("+walk"):
        ckpt.config["path_search"], tree = "walk", tree.removesuffix("+walk")
    proposer = proposer_from_checkpoint(ckpt, target, tree)
    accepted = 0
    for row in range(2):
        out, stats = speculative_generate(target, proposer, sequences[row, :PROMPT], max_new_tokens=NEW)
        expected = sequences[row, :PROMPT + NEW].tolist()
        eos = target.tokenizer.eos_token_id  # generate stops there (and pads), the decoder drafts on
        end = expected.index(eos, PROMPT) + 1 if eos in expected[PROMPT:] else len(expected)
        assert end > PROMPT + 5 and out.tolist()[:end] == expected[:end], f"{target.name} {tree}"
        accepted += sum(stats.accepted)
    assert accepted > 0


def ready(arch, tree):
    target, sequences, path = arch
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree, seed=5)
    prompt = sequences[0, :PROMPT]
    proposer.reset(prompt, target_features(target.model, prompt, proposer.needs.layers))
    return proposer, prompt, int(sequences[0, PROMPT])


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
@torch.no_grad()
def test_sampled_draft_probs_are_each_nodes_own_q_over_the_top_k(arch):
    proposer, prompt, pending = ready(arch, "static:[[0],[1],[0,0],[1,0]]")
    sampling = SamplingConfig(temperature=0.7)
    tree = proposer.propose(prompt, pending, sampling)
    drafter = proposer.drafter
    normed, logits = drafter.draft(torch.tensor([pending]), proposer.embed, proposer.cache)
    normed, logits = normed[0, 1:], logits[0]
    values, cand = logits.topk(drafter.config.path_top_k, dim=-1)

    def q(depth, token):  # warp(S_d(token, .) on the candidates, -inf off them), over target ids
        row = torch.full((VOCAB,), float("-inf"))
        row[cand[depth]] = drafter.transition_scores(normed[depth], values[depth], cand[depth],
                                                     torch.tensor([token]))[0]
        out = torch.zeros(VOCAB)
        out[proposer.used] = warp(row, sampling)
        return out

    tokens = tree.tokens.tolist()
    for node in range(1, tree.num_nodes):
        parent = tree.parent_list[node]
        torch.testing.assert_close(tree.draft_probs[node], q(tree.depth_list[node] - 1, tokens[parent]))
        assert int((tree.draft_probs[node] > 0).sum()) <= drafter.config.path_top_k
    children = tree.children[0]
    assert len(children) == 2 and tree.children[children[0]] and tree.children[children[1]]
    assert not torch.equal(tree.draft_probs[tree.children[children[0]][0]],
                           tree.draft_probs[tree.children[children[1]][0]])  # siblings' subtrees differ


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
@pytest.mark.parametrize("tree", ["chain:3", "static:[[0],[1],[0,0],[1,0]]"])
@torch.no_grad()
@pytest.mark.slow
def test_sampled_decoding_reproduces_the_targets_distribution(arch, tree):
    target, sequences, path = arch
    proposer = proposer_from_checkpoint(load_checkpoint(path), target, tree, seed=5)
    pvalue, accepted = first_two_tokens_pvalue(target.model, proposer, sequences[3, :PROMPT])
    assert accepted > 40 and pvalue > 1e-3, (accepted, pvalue)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("fields, message", [
    ({"path_top_k": 0}, r"path_top_k=0 must be in \[1, draft_vocab_size=259\]"),
    ({"path_top_k": 260}, r"path_top_k=260 must be in \[1, draft_vocab_size=259\]"),
    ({"conv_kernel_size": 6}, r"conv_kernel_size=6 must be in \[1, block_size=5\]"),
    ({"conv_group_size": 7}, r"conv_group_size=7 must divide hidden_size=64"),
    ({"path_search": "beam"}, r"path_search='beam' must be one of viterbi, walk"),
])
def test_bad_configs_are_refused_naming_the_field(tiny_llama, fields, message):
    with pytest.raises(ValueError, match=message):
        make_config(tiny_llama[0], **fields)


@pytest.mark.parametrize("override, message", [
    ("dflash2.path_top_k=0", r"^recipe: dflash2.path_top_k=0 must be in \[1, draft_vocab_size=259\]"),
    ("dflash2.path_top_k=300", r"dflash2.path_top_k=300 must be in \[1, draft_vocab_size=259\]"),
    ("dflash2.conv_kernel_size=0", r"dflash2.conv_kernel_size=0 must be in \[1, dflash.block_size=4\]"),
    ("dflash2.conv_kernel_size=5", r"dflash2.conv_kernel_size=5 must be in \[1, dflash.block_size=4\]"),
    ("dflash2.conv_group_size=0", r"dflash2.conv_group_size=0 must be an integer >= 1"),
    ("dflash2.selector_rank=0", r"dflash2.selector_rank=0 must be an integer >= 1"),
    ("dflash2.path_search=beam", r"dflash2.path_search='beam' must be one of viterbi, walk"),
    ("dflash2.selector_weight=-1", r"dflash2.selector_weight=-1.0 must be >= 0"),
])
def test_bad_dflash2_values_fail_before_any_work(trainer, tmp_path, override, message):
    with pytest.raises(RecipeError, match=message):
        trainer.main([RECIPE, override, f"output_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())


def test_a_group_size_that_does_not_divide_the_targets_hidden_size_is_refused_before_training(trainer, tmp_path):
    with pytest.raises(RecipeError, match=r"dflash2.conv_group_size=7 must divide the target's hidden size 64"):
        trainer.main([RECIPE, "dflash2.conv_group_size=7", f"output_dir={tmp_path}"])
    assert not list(tmp_path.glob("checkpoint-*"))


# ---------------------------------------------------------------- trained through train/train.py


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory, RECIPE)


def test_reproduces_golden_losses_and_lowers_the_loss(run):
    summary, _ = run
    golden = GOLDEN  # DFlash's block loss + the selector's pairwise cross-entropy
    assert [round(x, 6) for x in summary.losses] == pytest.approx(golden, abs=2e-5)
    assert summary.losses[-1] < summary.losses[0] - 0.2


def test_checkpoint_reloads_and_a_resumed_run_ends_with_the_same_weights(trainer, run, tmp_path):
    summary, out = run
    final = load_checkpoint(out / "checkpoint-final")
    assert final.family == "dflash2" and final.config["path_top_k"] == 8 and final.config["conv_group_size"] == 16
    assert asdict(DFlash2Config(**final.config)) == final.config
    shutil.copytree(out / "checkpoint-4", tmp_path / "checkpoint-4")
    resumed = trainer.main([RECIPE, f"output_dir={tmp_path}", "resume_from=latest"])
    again = load_checkpoint(tmp_path / "checkpoint-final")
    assert resumed.losses == summary.losses[4:]
    assert final.state_dict.keys() == again.state_dict.keys()
    for key, value in final.state_dict.items():
        assert torch.equal(value, again.state_dict[key]), key


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_sglang_export_carries_both_modules_and_an_independent_reader_reads_it_back(arch, tmp_path):
    target, sequences, path = arch
    export = export_checkpoint(path, "sglang", tmp_path / "sglang", target=target).path
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] | {"mask_token_id": 0} == {
        "mask_token_id": 0, "target_layer_ids": [1, 3, 4], "block_size": BLOCK, "conv_kernel_size": 2,
        "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4, "path_search": "viterbi"}
    tensors = load_file(export / "model.safetensors")
    assert tensors["layers.1.attention_conv.base_kernel"].shape == (2, 2, 64)
    assert tensors["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 64)
    assert tensors["candidate_selector.predecessor_codebook"].shape == (VOCAB, 8)
    c, state, written, _ = read_dflash2_export(export)
    source = load_checkpoint(path)
    assert asdict(c) == source.config and written == [1, 3, 4]
    assert all(torch.equal(state[k], v) for k, v in source.state_dict.items())
    proposer = load_proposer(str(export), target, "chain:4")  # the decoder's loader detects DFlash2DraftModel
    out, _ = speculative_generate(target, proposer, sequences[1, :PROMPT], max_new_tokens=NEW)
    assert out.tolist() == sequences[1, :PROMPT + NEW].tolist()
    del tensors["candidate_selector.successor_codebook"]
    save_file(tensors, export / "model.safetensors")
    with pytest.raises(ExportCheckError, match=r"missing \['candidate_selector.successor_codebook'\]"):
        read_dflash2_export(export)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
@pytest.mark.parametrize("fmt, engine", [("vllm", "speculators' DFlash layout"),
                                         ("llama.cpp", "the pinned converter and its DFlash graph")])
def test_engines_without_the_dflash2_modules_are_refused_in_one_sentence(arch, tmp_path, fmt, engine):
    target, _, path = arch
    sentence = rf"^a DFlash2 drafter cannot be exported to {fmt}: {engine} ha(s|ve) no dynamic convolution or path " \
        r"selector, .*; use --format sglang \(DFlash2DraftModel\) or native$"
    with pytest.raises(ExportError, match=sentence):
        export_checkpoint(path, fmt, tmp_path / fmt, target=target)
    assert not any(tmp_path.iterdir())


GOLDEN = [7.904669, 7.855203, 7.733255, 7.733471, 7.713894, 7.594124]  # the first run of recipes/dflash2_tiny.yaml
