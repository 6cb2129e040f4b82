"""DFlash proposer on tiny targets, through the shared decoder: greedy decoding == generate (chain, static
and dynamic trees), drafts == the drafter's per-slot argmax by hand, sampled draft_probs == the slot
distributions, the context cache after `update` == one built from scratch, sampled decoding reproduces
the target's distribution (chi-square), trees deeper than the block and other targets refused.

The drafter is trained for a few seconds on the target's own greedy continuations of the test prompts, so
drafts are often right and accepted paths of several tokens are exercised.
"""

import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch
from test_sampling import first_two_tokens_pvalue  # tests/ is on sys.path under pytest

from conftest import (continuations, fit_drafter, fused_batch, save_drafter, target_features,  # tests/ on sys.path
                      untied_llama)
from drafters.checkpoint import CheckpointError, save_checkpoint, target_info
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.adaptive import AdaptiveChain
from drafters.decode.proposers.loading import load_drafter_proposer, load_proposer
from drafters.decode.sampling import SamplingConfig, warp
from drafters.decode.tree import parse_tree_spec
from drafters.dflash import DFlashCache, DFlashConfig, DFlashDrafter, sample_anchors
from drafters.draft_vocab import build_draft_vocab
from drafters.eagle3 import fuse_features
from drafters.targets import Target
from drafters.training.dflash import BlockLossOptions, block_loss

VOCAB, PROMPT, NEW, BLOCK = 259, 12, 30, 6
TREES = ["chain:5", "static:eagle1", "dynamic:total=12,depth=4,topk=4"]  # static:eagle1 is 5 deep
GREEDY = SamplingConfig()





def train_drafter(target, sequences, loss_mask, steps=120) -> DFlashDrafter:
    vocab = build_draft_vocab([(sequences, loss_mask)], VOCAB, 48)
    config = DFlashConfig.from_target_config(target.config, 48, mask_token_id=0, num_layers=2, block_size=BLOCK)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, vocab).attach_head(target.lm_head.weight)
    batch = fused_batch(target, sequences, loss_mask, config.aux_layers)
    generator = torch.Generator().manual_seed(0)  # the anchors

    def loss(_):
        return block_loss(drafter, batch, *sample_anchors(loss_mask, 16, generator), BlockLossOptions(gamma=4.0)).loss

    return fit_drafter(drafter, loss, steps)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request, tmp_path_factory):
    if request.param == "llama":
        target = untied_llama()
    else:
        target = Target(*request.getfixturevalue("tiny_gemma3"), "tiny-random-gemma3")
    references, loss_mask = continuations(target, PROMPT)  # (6, PROMPT + 40)
    drafter = train_drafter(target, references, loss_mask)
    path = save_drafter(tmp_path_factory.mktemp("ckpt") / request.param, "dflash", drafter, target, step=120)
    return target, references, path


def ready(setup, tree, prompt_index=0):
    # a proposer reset on prompt `prompt_index`, as the decoder leaves it after the prefill
    target, references, path = setup
    proposer = load_drafter_proposer(path, target, tree)
    prompt = references[prompt_index, :PROMPT]
    proposer.reset(prompt, target_features(target.model, prompt, proposer.needs.layers))
    return proposer, target.model, prompt, int(references[prompt_index, PROMPT])  # pending = 1st new token


@torch.no_grad()
def slots_by_hand(proposer, model, prompt, pending):
    # the drafter without the proposer: context = the prompt's features, block at position len(prompt)
    drafter, layers = proposer.drafter, proposer.drafter.config.aux_layers
    cache = DFlashCache()
    drafter.extend_context(fuse_features(target_features(model, prompt, layers).hidden_states, layers), cache)
    return drafter.draft(torch.tensor([pending]), proposer.embed, cache)[1][0]  # (B-1, Vd)


def to_target(proposer, probs):
    out = torch.zeros(VOCAB)
    out[proposer.used] = probs
    return out


# ---------------------------------------------------------------- lossless greedy decoding


