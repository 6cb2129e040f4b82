"""Native MTP drafters in the shared decoder: the EAGLE proposer (drafters.decode.proposers.eagle: committed pairs,
KV cache, trees, sampling, lossless verification) driving an MtpDrafter (drafters.mtp). Differs from EAGLE-1 in the
step (the target's own MTP layer: its norms, projection, decoder-layer class and final norm), in what a node hands
its children (the layer's output, normed in the Qwen layout) and in where its weights come from: a native
checkpoint, or the MTP tensors inside a target checkpoint directory (the shipped layer, or our export of a trained
one). The target's embedding and head are used, frozen.
"""

from drafters.decode.proposers import TargetNeeds
from drafters.decode.proposers.eagle import EagleProposer
from drafters.decode.tree import TreeSpec, parse_tree_spec
from drafters.mtp import MtpConfig, mtp_count, read_mtp, shared_copy_problems
from drafters.registry import build_drafter, check_fits
from drafters.targets import FrozenHead


def mtp_inputs(drafter):
    # the target's final-normed last hidden state h_t (1, T, H), as every MTP layer reads it
    return TargetNeeds(last_hidden=True), lambda f: f.last_hidden


def mtp_proposer(config: MtpConfig, state: dict, target, tree_spec: str | TreeSpec, where, *,
                 seed: int = 0) -> EagleProposer:
    check_fits(config, target, where)
    drafter = build_drafter("mtp", config, state, where)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    drafter.attach_head(FrozenHead.from_target(target, "normed"))
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    return EagleProposer(drafter, target.embed_tokens, tree, inputs=mtp_inputs, seed=seed)


def is_mtp_checkpoint(config: dict) -> bool:
    """A target checkpoint's config.json that declares MTP layers (ours after export, or as shipped)."""
    from types import SimpleNamespace

    return mtp_count(SimpleNamespace(**config.get("text_config", config))) is not None


def mtp_export_loader(path, config: dict, target, tree_spec) -> EagleProposer:
    """A target checkpoint directory with MTP layers drafts with its layer 0 (what SGLang's NEXTN reads) on `target`:
    an export of a trained layer (drafters.export.mtp) or the target's shipped one."""
    mtp_config, state, copies = read_mtp(path, target.config.get_text_config(), 0)
    problems = shared_copy_problems(copies, target)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return mtp_proposer(mtp_config, state, target, tree_spec, path)
