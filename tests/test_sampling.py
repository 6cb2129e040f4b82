"""Warping matches HF generate; stochastic tree verification reproduces the target distribution."""

import pytest
import torch
from transformers import GenerationConfig

from drafters.decode.decoder import speculative_generate, verify_sampling
from drafters.decode.proposers import TargetNeeds
from drafters.decode.sampling import SamplingConfig, sample_without_replacement, warp
from drafters.decode.tree import Tree

# ---------------------------------------------------------------- warping


def test_sampling_config_validation():
    for bad in [dict(temperature=-0.5), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(eta=1.0)]:
        with pytest.raises(ValueError, match="SamplingConfig"):
            SamplingConfig(**bad)
    assert SamplingConfig().greedy and not SamplingConfig(temperature=0.7).greedy


@pytest.mark.parametrize("settings", [
    dict(temperature=0.7, top_k=20, top_p=0.9, eta=0.01),
    dict(temperature=1.3, top_p=0.5),
    dict(temperature=1.0, top_k=4),
    dict(temperature=0.9, eta=0.002),
])
def test_warp_matches_hf_generate_processors(tiny_llama, settings):
    model = tiny_llama[0]
    config = GenerationConfig(do_sample=True, temperature=settings["temperature"], top_k=settings.get("top_k", 0),
                              top_p=settings.get("top_p", 1.0), eta_cutoff=settings.get("eta", 0.0))
    processors = model._get_logits_processor(config, input_ids_seq_length=1, device="cpu")
    logits = torch.randn(6, 259, generator=torch.Generator().manual_seed(0)) * 3  # (R, V)
    expected = processors(torch.zeros(6, 1, dtype=torch.long), logits.clone()).softmax(-1)
    torch.testing.assert_close(warp(logits, SamplingConfig(**settings)), expected)


def test_greedy_warp_is_one_hot():
    probs = warp(torch.tensor([[0.1, 3.0, -1.0]]), SamplingConfig())
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


# ---------------------------------------------------------------- lossless verification, synthetic p / q

V = 5


def _synthetic_target():
    # p(x1) and p(x2 | x1) over V tokens, each with a token the target never emits (as top-k gives)
    gen = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    p2 = (torch.randn(V, V, generator=gen) * 1.5).softmax(-1)
    p2[torch.arange(V), torch.randint(V, (V,), generator=gen)] = 0.0
    p2 = p2 / p2.sum(-1, keepdim=True)
    return p1, p2


def _target(p1, p2, context: tuple) -> torch.Tensor:
    if len(context) == 0:
        return p1
    return p2[context[0]] if len(context) == 1 else torch.full((V,), 1.0 / V)


def _adversarial(p):
    # draft mass concentrated where the target is small (or zero)
    q = torch.exp(-8 * p)
    return q / q.sum()


def _synthetic_tree(p1, p2, context, gen, sampled: bool) -> Tree:
    # root -> 3 children -> 2 grandchildren each; sampled: drawn without replacement from the
    # adversarial draft; else fixed tokens (the 3 / 2 least likely under the target), draft_probs None
    tokens, parents, rows = [context[-1] if context else 0], [-1], [torch.zeros(V)]

    def add_children(parent, ctx, width):
        p = _target(p1, p2, ctx)
        q = _adversarial(p)
        picks = sample_without_replacement(q, width, gen) if sampled else p.argsort()[:width]
        for token in picks.tolist():
            tokens.append(token), parents.append(parent), rows.append(q)

    add_children(0, context, 3)
    for child in range(1, 4):
        add_children(child, context + (tokens[child],), 2)
    probs = torch.stack(rows) if sampled else None
    return Tree(torch.tensor(tokens), torch.tensor(parents), probs)


def _first_two_tokens(p1, p2, gen, sampled, **rule):
    out = ()
    while len(out) < 2:
        tree = _synthetic_tree(p1, p2, out, gen, sampled)
        node_context = lambda u, out=out: out + tuple(tree.tokens[tree.path_to(u)[1:]].tolist())
        path, bonus = verify_sampling(tree, lambda u: _target(p1, p2, node_context(u)), gen, **rule)
        out = out + tuple(tree.tokens[path[1:]].tolist()) + (bonus,)
    return out[:2]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    # counts, probs (C,); impossible cells must stay empty; p-value of Pearson's statistic
    possible = probs > 0
    assert counts[~possible].sum() == 0, "an outcome the target never produces was generated"
    expected = probs[possible] * counts.sum()
    stat = ((counts[possible] - expected) ** 2 / expected).sum()
    dof = torch.tensor(possible.sum().item() - 1.0)
    return torch.special.gammaincc(dof / 2, stat / 2).item()


