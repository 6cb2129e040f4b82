"""EAGLE proposer on tiny targets: greedy decoding == generate, drafts == the drafter stepped by
hand, the drafter cache after `update` == one built from scratch, sampled trees that say how
they were drawn, checkpoints for other targets refused.

The drafter is trained for a few seconds on the target's own greedy continuations of the test
prompts, so drafts are often right and accepted paths of several tokens are exercised.
"""

from dataclasses import asdict, replace

import pytest
import torch

from conftest import (continuations, fit_drafter, fused_batch, save_drafter, target_features,  # tests/ on sys.path
                      untied_llama)
from drafters.checkpoint import CheckpointError, save_checkpoint, target_info
from drafters.decode.decoder import speculative_generate
from drafters.draft_vocab import build_draft_vocab
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, fuse_features
from drafters.layers import DraftKVCache
from drafters.decode.proposers.adaptive import AdaptiveChain
from drafters.decode.proposers.loading import load_drafter_proposer
from drafters.decode.sampling import SamplingConfig
from drafters.targets import Target
from drafters.training.eagle3 import TTTOptions, ttt_loss

VOCAB, PROMPT, NEW = 259, 12, 30
TREES = ["chain:4", "static:eagle1", "dynamic:total=12,depth=4,topk=4"]
GREEDY = SamplingConfig()





def train_drafter(target, sequences, loss_mask, steps=100, num_layers=1) -> Eagle3Drafter:
    config = Eagle3Config.from_target_config(target.config, draft_vocab_size=32, num_layers=num_layers)
    vocab = build_draft_vocab([(sequences, loss_mask)], VOCAB, 32)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, vocab)
    drafter.init_from_target(target.lm_head.weight, vocab)
    batch = fused_batch(target, sequences, loss_mask, config.aux_layers)
    return fit_drafter(drafter, lambda _: ttt_loss(drafter, batch, TTTOptions(steps=3)).loss, steps)


# llama-deep: a drafter of two decoder layers (their keys share one cache along the head axis: the tree mask, the
# cache's reordering after a round and its crop must hold for both)
@pytest.fixture(scope="module", params=["llama", "gemma3", "llama-deep"])
def setup(request, tmp_path_factory):
    if request.param.startswith("llama"):
        target = untied_llama()
    else:
        target = Target(*request.getfixturevalue("tiny_gemma3"), "tiny-random-gemma3")
    references, loss_mask = continuations(target, PROMPT)  # (6, PROMPT + 40)
    drafter = train_drafter(target, references, loss_mask, num_layers=2 if request.param == "llama-deep" else 1)
    path = save_drafter(tmp_path_factory.mktemp("ckpt") / request.param, "eagle3", drafter, target, step=100)
    return target, references, path


def drafter_along(proposer, model, prompt, path):
    # The drafter by hand, no tree: prefill pairs (feature_t, token_{t+1}) over the prompt with the
    # root as the last next token, then step on its own output hidden, one path token at a time,
    # default (chain) positions and causal mask. -> [(Vd,) logits after each path token]
    drafter, embed, layers = proposer.drafter, proposer.embed, proposer.drafter.config.aux_layers
    fused = fuse_features(target_features(model, prompt, layers).hidden_states, layers)  # (1, T, 3h)
    cache = DraftKVCache()
    hidden, logits = drafter.prefill(fused, torch.cat([prompt[1:], path[:1]])[None], embed, cache)
    hidden, out = hidden[:, -1:], [logits[0, -1]]
    for token in path[1:]:
        hidden, logits = drafter.step(hidden, torch.tensor([[token]]), embed, cache)
        out.append(logits[0, -1])
    return out


def ready(setup, tree, prompt_index=0):
    # a proposer reset on prompt `prompt_index`, as the decoder leaves it after the prefill
    target, references, path = setup
    proposer = load_drafter_proposer(path, target, tree)
    prompt = references[prompt_index, :PROMPT]
    proposer.reset(prompt, target_features(target.model, prompt, proposer.needs.layers))
    return proposer, target.model, prompt, int(references[prompt_index, PROMPT])  # pending = 1st new token


def to_target(proposer, probs):
    out = torch.zeros(VOCAB)
    out[proposer.used] = probs
    return out


# ---------------------------------------------------------------- lossless greedy decoding


