"""merge_trees and the hybrid proposer (a drafter's tree + prompt-lookup branches, verified together):
the merged tree holds both trees' paths once; its greedy acceptance is the better of the two on every
round; decoding stays equal to generate; sampling is refused."""

import pytest
import torch

from drafters.decode.decoder import speculative_generate, verify_greedy
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import Tree, merge_trees, parse_tree_spec
from test_eagle_proposer import NEW, PROMPT, setup  # noqa: F401  (the trained tiny EAGLE-3 drafter fixture)


def tree(tokens, parents):
    return Tree(torch.tensor(tokens), torch.tensor(parents))


def paths(t: Tree) -> set[tuple[int, ...]]:  # token paths from the root to every node
    tokens = t.tokens.tolist()
    return {tuple(tokens[n] for n in t.path_to(i)) for i in range(t.num_nodes)}


def test_merge_shares_common_prefixes_and_appends_the_rest():
    a = tree([9, 1, 2, 3], [-1, 0, 0, 1])  # 9 -> 1 -> 3, 9 -> 2
    b = Tree.chain(torch.tensor([9, 1, 3, 4, 5]))  # shares 9 -> 1 -> 3, then adds 4, 5
    merged = merge_trees(a, b)
    assert merged.tokens.tolist() == [9, 1, 2, 3, 4, 5] and merged.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert paths(merged) == paths(a) | paths(b)
    capped = merge_trees(a, b, max_new=1)  # only 4 fits: 5 has lost its parent
    assert capped.tokens.tolist() == [9, 1, 2, 3, 4]
    assert merge_trees(a, Tree.chain(torch.tensor([9, 2]))).num_nodes == a.num_nodes  # nothing new


def test_merge_refuses_other_roots_and_sampled_trees():
    with pytest.raises(ValueError, match="roots differ"):
        merge_trees(Tree.chain(torch.tensor([1, 2])), Tree.chain(torch.tensor([3, 4])))
    sampled = Tree.chain(torch.tensor([1, 2]), draft_probs=torch.full((2, 5), 0.2))
    with pytest.raises(ValueError, match="deterministic"):
        merge_trees(sampled, Tree.chain(torch.tensor([1, 2])))


@pytest.mark.parametrize("seed", range(20))
def test_greedy_acceptance_of_the_merge_is_the_better_of_the_two(seed):
    # random trees and random target logits per node: verify_greedy follows the target's argmax child,
    # so on the merged tree it accepts the longer of the two trees' accepted paths, never less
    g = torch.Generator().manual_seed(seed)
    vocab = 8  # more than the most children a node can have here, so siblings can always differ

    def random_tree(n):
        parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)]
        tokens = [0] + torch.randint(vocab, (n - 1,), generator=g).tolist()
        seen = set()
        for i in range(1, n):  # siblings need distinct tokens
            while (parents[i], tokens[i]) in seen:
                tokens[i] = (tokens[i] + 1) % vocab
            seen.add((parents[i], tokens[i]))
        return tree(tokens, parents)

    a, b = random_tree(6), random_tree(5)
    argmax_after = {}  # token path -> the target's greedy next token there (the same for every tree)

    def accepted(t: Tree) -> int:
        tokens = t.tokens.tolist()
        logits = torch.zeros(t.num_nodes, vocab)
        for i in range(t.num_nodes):
            key = tuple(tokens[n] for n in t.path_to(i))
            nxt = argmax_after.setdefault(key, int(torch.randint(vocab, (1,), generator=g)))
            logits[i, nxt] = 1.0
        return len(verify_greedy(t, logits)[0]) - 1

    assert accepted(merge_trees(a, b)) == max(accepted(a), accepted(b))


def test_hybrid_decoding_equals_generate_and_refuses_sampling(setup):  # noqa: F811
    target, references, path = setup
    spec = parse_tree_spec("dynamic:total=8,depth=4,topk=3")
    proposer = load_proposer(f"{path}+prompt-lookup", target, spec)
    for row in range(2):
        prompt = references[row, :PROMPT]
        out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
        assert out.tolist() == references[row, :PROMPT + NEW].tolist()
        assert max(stats.tree_sizes) <= 1 + 8 + 4  # the drafter's budget + one lookup branch of the depth
    with pytest.raises(ValueError, match="greedily only"):
        proposer.propose(references[0, :PROMPT - 1], int(references[0, PROMPT - 1]), SamplingConfig(temperature=1.0))