@torch.no_grad()
def first_two_tokens_pvalue(model, proposer, prompt, runs: int = 400, top_k: int = 4) -> tuple[float, int]:
    """A proposer's sampled decoding, end to end: the first two new tokens `runs` times over (the first from the
    prefill, the second from a drafted round: an accepted draft, or a residual / bonus sample), and their joint
    law against the target's at temperature 1, top-k (Pearson's chi-square). A third token keeps an accepted
    draft countable (with two, the budget cuts every round to its first token). -> (p-value, rounds whose first
    draft was accepted: the acceptance rule must be exercised, not only the bonus)."""
    from drafters.decode.decoder import speculative_generate

    cfg = SamplingConfig(temperature=1.0, top_k=top_k)
    n = prompt.numel()
    p1 = warp(model(prompt[None]).logits[0, -1], cfg)  # (V,)
    firsts = p1.nonzero().flatten().tolist()
    p2 = {x: warp(model(torch.cat([prompt, torch.tensor([x])])[None]).logits[0, -1], cfg) for x in firsts}
    columns = {x: p2[x].nonzero().flatten().tolist() for x in firsts}
    gen, counts, accepted = torch.Generator().manual_seed(3), torch.zeros(len(firsts), top_k), 0
    for _ in range(runs):
        out, stats = speculative_generate(model, proposer, prompt, max_new_tokens=3, sampling=cfg, generator=gen)
        x1, x2 = out[n:n + 2].tolist()
        counts[firsts.index(x1), columns[x1].index(x2)] += 1  # raises if x2 is outside the target's top-k
        accepted += stats.accepted[0] > 0
    exact = torch.stack([p1[x] * p2[x][columns[x]] for x in firsts])
    return chi_square_pvalue(counts.flatten(), exact.flatten()), accepted


def _empirical(samples: int, sampled: bool, **rule):
    p1, p2 = _synthetic_target()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V * V)
    for _ in range(samples):
        x1, x2 = _first_two_tokens(p1, p2, gen, sampled, **rule)
        counts[x1 * V + x2] += 1
    return counts, (p1[:, None] * p2).flatten()


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_siblings", "deterministic_siblings"])
def test_recursive_rejection_sampling_is_lossless(sampled):
    counts, exact = _empirical(4000, sampled)
    assert chi_square_pvalue(counts, exact) > 1e-3


@pytest.mark.slow
def test_wrong_residual_fails_the_same_test():
    # resampling from p after a rejection (instead of norm(max(0, p - q))) over-produces the
    # tokens the adversarial draft proposes: the same chi-square test must reject it
    counts, exact = _empirical(4000, sampled=True, residual=lambda p, q: p)
    assert chi_square_pvalue(counts, exact) < 1e-6


# ---------------------------------------------------------------- lossless end to end


class AdversarialProposer:
    """Three siblings drawn without replacement from a draft that favours the target's least likely
    tokens (plus tokens outside the target's top-k), looked up from exact target distributions."""

    needs = TargetNeeds()

    def __init__(self, target_probs: dict, seed: int):
        self.target_probs, self.gen = target_probs, torch.Generator().manual_seed(seed)

    def reset(self, prompt_ids, features):
        self.prompt_len = len(prompt_ids)

    def update(self, new_tokens, features, pending):
        pass

    def propose(self, context, pending, sampling):
        p = self.target_probs[tuple(context[self.prompt_len:].tolist()) + (pending,)]  # (V,)
        q = torch.where(p > 0, 1.0 / p.clamp(min=1e-6), 0.0)
        q[p.argsort()[:2]] += q.sum()  # two tokens the target (top-k) never emits
        q = q / q.sum()
        kids = sample_without_replacement(q, 3, self.gen)
        tokens = torch.cat([torch.tensor([pending]), kids])
        return Tree(tokens, torch.tensor([-1, 0, 0, 0]), torch.stack([torch.zeros_like(q)] + [q] * 3))


@torch.no_grad()
@pytest.mark.slow
def test_speculative_generate_sampling_matches_target(tiny_llama):
    model = tiny_llama[0]
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    prompt = torch.tensor([1, 40, 41, 42, 43])
    p1 = warp(model(prompt[None]).logits[0, -1], cfg)  # (V,)
    firsts = p1.nonzero().flatten().tolist()
    p2 = {x: warp(model(torch.cat([prompt, torch.tensor([x])])[None]).logits[0, -1], cfg) for x in firsts}
    proposer = AdversarialProposer({(x,): p2[x] for x in firsts}, seed=2)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(len(firsts), 4)
    columns = {x: p2[x].nonzero().flatten().tolist() for x in firsts}
    for _ in range(600):
        out, _ = speculative_generate(model, proposer, prompt, max_new_tokens=2, sampling=cfg, generator=gen)
        x1, x2 = out[-2:].tolist()
        counts[firsts.index(x1), columns[x1].index(x2)] += 1  # raises if x2 is outside the target's top-k
    exact = torch.stack([p1[x] * p2[x][columns[x]] for x in firsts])
    assert chi_square_pvalue(counts.flatten(), exact.flatten()) > 1e-3
