"""Prompt lookup and draft-model proposers: drafts on hand-made sequences, lossless decoding."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafters.checkpoint import save_checkpoint, target_info
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.adaptive import AdaptiveChain
from drafters.decode.proposers.draft_model import DraftModelProposer
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.proposers.prompt_lookup import PromptLookupProposer, find_continuations
from drafters.decode.sampling import SamplingConfig
from drafters.targets import load_target
from drafters.tiny import build_tiny_target
from drafters.decode.tree import ChainSpec, DynamicSpec, parse_tree_spec

GREEDY = SamplingConfig()


def propose(proposer, sequence):
    return proposer.propose(torch.tensor(sequence[:-1]), sequence[-1], GREEDY)


# ---------------------------------------------------------------- prompt lookup


def test_prompt_lookup_chain_continues_the_earlier_occurrence():
    tree = propose(PromptLookupProposer(depth=3), [5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    assert tree.tokens.tolist() == [7, 8, 9, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.draft_probs is None


def test_prompt_lookup_prefers_the_longer_ngram():
    # the 1-gram "2" last occurred at index 4 (-> 4), the 2-gram "1 2" only at index 0 (-> 3)
    tree = propose(PromptLookupProposer(depth=2), [1, 2, 3, 9, 2, 4, 1, 2])
    assert tree.tokens.tolist() == [2, 3, 9]


def test_prompt_lookup_prefers_a_full_length_continuation_over_an_overlapping_match():
    # the most recent match of "7 7 7" ends one token before the end: it could draft only one token
    tree = propose(PromptLookupProposer(depth=3), [7] * 6)
    assert tree.tokens.tolist() == [7, 7, 7, 7]


def test_prompt_lookup_without_a_match_proposes_only_the_root():
    tree = propose(PromptLookupProposer(depth=4), [1, 2, 3, 4])
    assert tree.tokens.tolist() == [4] and tree.num_nodes == 1


def test_prompt_lookup_tree_merges_distinct_continuations():
    tree = propose(PromptLookupProposer(depth=2, branches=2), [1, 2, 3, 7, 1, 2, 3, 4, 1, 2])
    assert tree.tokens.tolist() == [2, 3, 4, 7]  # "3" is shared, then "4" (most recent) and "7"
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    tree = propose(PromptLookupProposer(depth=2, branches=2), [1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    assert sorted(tree.tokens[tree.children[0]].tolist()) == [3, 5]
    capped = propose(PromptLookupProposer(depth=2, branches=2, max_nodes=3),
                     [1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    assert capped.num_nodes == 4


def test_prompt_lookup_stops_drafting_after_eos():
    found = find_continuations(torch.tensor([1, 2, 3, 0, 9, 1, 2]), length=4, eos_token_ids={0})
    assert found == [[3, 0]]


def test_prompt_lookup_decoding_is_lossless(tiny_llama):
    model, tokenizer = tiny_llama
    prompt = torch.tensor(tokenizer("abcabcabc abcabc abc")["input_ids"])
    expected = model.generate(prompt[None], max_new_tokens=40, do_sample=False)[0]
    for tree_spec in ("chain:4", "dynamic:total=10,depth=4,topk=3"):
        target = load_target("tiny-random-llama")
        proposer = load_proposer("prompt-lookup", target, parse_tree_spec(tree_spec))
        out, stats = speculative_generate(model, proposer, prompt, max_new_tokens=40, eos_token_ids={2})
        assert out.tolist() == expected.tolist(), tree_spec
        assert stats.tau > 1.5  # the tiny target loops, so lookups hit


# ---------------------------------------------------------------- draft model


def long_prompt(tokenizer):
    # > 64 tokens, so the Gemma-3 sliding window (64) matters in the draft model too
    text = "The quick brown fox jumps over the lazy dog; " * 2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    return torch.tensor(ids)


@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-gemma3"])
@pytest.mark.parametrize("tree_spec", ["chain:4", "dynamic:total=12,depth=4,topk=3"])
def test_draft_model_decoding_is_lossless(name, tree_spec, tiny_llama, tiny_gemma3):
    model, tokenizer = tiny_llama if name == "tiny-random-llama" else tiny_gemma3
    prompt = long_prompt(tokenizer)
    expected = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0].tolist()
    small, _ = build_tiny_target(name, num_layers=2)
    for draft in (small, model):  # a weaker draft model, and the target itself (all accepted)
        proposer = DraftModelProposer(draft, parse_tree_spec(tree_spec), target_vocab_size=259)
        out, stats = speculative_generate(model, proposer, prompt, max_new_tokens=24, eos_token_ids={2})
        assert out.tolist() == expected, (name, tree_spec)
    assert stats.tau > 2  # the target drafting for itself: only the tree shape limits acceptance


def test_draft_model_tree_children_are_the_sequential_top_k(tiny_gemma3):
    # Each expanded node's children must be the top-k tokens of an ordinary causal forward over
    # context + the node's path: checks the 4D tree mask, positions and sliding window.
    model, _ = tiny_gemma3
    context = torch.randint(3, 259, (100,), generator=torch.Generator().manual_seed(0))
    proposer = DraftModelProposer(model, DynamicSpec(total=1000, depth=3, topk=3), target_vocab_size=259)
    proposer.reset(context[:40])
    for round_context in (context, torch.cat([context, torch.tensor([7, 8])])):
        tree = proposer.propose(round_context, 9, GREEDY)
        assert tree.num_nodes == 1 + 3 + 9 + 9
        for node, kids in enumerate(tree.children):
            if kids:
                path = tree.tokens[tree.path_to(node)]
                with torch.no_grad():
                    logits = model(torch.cat([round_context, path])[None]).logits[0, -1]
                assert set(tree.tokens[kids].tolist()) == set(logits.topk(3).indices.tolist())
        assert proposer.cache.get_seq_length() == round_context.numel() + 1  # tree KV dropped


def test_draft_model_sampled_chain_carries_its_draft_distribution(tiny_llama):
    model, tokenizer = tiny_llama
    proposer = DraftModelProposer(model, ChainSpec(3), target_vocab_size=259)
    prompt = long_prompt(tokenizer)
    proposer.reset(prompt)
    tree = proposer.propose(prompt, 65, SamplingConfig(temperature=1.0, top_k=20))
    probs = tree.draft_probs
    assert probs.shape == (4, 259)
    assert torch.allclose(probs[1:].sum(-1), torch.ones(3))
    assert (probs[1:].gather(1, tree.tokens[1:, None]) > 0).all()
    assert ((probs[1:] > 0).sum(-1) <= 20).all()  # top-k warping applied to q


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama):
    config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelProposer(LlamaForCausalLM(config), ChainSpec(4), target_vocab_size=259)


def test_adaptive_chain_grows_after_full_acceptance_and_shrinks_otherwise():
    adaptive = AdaptiveChain(PromptLookupProposer(depth=4))
    adaptive.reset(torch.tensor([1, 2]))
    adaptive.update(torch.arange(5), None, 0)  # pending + 4 accepted
    assert adaptive.proposer.depth == 6
    adaptive.update(torch.arange(3), None, 0)  # pending + 2 of 6
    assert adaptive.proposer.depth == 5
    adaptive.reset(torch.tensor([1, 2]))
    assert adaptive.proposer.depth == 4
    with pytest.raises(ValueError, match="chain"):
        AdaptiveChain(DraftModelProposer(build_tiny_target()[0], DynamicSpec(), target_vocab_size=259))


# ---------------------------------------------------------------- load_proposer


def test_load_proposer_rejects_unknown_specs_and_foreign_checkpoints(tmp_path):
    target = load_target("tiny-random-llama")
    with pytest.raises(ValueError, match="unknown proposer 'medusa-ish'.*prompt-lookup"):
        load_proposer("medusa-ish", target, ChainSpec(4))
    with pytest.raises(ValueError, match="neither drafter.json"):
        load_proposer(str(tmp_path), target, ChainSpec(4))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                      "hidden_size": 64, "vocab_size": 49152}))
    with pytest.raises(ValueError, match="vocab_size: checkpoint 49152 vs target 259"):
        load_proposer(str(tmp_path), target, ChainSpec(4))
    foreign_layers = {"eagle_aux_hidden_state_layer_ids": [1, 15, 27]}  # a 30-layer target's
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "vocab_size": 259,
                                                      "eagle_config": foreign_layers}))
    with pytest.raises(ValueError, match="auxiliary layer ids"):
        load_proposer(str(tmp_path), target, ChainSpec(4))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "vocab_size": 259}))
    with pytest.raises(ValueError, match="no loader for this format"):
        load_proposer(str(tmp_path), target, ChainSpec(4))


def test_native_checkpoint_for_another_target_is_refused(tmp_path):
    llama, gemma = load_target("tiny-random-llama"), load_target("tiny-random-gemma3")
    weights = {"fc.weight": torch.zeros(2, 2)}
    save_checkpoint(tmp_path / "ckpt", family="hydra", config={}, target=target_info(gemma),
                    state_dict=weights)
    wider = dict(target_info(llama), hidden_size=128)
    save_checkpoint(tmp_path / "wide", family="eagle3", config={}, target=wider, state_dict=weights)
    with pytest.raises(ValueError, match="hidden_size: checkpoint 128 vs target 64"):
        load_proposer(str(tmp_path / "wide"), llama, ChainSpec(4))
    with pytest.raises(ValueError, match="no proposer for family 'hydra'"):
        load_proposer(str(tmp_path / "ckpt"), gemma, ChainSpec(4))
    save_checkpoint(tmp_path / "broken", family="eagle3", config={}, target=target_info(gemma), state_dict=weights)
    with pytest.raises(ValueError, match="drafter config does not fit Eagle3Config"):
        load_proposer(str(tmp_path / "broken"), gemma, ChainSpec(4))
