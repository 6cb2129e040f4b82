"""Targets with recurrent layers (Qwen3-Next's and Qwen3.5's gated DeltaNet, Granite-4's Mamba): each round
verifies the tree's first-child chain in the model's own cache, and a rejected draft rolls the layers' states back
from a snapshot. Greedy decoding equals `generate` with drafts rejected and accepted; the snapshot restores the
states bit for bit; the proposer sees the target's features at the committed positions; sampling stays lossless."""

import functools

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer

from drafters.decode.cache import StateSnapshot, check_tree_decodable, has_recurrent_layers, model_cache
from drafters.decode.decoder import chain_forward, first_chain, speculative_generate
from drafters.decode.proposers import TargetNeeds
from drafters.decode.proposers.draft_model import DraftModelProposer
from drafters.decode.sampling import SamplingConfig, sample_without_replacement, warp
from drafters.decode.tree import ChainSpec, DynamicSpec, Tree
from drafters.targets import with_cache
from drafters.tiny import build_tiny_architecture
from test_decoding import ReferenceProposer, greedy_reference
from test_sampling import first_two_tokens_pvalue

# gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba (Granite-4), Mamba beside MLP- and MoE-only blocks that keep no cache
# (Nemotron-H), short convolutions whose state is a conv window only (LFM2)
HYBRIDS = ["qwen3_next", "qwen3_5", "granite_hybrid", "nemotron_h", "lfm2"]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    model, _ = build_tiny_architecture(request.param)
    return model


def _prompt(seed, length=16):
    return torch.randint(3, 259, (length,), generator=torch.Generator().manual_seed(seed))


def test_a_hybrid_target_has_recurrent_layers_and_its_own_cache(hybrid):
    assert has_recurrent_layers(hybrid)
    cache = model_cache(hybrid)
    assert sum(isinstance(layer, LinearAttentionLayer) for layer in cache.layers) >= 3  # 3 to 6 of 8 layers


def _layer_state(layer) -> dict:
    # every tensor a cache layer holds (keys / values, each conv and recurrent state, the token count of
    # transformers >= 5.25), cloned, and the lengths as ints: what a rollback must put back bit for bit
    state = {}
    for name in ("keys", "values", "cumulative_length_linear"):
        if isinstance(value := getattr(layer, name, None), torch.Tensor):
            state[name] = value.clone()
    for name in ("conv_states", "recurrent_states"):
        for i, value in getattr(layer, name, {}).items():
            if value is not None:
                state[f"{name}[{i}]"] = value.clone()
    return state


@torch.no_grad()
def test_the_snapshot_restores_every_state_bit_for_bit(hybrid):
    cache = model_cache(hybrid)
    hybrid(_prompt(0)[None], **with_cache(hybrid, cache), use_cache=True)
    before = [_layer_state(layer) for layer in cache.layers]
    snapshot = StateSnapshot(cache)
    chain_forward(hybrid, cache, torch.tensor([5, 6, 7, 8]))
    assert cache.get_seq_length() == 20
    moved = [layer for layer, saved in zip(cache.layers, before) if isinstance(layer, LinearAttentionLayer)
             and not torch.equal(layer.conv_states[0], saved["conv_states[0]"])]
    assert len(moved) == sum(isinstance(layer, LinearAttentionLayer) for layer in cache.layers)  # a real test
    snapshot.restore(cache)
    assert cache.get_seq_length() == 16
    for i, (layer, saved) in enumerate(zip(cache.layers, before)):
        after = _layer_state(layer)
        assert after.keys() == saved.keys(), f"layer {i}"
        for name, value in saved.items():
            assert torch.equal(after[name], value), f"layer {i} ({type(layer).__name__}): {name} not restored"
    # and the restored cache decodes as the untouched one: the next token's logits equal a fresh prefill's
    fresh = model_cache(hybrid)
    expected = hybrid(torch.cat([_prompt(0), torch.tensor([9])])[None], **with_cache(hybrid, fresh), use_cache=True)
    got = chain_forward(hybrid, cache, torch.tensor([9]))
    torch.testing.assert_close(got.logits[0, -1], expected.logits[0, -1], rtol=1e-4, atol=1e-4)


@functools.cache
def tiny(arch):
    return build_tiny_architecture(arch)[0]


# every tree kind with drafts rejected (0.4) on every hybrid; all accepted (0.0) on a DeltaNet and a Mamba hybrid
ROUNDS = [(arch, kind, 0.4) for arch in HYBRIDS for kind in ("chain:4", "static", "dynamic")] + [
    (arch, kind, 0.0) for arch in ("qwen3_next", "granite_hybrid") for kind in ("chain:4", "static", "dynamic")]


@pytest.mark.parametrize("arch, kind, corrupt", ROUNDS)
def test_greedy_equals_generate_with_drafts_rejected_and_rolled_back(arch, kind, corrupt):
    hybrid = tiny(arch)
    prompt = _prompt(4)
    reference = greedy_reference(hybrid, prompt, 30)
    proposer = ReferenceProposer(reference, kind, corrupt, seed=5)
    out, stats = speculative_generate(hybrid, proposer, prompt, max_new_tokens=30)
    assert out.tolist() == reference.tolist()
    assert 1 + sum(a + 1 for a in stats.accepted) == 30
    assert stats.tree_sizes == [depth + 1 for depth in stats.tree_depths]  # every round verified a chain
    full = stats.accepted[:-1]  # the last round may be cut by max_new_tokens
    if corrupt == 0.0:  # the oracle: every draft accepted, no rollback
        assert full == stats.tree_depths[:-1]
    else:  # rejections (rolled back) and acceptances both happened
        assert any(a < depth for a, depth in zip(full, stats.tree_depths)) and stats.tau > 1.5