@pytest.mark.parametrize("tree", TREES)
def test_greedy_matches_generate(setup, tree):
    target, references, path = setup
    proposer = load_drafter_proposer(path, target, tree)
    taus = []
    for row in range(2):
        prompt = references[row, :PROMPT]
        out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
        assert out.tolist() == references[row, : PROMPT + NEW].tolist()
        assert 1 + sum(a + 1 for a in stats.accepted) == NEW
        taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.5  # trained on these continuations: drafts are often accepted


def test_adaptive_chain_drives_the_chain_length(setup):
    target, references, path = setup
    proposer = AdaptiveChain(load_drafter_proposer(path, target, "chain:2"))
    out, stats = speculative_generate(target, proposer, references[1, :PROMPT], max_new_tokens=NEW)
    assert out.tolist() == references[1, : PROMPT + NEW].tolist()
    assert len(set(stats.tree_depths)) > 1


# ---------------------------------------------------------------- drafts == the drafter by hand


@torch.no_grad()
def test_chain_drafts_equal_the_drafter_stepped_by_hand(setup):
    proposer, model, prompt, pending = ready(setup, "chain:6")
    tree = proposer.propose(prompt, pending, GREEDY)
    path = [pending]
    for _ in range(6):  # greedy: each draft = argmax after the tokens so far, mapped through d2t
        logits = drafter_along(proposer, model, prompt, torch.tensor(path))[-1]
        path.append(int(proposer.used[logits.argmax()]))
    assert tree.tokens.tolist() == path and tree.parents.tolist() == list(range(-1, 6))


