"""EAGLE-1 drafters in the shared decoder: the EAGLE proposer (drafters.decode.proposers.eagle) driving an
Eagle1Drafter. Differs from EAGLE-3 only in the target feature it reads (`eagle1_inputs`), in the frozen
target head attached to the drafter at load time, and in having no reduced vocabulary.
"""

from drafters.decode.proposers import TargetNeeds
from drafters.decode.proposers.eagle import EagleProposer
from drafters.decode.tree import TreeSpec, parse_tree_spec
from drafters.eagle1 import Eagle1Config, Eagle1Drafter
from drafters.registry import build_drafter, check_fits
from drafters.targets import FrozenHead


def eagle1_inputs(drafter: Eagle1Drafter):
    # the one target feature the drafter reads at every position: (1, T, h), no fusion
    if drafter.config.feature == "pre_norm":
        return TargetNeeds(pre_norm_last=True), lambda f: f.pre_norm_last
    return TargetNeeds(last_hidden=True), lambda f: f.last_hidden


def eagle1_proposer(config: Eagle1Config, state: dict, target, tree_spec: str | TreeSpec, where, *,
                    seed: int = 0) -> EagleProposer:
    check_fits(config, target, where)
    drafter = build_drafter("eagle1", config, state, where)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    drafter.attach_head(FrozenHead.from_target(target, config.feature))
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    return EagleProposer(drafter, target.embed_tokens, tree, inputs=eagle1_inputs, seed=seed)


def eagle1_export_loader(path, config: dict, target, tree_spec) -> EagleProposer:
    """An official-layout EAGLE-1 export (ours or the EAGLE repository's, safetensors), read and validated by
    the independent reader of drafters.export.eagle1: normed features, the target's head and embedding.
    `proposer.notes`: the defaults the reader applied to fields the config leaves out."""
    from drafters.checkpoint import target_info
    from drafters.export.eagle1 import read_eagle1_export

    notes = []
    eagle1_config, state, _ = read_eagle1_export(path, target=target_info(target), notes=notes)
    proposer = eagle1_proposer(eagle1_config, state, target, tree_spec, path)
    proposer.notes = notes
    return proposer
