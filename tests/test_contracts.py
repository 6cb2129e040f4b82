"""The contracts every registered drafter family honours, written once and run for each family by name (the
pattern of transformers' model tester mixins). A family added to drafters.registry.FAMILIES runs them all
without a line here; one that breaks a contract fails as test_...[family].

    trained        its tiny recipe trains through drafters.training.families.train and saves a checkpoint
    lossless       its proposer, loaded from that checkpoint, decodes greedily exactly as generate, on a chain and a
                   static tree
    stateful       it refuses to propose before reset() (no silent draft from a stale or empty cache)
    fits           it is refused, with the mismatch named, by a target it was not trained for
    round trip     every format of drafters.export.dispatch.EXPORT_FORMATS but llama.cpp (tests/test_llama_cpp.py)
                   exports, reloads through the decoder's loader and drafts the same first tree as the checkpoint

Family-specific behaviour (TTT masks, block slots, calibrated trees) stays in each family's own test module.
"""

import pytest
import torch
from transformers import GenerationConfig

from conftest import ROOT, load_script  # tests/ is on sys.path under pytest
from drafters.checkpoint import CheckpointError
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import parse_tree_spec
from drafters.export.dispatch import EXPORT_FORMATS, export_checkpoint
from drafters.registry import FAMILIES
from drafters.targets import load_target

TREES = ["chain:3", "static:[[0],[1],[0,0]]"]
NEW = 12


# the target a family's tiny recipe trains for: tiny-random-llama, but an MTP drafter is a target's own MTP layer
FAMILY_TARGETS = {"mtp": "tiny-mtp-deepseek_v3"}


@pytest.fixture(scope="module")
def target(trained):
    return load_target(FAMILY_TARGETS.get(trained[0], "tiny-random-llama"))


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request, tmp_path_factory):
    family = request.param
    script = load_script("train/train.py")  # the one entry point trains every family
    out = tmp_path_factory.mktemp(family)
    summary = script.main([str(ROOT / "recipes" / f"{family}_tiny.yaml"), "max_steps=2", "eval_every=0",
                           f"output_dir={out}"])
    assert summary.checkpoint == out / "checkpoint-final" and summary.checkpoint.is_dir()
    return family, summary.checkpoint


def greedy(target, prompt):
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return target.model.generate(prompt[None], generation_config=config)[0]


def first_tree(proposer, target, prompt):
    """The tree the proposer drafts in the first round after the prefill (what the decoder would verify)."""
    with torch.no_grad():
        out = target.model(prompt[None], output_hidden_states=True)
    from drafters.targets import TargetFeatures

    needs = proposer.needs
    features = TargetFeatures({i: out.hidden_states[i] for i in needs.layers}, out.hidden_states[-1], None,
                              out.logits) if needs.any else None
    if needs.pre_norm_last:
        pytest.skip("a pre-norm feature needs the decoder's capture; the lossless contract covers it")
    proposer.reset(prompt, features)
    return proposer.propose(prompt, int(out.logits[0, -1].argmax()), SamplingConfig()).tokens.tolist()


@pytest.mark.parametrize("tree", TREES)
def test_lossless_greedy_decoding(trained, target, prompts, tree):
    family, checkpoint = trained
    proposer = load_proposer(str(checkpoint), target, parse_tree_spec(tree))
    for prompt in prompts:
        out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
        assert out.tolist() == greedy(target, prompt).tolist(), f"{family}: {tree} decoding differs from generate"
        assert 1 + sum(a + 1 for a in stats.accepted) == NEW


def test_proposing_before_reset_is_refused(trained, target, prompts):
    family, checkpoint = trained
    proposer = load_proposer(str(checkpoint), target, parse_tree_spec("chain:3"))
    with pytest.raises(RuntimeError, match="call reset"):
        proposer.propose(prompts[0], 5, SamplingConfig())


def test_another_target_is_refused_with_the_mismatch_named(trained):
    family, checkpoint = trained
    other = load_target("tiny-random-gemma3")
    with pytest.raises(CheckpointError, match="tiny-random-gemma3|vocab_size|hidden_size|num_layers|model_type"):
        load_proposer(str(checkpoint), other, parse_tree_spec("chain:3"))


def test_every_export_format_round_trips_through_the_decoders_loader(trained, target, prompts, tmp_path):
    family, checkpoint = trained
    tree = parse_tree_spec("chain:3")
    expected = first_tree(load_proposer(str(checkpoint), target, tree), target, prompts[0])
    formats = [fmt for fmt in EXPORT_FORMATS[family] if fmt != "llama.cpp"]
    assert "native" in formats
    for fmt in formats:
        exported = export_checkpoint(checkpoint, fmt, tmp_path / fmt, target=target).path
        proposer = load_proposer(str(exported), target, tree)
        assert first_tree(proposer, target, prompts[0]) == expected, f"{family} via {fmt}: other drafts"
        out, _ = speculative_generate(target, load_proposer(str(exported), target, tree), prompts[1],
                                      max_new_tokens=NEW)
        assert out.tolist() == greedy(target, prompts[1]).tolist(), f"{family} via {fmt}: decoding differs"