@pytest.mark.parametrize("tree", ["chain:5", "static:eagle1"])
@torch.no_grad()
def test_sampled_draft_probs_equal_the_drafter_run_along_each_path(setup, tree):
    # row c of draft_probs = softmax of the drafter's logits after the path to c's parent, run by
    # hand without a tree: checks the tree mask, the positions and the hidden handed down
    proposer, model, prompt, pending = ready(setup, tree)
    tree = proposer.propose(prompt, pending, SamplingConfig(temperature=1.0))
    for node in range(tree.num_nodes):
        if tree.children[node]:
            logits = drafter_along(proposer, model, prompt, tree.tokens[tree.path_to(node)])[-1]
            expected = to_target(proposer, logits.softmax(-1))
            for child in tree.children[node]:
                torch.testing.assert_close(tree.draft_probs[child], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("setup", ["llama"], indirect=True)  # target-independent: one is enough
@torch.no_grad()
def test_sibling_draws_follow_the_draft_probs(setup):
    # first child ~ q, second child ~ q without the first (drawn without replacement), as the verifier assumes
    proposer, model, prompt, pending = ready(setup, "static:[[0],[1]]")
    proposer.drafter.lm_head.weight.mul_(16)  # a peaked q, so that the two laws differ
    n, firsts, seconds = 1000, torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(n):
        tree = proposer.propose(prompt, pending, SamplingConfig(temperature=1.0))
        firsts[tree.tokens[1]] += 1 / n
        seconds[tree.tokens[2]] += 1 / n
    q = tree.draft_probs[1]
    second = (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0).sum(0)  # sum_a q(a) q(b) / (1 - q(a))
    assert (q - second).abs().sum() / 2 > 0.15  # the two laws differ: the test tells them apart
    assert (firsts - q).abs().sum() / 2 < 0.08 and (seconds - second).abs().sum() / 2 < 0.08
    top = q.argmax()
    assert abs(firsts[top] - q[top]) < 0.05 and abs(seconds[top] - second[top]) < 0.05


# ---------------------------------------------------------------- cache after update == from scratch


class CheckedAgainstScratch:
    """Delegates to an EagleProposer; before each round compares its committed drafter cache and
    next-step logits with a cache prefilled from scratch on the committed sequence."""

    def __init__(self, proposer, model):
        self.proposer, self.model, self.needs, self.rounds = proposer, model, proposer.needs, 0

    def reset(self, prompt_ids, features):
        self.proposer.reset(prompt_ids, features)

    def update(self, new_tokens, features, pending):
        self.proposer.update(new_tokens, features, pending)

    def propose(self, context, pending, sampling):
        p = self.proposer
        _, logits = p.draft_root(pending)  # (1, 1, Vd) from the incrementally built cache
        layers = p.drafter.config.aux_layers
        fused = fuse_features(target_features(self.model, context, layers).hidden_states, layers)
        next_tokens = torch.cat([context[1:], torch.tensor([pending])])  # (T,) pairs with features 0..T-1
        scratch = DraftKVCache()
        _, expected = p.drafter.prefill(fused, next_tokens[None], p.embed, scratch)
        torch.testing.assert_close(logits[0, -1], expected[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p.cache.keys, scratch.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p.cache.values, scratch.values, atol=1e-4, rtol=1e-4)
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


# ---------------------------------------------------------------- sampled decoding


class Recording:
    def __init__(self, proposer):
        self.proposer, self.needs, self.trees = proposer, proposer.needs, []

    def reset(self, prompt_ids, features):
        self.proposer.reset(prompt_ids, features)

    def update(self, new_tokens, features, pending):
        self.proposer.update(new_tokens, features, pending)

    def propose(self, context, pending, sampling):
        self.trees.append(self.proposer.propose(context, pending, sampling))
        return self.trees[-1]


@pytest.mark.parametrize("tree, sampling", [
    ("chain:4", SamplingConfig(temperature=0.8)),
    ("static:eagle1", SamplingConfig(temperature=1.0, top_p=0.9)),
    ("static:eagle1", SamplingConfig(temperature=1.0, top_k=2)),  # 2 tokens for 4 root children: pruned
    ("dynamic:total=12,depth=4,topk=4", SamplingConfig(temperature=1.0)),
])
def test_sampled_decoding_proposes_valid_trees(setup, tree, sampling):
    target, references, path = setup
    recording = Recording(load_drafter_proposer(path, target, tree))
    out, stats = speculative_generate(target, recording, references[2, :PROMPT], max_new_tokens=NEW,
                                      sampling=sampling, generator=torch.Generator().manual_seed(0))
    assert out.shape == (PROMPT + NEW,) and 1 + sum(a + 1 for a in stats.accepted) == NEW
    for t in recording.trees:
        if tree.startswith("dynamic"):  # EAGLE-2 rerank: deterministic drafts, verified as one-hot
            assert t.draft_probs is None
            continue
        rows, tokens = t.draft_probs[1:], t.tokens[1:]
        torch.testing.assert_close(rows.sum(-1), torch.ones(len(rows)))
        assert bool((rows.gather(1, tokens[:, None]) > 0).all())
        assert all(len({int(t.tokens[c]) for c in kids}) == len(kids) for kids in t.children)
        if sampling.top_k == 2:
            assert all(len(kids) <= 2 for kids in t.children)
    assert max(t.num_nodes for t in recording.trees) > 1


# ---------------------------------------------------------------- checkpoints for another target


def test_checkpoint_for_another_target_is_refused(setup, tmp_path):
    target = setup[0]
    config = Eagle3Config.from_target_config(target.config, draft_vocab_size=32)
    small = replace(config, hidden_size=32, intermediate_size=64)  # right target info, wrong drafter
    save_checkpoint(tmp_path / "h32", family="eagle3", config=asdict(small), target=target_info(target),
                    state_dict=Eagle3Drafter(small).state_dict())
    with pytest.raises(CheckpointError, match="hidden_size: drafter 32 vs target 64"):
        load_drafter_proposer(tmp_path / "h32", target, "chain:3")
    deeper = {**target_info(target), "num_layers": 30, "hidden_size": 576}  # recorded for another target
    save_checkpoint(tmp_path / "other", family="eagle3", config=asdict(config), target=deeper,
                    state_dict=Eagle3Drafter(config).state_dict())
    with pytest.raises(CheckpointError, match="num_layers: checkpoint 30 vs target 8"):
        load_drafter_proposer(tmp_path / "other", target, "chain:3")
    state = {k: v for k, v in Eagle3Drafter(config).state_dict().items() if k != "norm.weight"}
    save_checkpoint(tmp_path / "partial", family="eagle3", config=asdict(config), target=target_info(target),
                    state_dict=state)
    with pytest.raises(CheckpointError, match="(?s)weights do not match.*norm.weight"):
        load_drafter_proposer(tmp_path / "partial", target, "chain:3")