@torch.no_grad()
def test_the_proposer_gets_the_targets_features_at_committed_positions(hybrid):
    prompt = _prompt(6)

    class Recording(ReferenceProposer):
        needs = TargetNeeds(layers=(2,), last_hidden=True)

        def reset(self, prompt_ids, features):
            self.seen = [(prompt_ids, features)]

        def update(self, new_tokens, features, pending):
            self.seen.append((new_tokens, features))

    proposer = Recording(greedy_reference(hybrid, prompt, 40), "static", corrupt=0.4, seed=2)
    out, stats = speculative_generate(hybrid, proposer, prompt, max_new_tokens=20)
    tokens = torch.cat([t for t, _ in proposer.seen])  # every committed token, in cache order
    assert tokens.tolist() == out[: len(tokens)].tolist() and stats.num_rounds == len(proposer.seen)
    full = hybrid(out[None], output_hidden_states=True)
    cat = lambda get: torch.cat([get(f) for _, f in proposer.seen], dim=1)  # (1, T', H)
    torch.testing.assert_close(cat(lambda f: f.hidden_states[2]), full.hidden_states[2][:, : len(tokens)],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cat(lambda f: f.logits), full.logits[:, : len(tokens)], atol=1e-4, rtol=1e-4)


def test_first_chain_keeps_the_top_path_and_its_draft_rows():
    probs = torch.rand(5, 7)
    tree = Tree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 2]), None)
    chain = first_chain(Tree(tree.tokens, tree.parents, probs))
    assert chain.tokens.tolist() == [1, 2, 4] and chain.parents.tolist() == [-1, 0, 1]
    assert torch.equal(chain.draft_probs, probs[[0, 1, 3]])
    already = Tree.chain(torch.tensor([1, 2, 3]))
    assert first_chain(already) is already


class SampledTwoBranches:
    """Draws a 2-wide, 2-deep tree from q = the target's own distribution tempered to 2 (so drafts are accepted
    and rejected), without replacement, with its draft rows: the decoder verifies its first-child chain."""

    needs = TargetNeeds()

    def __init__(self, model):
        self.model, self.gen, self.seen = model, torch.Generator().manual_seed(11), {}

    def reset(self, prompt_ids, features):
        pass

    def update(self, new_tokens, features, pending):
        pass

    @torch.no_grad()
    def propose(self, context, pending, sampling):
        def q_after(tokens):  # memoised: every run starts from the same prompt
            key = tuple(context.tolist() + tokens)
            if key not in self.seen:
                logits = self.model(torch.tensor(key)[None]).logits[0, -1]
                self.seen[key] = warp(logits, SamplingConfig(temperature=2.0, top_k=6))
            return self.seen[key]

        q0 = q_after([pending])
        first = sample_without_replacement(q0, 2, self.gen).tolist()
        q1 = q_after([pending, first[0]])
        second = int(sample_without_replacement(q1, 1, self.gen)[0])
        rest = q0.clone()
        rest[first[0]] = 0
        rows = torch.stack([q0, q0, rest / rest.sum(), q1])  # node 2 drawn after node 1, without replacement
        return Tree(torch.tensor([pending, first[0], first[1], second]), torch.tensor([-1, 0, 0, 1]), rows)


@torch.no_grad()
def test_sampling_on_a_hybrid_target_reproduces_its_distribution():
    model, _ = build_tiny_architecture("qwen3_next")
    pvalue, accepted = first_two_tokens_pvalue(model, SampledTwoBranches(model), _prompt(3), runs=200)
    assert accepted > 20 and pvalue > 1e-3


def test_windowed_attention_beside_recurrent_layers_is_refused_in_one_sentence():
    model, _ = build_tiny_architecture("qwen3_next")
    model.config.layer_types = ["sliding_attention" if t == "full_attention" else t for t in model.config.layer_types]
    with pytest.raises(NotImplementedError, match="mixes recurrent layers with windowed attention"):
        check_tree_decodable(model)


@pytest.mark.parametrize("arch", ["qwen3_5", "granite_hybrid", "lfm2"])
def test_a_hybrid_draft_model_drafts_chains_losslessly_in_its_own_cache(arch):
    # the draft is the target with a noisy LM head: it agrees often, not always, so rounds both accept and roll back
    target = tiny(arch)
    draft, _ = build_tiny_architecture(arch)
    with torch.no_grad():
        draft.lm_head.weight += 0.6 * draft.lm_head.weight.std() * torch.randn(
            draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(3))
    proposer = DraftModelProposer(draft, ChainSpec(3), target_vocab_size=target.config.vocab_size)
    prompt = _prompt(8)
    reference = greedy_reference(target, prompt, 30)
    out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=30)
    assert out.tolist() == reference.tolist()
    full = stats.accepted[:-1]
    assert any(a < 3 for a in full) and any(a > 0 for a in full)
    # the draft model's cache holds the committed tokens only: its drafted tokens were rolled back
    assert int(proposer.cache.get_seq_length()) == proposer.cached.numel() <= out.numel()
    assert proposer.cached.tolist() == out[: proposer.cached.numel()].tolist()


def test_a_hybrid_draft_model_refuses_a_tree_in_one_sentence():
    with pytest.raises(ValueError, match=r"recurrent layers.*use a chain \(--tree chain:K\)"):
        DraftModelProposer(tiny("qwen3_5"), DynamicSpec(), target_vocab_size=tiny("qwen3_5").config.vocab_size)