@pytest.mark.parametrize("tree", TREES)
def test_greedy_matches_generate(setup, tree):
    target, references, path = setup
    proposer = load_proposer(str(path), target, parse_tree_spec(tree))  # the eval/tau.py path
    taus = []
    for row in range(2):
        prompt = references[row, :PROMPT]
        out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
        assert out.tolist() == references[row, : PROMPT + NEW].tolist()
        assert 1 + sum(a + 1 for a in stats.accepted) == NEW
        taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.5  # trained on these continuations: drafts are often accepted


def test_adaptive_chain_stays_within_the_block(setup):
    target, references, path = setup
    proposer = AdaptiveChain(load_drafter_proposer(path, target, "chain:2"))
    out, stats = speculative_generate(target, proposer, references[1, :PROMPT], max_new_tokens=NEW)
    assert out.tolist() == references[1, : PROMPT + NEW].tolist()
    assert max(stats.tree_depths) <= BLOCK - 1


# ---------------------------------------------------------------- drafts == the drafter by hand


@torch.no_grad()
def test_chain_drafts_are_each_slots_argmax(setup):
    proposer, model, prompt, pending = ready(setup, "chain:4")
    tree = proposer.propose(prompt, pending, GREEDY)
    slots = slots_by_hand(proposer, model, prompt, pending)
    assert tree.tokens.tolist() == [pending] + proposer.used[slots[:4].argmax(-1)].tolist()
    assert tree.parents.tolist() == list(range(-1, 4))


@torch.no_grad()
def test_static_tree_children_are_the_next_slots_ranked_tokens(setup):
    proposer, model, prompt, pending = ready(setup, "static:[[0],[1],[0,0],[0,1],[1,0]]")
    tree = proposer.propose(prompt, pending, GREEDY)
    ranked = proposer.used[slots_by_hand(proposer, model, prompt, pending).topk(2, dim=-1).indices]  # (B-1, 2)
    for node in range(1, tree.num_nodes):
        depth = tree.depth_list[node]
        rank = tree.children[tree.parent_list[node]].index(node)
        assert int(tree.tokens[node]) == int(ranked[depth - 1, rank])  # whatever the parent's token


@pytest.mark.parametrize("tree", ["chain:4", "static:eagle1"])
@torch.no_grad()
def test_sampled_draft_probs_are_the_slot_distributions(setup, tree):
    proposer, model, prompt, pending = ready(setup, tree)
    sampling = SamplingConfig(temperature=0.7)
    tree = proposer.propose(prompt, pending, sampling)
    slots = slots_by_hand(proposer, model, prompt, pending)
    for node in range(1, tree.num_nodes):
        expected = to_target(proposer, warp(slots[tree.depth_list[node] - 1], sampling))
        torch.testing.assert_close(tree.draft_probs[node], expected, atol=1e-5, rtol=1e-4)
    assert all(len({int(tree.tokens[c]) for c in kids}) == len(kids) for kids in tree.children)


# ---------------------------------------------------------------- context cache after update == from scratch


class CheckedAgainstScratch:
    """Delegates to a DFlashProposer; before each round compares its context cache and block logits with a
    cache built from scratch on the committed sequence's features."""

    def __init__(self, proposer, model):
        self.proposer, self.model, self.needs, self.rounds = proposer, model, proposer.needs, 0

    def reset(self, prompt_ids, features):
        self.proposer.reset(prompt_ids, features)

    def update(self, new_tokens, features, pending):
        self.proposer.update(new_tokens, features, pending)

    def propose(self, context, pending, sampling):
        p = self.proposer
        layers = p.drafter.config.aux_layers
        scratch = DFlashCache()
        p.drafter.extend_context(fuse_features(target_features(self.model, context, layers).hidden_states, layers),
                                 scratch)
        for got, want in zip(p.cache.keys + p.cache.values, scratch.keys + scratch.values):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        pending_ids = torch.tensor([pending])
        torch.testing.assert_close(p.drafter.draft(pending_ids, p.embed, p.cache)[1],
                                   p.drafter.draft(pending_ids, p.embed, scratch)[1], atol=1e-4, rtol=1e-4)
        self.rounds += 1
        return p.propose(context, pending, sampling)


@pytest.mark.parametrize("tree, sampling", [("dynamic:total=12,depth=4,topk=4", GREEDY),
                                            ("static:eagle1", SamplingConfig(temperature=0.5, seed=1))])