def test_copy_rounds_verify_the_lookup_tree_alone_and_decoding_still_equals_generate(setup):  # noqa: F811
    # copy_ngram=2: a round whose last 2+ tokens recur with a full-depth continuation verifies the lookup's
    # own tree and does not run the drafter; other rounds merge as before. The drafter skipped a round
    # still reads the accepted tokens (update), so later rounds draft from the right context.
    target, references, path = setup
    spec = parse_tree_spec("dynamic:total=8,depth=4,topk=3")
    proposer = load_proposer(f"{path}+prompt-lookup:copy_ngram=2", target, spec)
    drafter_rounds, drafter_updates = [], []
    real_propose, real_update = proposer.drafter.propose, proposer.drafter.update
    proposer.drafter.propose = lambda *a, **k: drafter_rounds.append(1) or real_propose(*a, **k)
    proposer.drafter.update = lambda *a, **k: drafter_updates.append(1) or real_update(*a, **k)
    for row in range(2):
        prompt = references[row, :PROMPT]
        out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
        assert out.tolist() == references[row, :PROMPT + NEW].tolist()
    assert 0 < proposer.copy_rounds < proposer.rounds  # both kinds of round happened
    assert len(drafter_rounds) == proposer.rounds - proposer.copy_rounds
    # a copying streak's updates reach the drafter in one call, when it next drafts
    assert len(drafter_updates) <= len(drafter_rounds) < proposer.rounds
    # a copying context: the lookup's tree is returned as is
    context = torch.tensor([5, 6, 7, 8, 9, 10, 11, 5, 6])  # "5 6" recurs, followed by 7 8 9 10
    copied = proposer.copy_lookup.propose(context, 7)
    before = len(drafter_rounds)
    got = proposer.propose(context, 7, SamplingConfig())
    assert len(drafter_rounds) == before and torch.equal(got.tokens, copied.tokens) and got.max_depth == 4


def test_copy_ngram_option_is_checked(setup):  # noqa: F811
    target, _, path = setup
    spec = parse_tree_spec("chain:4")
    for bad in ("copy_ngram=0", "copy_ngram=x"):
        with pytest.raises(ValueError, match=f"prompt-lookup option '{bad}': expected copy_ngram=N with N >= 1"):
            load_proposer(f"{path}+prompt-lookup:{bad}", target, spec)
    with pytest.raises(ValueError, match="prompt-lookup option 'nope=1'"):
        load_proposer(f"{path}+prompt-lookup:copy_ngram=2,nope=1", target, spec)


@pytest.mark.parametrize("split", [1, 3, 5])
def test_one_update_over_concatenated_rounds_equals_the_rounds_one_by_one(setup, split):  # noqa: F811
    # the contract the hybrid's lazy catch-up relies on: the drafter's next tree is the same whether it
    # read two rounds' tokens and features one round at a time or in one call
    from drafters.targets import TargetFeatures
    from test_eagle_proposer import target_features

    target, references, path = setup
    spec = parse_tree_spec("dynamic:total=8,depth=4,topk=3")
    ids = references[0, :PROMPT + 8]
    feats = target_features(target.model, ids, load_proposer(str(path), target, spec).needs.layers)

    def at(positions):
        return TargetFeatures({k: v[:, positions] for k, v in feats.hidden_states.items()},
                              feats.last_hidden[:, positions], None, feats.logits[:, positions])

    trees = []
    for joined in (False, True):
        proposer = load_proposer(str(path), target, spec)
        proposer.reset(ids[:PROMPT], at(slice(0, PROMPT)))
        rounds = [slice(PROMPT, PROMPT + split), slice(PROMPT + split, PROMPT + 7)]  # round tokens (a,)
        if joined:
            proposer.update(ids[PROMPT:PROMPT + 7], TargetFeatures.cat([at(r) for r in rounds]), int(ids[PROMPT + 7]))
        else:
            for r in rounds:
                proposer.update(ids[r], at(r), int(ids[r.stop]))
        trees.append(proposer.propose(ids[:PROMPT + 7], int(ids[PROMPT + 7]), SamplingConfig()))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
