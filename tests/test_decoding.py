"""The shared tree decoder: tree forward == sequential forward, greedy == generate, lossless sampling."""

import pytest
import torch
from torch import Tensor
from transformers import DynamicCache, GenerationConfig

from drafters.targets import with_cache
from drafters.decode.cache import compact_cache
from drafters.decode.decoder import speculative_generate, tree_attention_mask, tree_forward
from drafters.decode.proposers import TargetNeeds
from drafters.tiny import build_tiny_target
from drafters.decode.tree import EAGLE1_PATHS, Frontier, Tree, TreeShape, build_dynamic_tree, build_static_tree

VOCAB = 259
MODELS = ["varied_llama", "tiny_gemma3"]


@pytest.fixture(scope="module")
def varied_llama():
    # varied greedy continuations, so drafts can be right or wrong (see build_tiny_target)
    return build_tiny_target("tiny-random-llama", untied_head_seed=1)[0]


def _model(request, name):
    model = request.getfixturevalue(name)
    return model[0] if isinstance(model, tuple) else model


def _prompt(seed, length=12):
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def greedy_reference(model, prompt, max_new_tokens, eos=None):
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return model.generate(prompt[None], generation_config=config)[0]


_REFERENCES = {}


def long_reference(model, prompt):
    # 60 greedy tokens without EOS; greedy with max_new_tokens=n < 60 is its first n tokens
    key = (id(model), tuple(prompt.tolist()))
    if key not in _REFERENCES:
        _REFERENCES[key] = greedy_reference(model, prompt, 60)
    return _REFERENCES[key]


def _path_tokens(frontier: Frontier, node: int) -> list[int]:
    parents, tokens, path = frontier.pool_parents.tolist(), frontier.pool_tokens.tolist(), []
    while node != -1:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


class ReferenceProposer:
    """Drafts from a known greedy continuation `reference` (prompt + new tokens): at every node on
    the reference path the true next token scores best, unless corrupted (probability `corrupt`,
    then a random token does); everything else scores at random. corrupt=1 is a random drafter."""

    needs = TargetNeeds()

    def __init__(self, reference: Tensor, kind: str, corrupt: float = 0.0, seed: int = 0):
        self.reference, self.kind, self.corrupt = reference.tolist(), kind, corrupt
        self.gen = torch.Generator().manual_seed(seed)

    def reset(self, prompt_ids, features):
        assert features is None

    def update(self, new_tokens, features, pending):
        assert features is None and new_tokens.ndim == 1

    def expand(self, frontier: Frontier) -> Tensor:
        scores = torch.randn(len(frontier.nodes), VOCAB, generator=self.gen)  # (F, V)
        for row, node in enumerate(frontier.nodes.tolist()):
            path = _path_tokens(frontier, node)
            at = self.position + len(path)
            if self.reference[self.position : at] == path and at < len(self.reference):
                if torch.rand((), generator=self.gen) >= self.corrupt:
                    scores[row, self.reference[at]] = scores[row].max() + 10.0  # confident
        return scores.log_softmax(-1)

    def propose(self, context, pending, sampling):
        self.position = len(context)
        if self.kind.startswith("chain:"):
            tokens = [pending]
            for depth in range(int(self.kind[6:])):
                pool = torch.tensor(tokens)
                frontier = Frontier(depth, torch.tensor([depth]), pool[-1:], torch.arange(-1, depth), pool)
                tokens.append(int(self.expand(frontier).argmax()))
            return Tree.chain(torch.tensor(tokens))
        if self.kind == "static":
            return build_static_tree(TreeShape.from_paths(EAGLE1_PATHS), pending, self.expand)
        return build_dynamic_tree(pending, self.expand, depth=5, topk=3, total=12)


# ---------------------------------------------------------------- tree forward == sequential forward


def _random_tree(kind, root, gen):
    if kind == "chain":
        return Tree.chain(torch.cat([torch.tensor([root]), torch.randint(3, VOCAB, (6,), generator=gen)]))
    if kind == "static":
        shape = TreeShape.from_paths(EAGLE1_PATHS)
        return shape.fill(root, torch.randint(3, VOCAB, (shape.num_nodes, 4), generator=gen))
    expand = lambda f: torch.randn(len(f.nodes), VOCAB, generator=gen).log_softmax(-1)
    return build_dynamic_tree(root, expand, depth=5, topk=4, total=20)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["chain", "static", "dynamic"])