def test_cache_after_update_equals_cache_built_from_scratch(setup, tree, sampling):
    target, references, path = setup
    checked = CheckedAgainstScratch(load_drafter_proposer(path, target, tree), target.model)
    _, stats = speculative_generate(target, checked, references[0, :PROMPT], max_new_tokens=NEW, sampling=sampling)
    assert checked.rounds == stats.num_rounds
    assert max(stats.accepted[:-1]) >= 2  # multi-token updates (and dropped tree branches) happened


# ---------------------------------------------------------------- sampled decoding is lossless


@pytest.mark.parametrize("setup", ["llama"], indirect=True)  # the verifier is target-independent
@pytest.mark.parametrize("tree", ["chain:3", "static:[[0],[1],[2],[0,0],[1,0]]"])
@torch.no_grad()
@pytest.mark.slow
def test_sampled_decoding_reproduces_the_targets_distribution(setup, tree):
    # the joint law of the first two new tokens must be the target's (tests/test_sampling.py, where the verifier's
    # power against a wrong residual is shown); that the draft_probs handed over are the distributions drafts were
    # drawn from is test_sampled_draft_probs_... above
    target, references, path = setup
    pvalue, accepted = first_two_tokens_pvalue(target.model, load_drafter_proposer(path, target, tree, seed=5),
                                               references[3, :PROMPT])
    assert accepted > 40 and pvalue > 1e-3, (accepted, pvalue)


# ---------------------------------------------------------------- refusals


def test_trees_deeper_than_the_block_are_refused(setup):
    target, _, path = setup
    with pytest.raises(ValueError, match=r"chain:6 is 6 deep.*drafts at most block_size - 1 = 5 tokens.*chain:5"):
        load_drafter_proposer(path, target, "chain:6")
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        load_drafter_proposer(path, target, "dynamic:total=10,depth=6,topk=2")


def test_checkpoint_for_another_target_is_refused(setup, tmp_path):
    target = setup[0]
    config = DFlashConfig.from_target_config(target.config, 48, mask_token_id=0, block_size=BLOCK)
    small = replace(config, hidden_size=32, intermediate_size=64)  # right target info, wrong drafter
    save_checkpoint(tmp_path / "h32", family="dflash", config=asdict(small), target=target_info(target),
                    state_dict=DFlashDrafter(small).state_dict())
    with pytest.raises(CheckpointError, match="hidden_size: drafter 32 vs target 64"):
        load_drafter_proposer(tmp_path / "h32", target, "chain:3")
    deeper = {**target_info(target), "num_layers": 30, "hidden_size": 576}  # recorded for another target
    save_checkpoint(tmp_path / "other", family="dflash", config=asdict(config), target=deeper,
                    state_dict=DFlashDrafter(config).state_dict())
    with pytest.raises(CheckpointError, match="num_layers: checkpoint 30 vs target 8"):
        load_drafter_proposer(tmp_path / "other", target, "chain:3")
    state = {k: v for k, v in DFlashDrafter(config).state_dict().items() if k != "hidden_norm.weight"}
    save_checkpoint(tmp_path / "partial", family="dflash", config=asdict(config), target=target_info(target),
                    state_dict=state)
    with pytest.raises(CheckpointError, match="(?s)weights do not match.*hidden_norm.weight"):
        load_drafter_proposer(tmp_path / "partial", target, "chain:3")


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size=0 must be an integer >= 2"),  # was: "use a tree of depth <= -1 (e.g. chain:-1)"
    ("block_size", "4", "block_size='4' must be an integer >= 2"),  # was: a TypeError traceback
    ("mask_token_id", None, r"mask_token_id=None must be a token id in \[0, vocab_size=\d+\)"),
])
def test_a_bad_config_in_the_file_is_named_where_it_is_read(setup, tmp_path, field, value, message):
    target, _, path = setup
    shutil.copytree(path, tmp_path / "bad")
    meta = json.loads((tmp_path / "bad" / "drafter.json").read_text())
    meta["config"][field] = value
    (tmp_path / "bad" / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'bad'}.*DFlash config: {message}"):
        load_drafter_proposer(tmp_path / "bad", target, "chain:3")