@torch.no_grad()
def test_tree_forward_matches_sequential(request, name, kind):
    model = _model(request, name)
    gen = torch.Generator().manual_seed(3)
    prompt = _prompt(1, length=80)  # longer than Gemma-3's sliding window (64)
    cache = DynamicCache()
    model(prompt[None], **with_cache(model, cache), use_cache=True)
    tree = _random_tree(kind, 42, gen)
    logits = tree_forward(model, cache, tree).logits[0]  # (N, V)
    for path in tree.paths:
        sequential = model(torch.cat([prompt, tree.tokens[path]])[None]).logits[0, -len(path):]
        torch.testing.assert_close(logits[path], sequential, atol=1e-4, rtol=1e-4)
    # compaction: keep the longest path, then one more token must see exactly prompt + path
    path = max(tree.paths, key=len)
    compact_cache(cache, len(prompt), torch.tensor(path))
    assert cache.get_seq_length() == len(prompt) + len(path)
    nxt = model(torch.tensor([[7]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
    sequential = model(torch.cat([prompt, tree.tokens[path], torch.tensor([7])])[None]).logits[0, -1]
    torch.testing.assert_close(nxt, sequential, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_gemma3_sliding_window_matters(tiny_gemma3):
    # control for the test above: one 4D mask without the window for every layer is wrong here
    model = tiny_gemma3[0]
    prompt = _prompt(1, length=80)
    cache = DynamicCache()
    model(prompt[None], **with_cache(model, cache), use_cache=True)
    tree = Tree.chain(torch.tensor([42, 43, 44]))
    mask = tree_attention_mask(tree, len(prompt), model.dtype)  # no window
    logits = model(tree.tokens[None], attention_mask=mask, position_ids=(80 + tree.depths)[None],
                   **with_cache(model, cache)).logits[0]
    sequential = model(torch.cat([prompt, tree.tokens])[None]).logits[0, -3:]
    assert (logits - sequential).abs().max() > 1e-3


@torch.no_grad()
def test_compaction_refuses_sliding_window_cache_layers(tiny_gemma3):
    # a config-built cache keeps only the last W-1 keys of sliding layers: compaction would be wrong
    model = tiny_gemma3[0]
    cache = DynamicCache(config=model.config)
    model(_prompt(0)[None], **with_cache(model, cache), use_cache=True)
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer"):
        compact_cache(cache, 10, torch.tensor([0, 1]))


# ---------------------------------------------------------------- greedy == generate


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["chain:4", "static", "dynamic"])
@pytest.mark.parametrize("corrupt", [0.3, 1.0])
def test_greedy_matches_generate(request, name, kind, corrupt):
    model = _model(request, name)
    prompt = _prompt(4)
    reference = long_reference(model, prompt)
    proposer = ReferenceProposer(reference, kind, corrupt, seed=5)
    out, stats = speculative_generate(model, proposer, prompt, max_new_tokens=30)
    assert out.tolist() == reference[: len(prompt) + 30].tolist()
    assert 1 + sum(a + 1 for a in stats.accepted) == 30  # prefill token + every round's tokens
    if corrupt == 1.0:
        assert stats.tau < 1.5
    else:
        assert stats.tau > 1.5


def test_greedy_matches_generate_eager_attention():
    # eager attention adds the mask to the scores: the float mask must be additive (0 / min)
    model, _ = build_tiny_target("tiny-random-gemma3")
    model.set_attn_implementation("eager")
    prompt = _prompt(5, length=70)
    reference = greedy_reference(model, prompt, 30)
    out, _ = speculative_generate(model, ReferenceProposer(reference, "dynamic", 0.3), prompt, max_new_tokens=30)
    assert out.tolist() == reference.tolist()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind, depth", [("chain:4", 4), ("static", 5), ("dynamic", 5)])
def test_oracle_accepts_every_draft(request, name, kind, depth):
    model = _model(request, name)
    prompt = _prompt(4)
    reference = long_reference(model, prompt)
    out, stats = speculative_generate(model, ReferenceProposer(reference, kind), prompt, max_new_tokens=40)
    assert out.tolist() == reference[: len(prompt) + 40].tolist()
    full_rounds = stats.accepted[:-1]  # the last round may be cut by max_new_tokens
    assert len(full_rounds) >= 5 and full_rounds == [depth] * len(full_rounds)
    assert sum(a + 1 for a in full_rounds) / len(full_rounds) == depth + 1  # tau over full rounds


@pytest.mark.parametrize("name", MODELS)
def test_eos_inside_accepted_path(request, name):
    model = _model(request, name)
    prompt = _prompt(5)
    reference = long_reference(model, prompt)  # no EOS: continues past the token we pick
    new = reference[len(prompt):].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 10 and t not in new[:i])  # first appears at i
    expected = greedy_reference(model, prompt, 60, eos=eos)
    assert expected[-1] == eos and len(expected) < len(reference)
    out, stats = speculative_generate(model, ReferenceProposer(reference, "chain:8"), prompt,
                                      max_new_tokens=60, eos_token_ids={eos})
    assert out.tolist() == expected.tolist()
    assert stats.accepted[-1] < 8  # the oracle drafted past the EOS; the round was cut after it


def test_natural_eos(tiny_gemma3):
    model = tiny_gemma3[0]
    prompt = _prompt(2)  # tiny gemma3 greedily emits <|im_end|> (id 2) after 24 tokens here
    expected = greedy_reference(model, prompt, 60, eos=2)
    assert expected[-1] == 2
    proposer = ReferenceProposer(long_reference(model, prompt), "static", corrupt=0.3)
    out, _ = speculative_generate(model, proposer, prompt, max_new_tokens=60, eos_token_ids=[2])
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("max_new_tokens, accepted", [(18, [4, 4, 4, 1]), (16, [4, 4, 4]), (1, []), (3, [1])])
def test_max_new_tokens_mid_path(tiny_gemma3, max_new_tokens, accepted):
    model = tiny_gemma3[0]
    prompt = _prompt(4)
    reference = long_reference(model, prompt)
    out, stats = speculative_generate(model, ReferenceProposer(reference, "chain:4"), prompt,
                                      max_new_tokens=max_new_tokens)
    assert out.tolist() == greedy_reference(model, prompt, max_new_tokens).tolist()
    assert stats.accepted == accepted


def test_bad_arguments_raise(tiny_gemma3):
    model = tiny_gemma3[0]
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(model, ReferenceProposer(_prompt(0), "chain:2"), _prompt(0), max_new_tokens=0)

    class WrongRoot(ReferenceProposer):
        def propose(self, context, pending, sampling):
            return Tree.chain(torch.tensor([pending + 1, 5]))

    with pytest.raises(ValueError, match="pending token"):
        speculative_generate(model, WrongRoot(_prompt(0), "chain:2"), _prompt(0), max_new_tokens=5)



def test_round_stats_depth_acceptance():
    from drafters.decode.decoder import RoundStats

    stats = RoundStats(accepted=[2, 0, 3, 1], tree_sizes=[4, 4, 4, 3], tree_depths=[3, 3, 3, 2])
    assert stats.tau == (3 + 1 + 4 + 2) / 4
    assert stats.depth_acceptance() == [3 / 4, 2 / 4, 1 / 3]


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_proposer_gets_target_features_at_committed_positions(request, name):
    model = _model(request, name)
    prompt = _prompt(6, length=70)  # past Gemma-3's sliding window

    class Recording(ReferenceProposer):
        needs = TargetNeeds(layers=(2,), pre_norm_last=True, last_hidden=True)

        def reset(self, prompt_ids, features):
            self.seen = [(prompt_ids, features)]

        def update(self, new_tokens, features, pending):
            self.seen.append((new_tokens, features))

    proposer = Recording(long_reference(model, prompt), "static", corrupt=0.3)
    out, stats = speculative_generate(model, proposer, prompt, max_new_tokens=20)
    tokens = torch.cat([t for t, _ in proposer.seen])  # (T',) every token handed over, in cache order
    assert tokens.tolist() == out[: len(tokens)].tolist() and stats.num_rounds == len(proposer.seen)
    full = model(out[None], output_hidden_states=True)
    cat = lambda get: torch.cat([get(f) for _, f in proposer.seen], dim=1)  # (1, T', H)
    torch.testing.assert_close(cat(lambda f: f.hidden_states[2]), full.hidden_states[2][:, : len(tokens)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cat(lambda f: f.last_hidden), full.hidden_states[-1][:, : len(tokens)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cat(lambda f: f.logits), full.logits[:, : len(tokens)], atol=1e-4, rtol=1e-4)
    pre_norm = cat(lambda f: f.pre_norm_last)
    torch.testing.assert_close(model.get_decoder().norm(pre_norm), full.hidden_states[-1][:, : len(tokens)], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=["MistralConfig", "Phi3Config"])
def config_window(request):
    # a sliding window set on the config alone, no layer_types (Mistral-7B-v0.1, Phi-3): every layer is windowed
    import transformers

    cls = getattr(transformers, request.param)
    config = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, sliding_window=8, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # varied greedy continuations
    return model.eval()


@torch.no_grad()
def test_a_config_level_window_decodes_like_generate(config_window):
    model = config_window
    assert getattr(model.config, "layer_types", None) is None
    prompt = _prompt(1, length=20)  # past the window of 8
    cache = DynamicCache()
    model(prompt[None], **with_cache(model, cache), use_cache=True)
    tree = _random_tree("static", 42, torch.Generator().manual_seed(3))
    logits = tree_forward(model, cache, tree).logits[0]
    for path in tree.paths:
        sequential = model(torch.cat([prompt, tree.tokens[path]])[None]).logits[0, -len(path):]
        torch.testing.assert_close(logits[path], sequential, atol=1e-4, rtol=1e-4)
    # the window matters here: without it, the tree's logits differ from the model's
    unwindowed = model(tree.tokens[None], attention_mask=tree_attention_mask(tree, 20, model.dtype),
                       position_ids=(20 + tree.depths)[None], **with_cache(model, cache_of(model, prompt))).logits[0]
    assert (unwindowed - logits).abs().max() > 1e-3
    reference = greedy_reference(model, prompt, 24)
    for kind in ("chain:4", "dynamic"):
        out, stats = speculative_generate(model, ReferenceProposer(reference, kind, 0.3, seed=5), prompt,
                                          max_new_tokens=24)
        assert out.tolist() == reference.tolist() and stats.tau > 1.5


def cache_of(model, prompt):
    cache = DynamicCache()
    model(prompt[None], **with_cache(model, cache), use_cache=True)
    return cache
