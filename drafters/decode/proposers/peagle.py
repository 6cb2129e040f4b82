"""P-EAGLE proposer: EAGLE's committed pairs and cache (drafters.decode.proposers.eagle), but one drafter pass
per round drafts every depth: [root pair (newest feature, pending) ; K-1 mask slots], causal over the committed
pairs (drafters.peagle). Row d ranks the children of every depth-d node; the rows do not depend on the drafted
tokens, so trees take them the way DFlash's do (chain = top-1 per row; static trees rank by row; dynamic trees
rerank by cumulative log-probability). Depth is at most K. Sampling: chains and static trees draw each node's
children without replacement from the warped row and hand it to the verifier as `draft_probs` (lossless).
The K drafted slots are cropped from the cache at the next commit; no drafted token is ever kept.
"""

import torch
from torch import Tensor

from drafters.decode.proposers.eagle import EagleProposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import ChainSpec, Tree, TreeSpec, build_tree, parse_tree_spec, rows_expander
from drafters.peagle import PEagleConfig, PEagleDrafter
from drafters.registry import build_drafter, check_fits


class PEagleProposer(EagleProposer):
    def __init__(self, drafter: PEagleDrafter, embed, tree: TreeSpec, *, seed: int = 0):
        k = drafter.config.depth
        if tree.depth > k:
            name = f"chain:{tree.length}" if isinstance(tree, ChainSpec) else type(tree).__name__
            raise ValueError(f"tree {name} is {tree.depth} deep, but this P-EAGLE drafter drafts {k} tokens per "
                             f"pass (depth {k}); use a tree of depth <= {k} (e.g. chain:{k})")
        super().__init__(drafter, embed, tree, seed=seed)

    @torch.no_grad()
    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        if self.last is None or context.numel() != self.length + 1:
            raise RuntimeError(f"PEagleProposer: the decoder's context has {context.numel()} tokens, the drafter "
                               f"holds {self.length + 1}; call reset() after the prefill and update() every round")
        self.cache.crop(self.length)
        ids = torch.tensor([[pending]], device=self.last.device)
        _, logits = self.drafter.draft(self.last, ids, self.embed, self.cache)
        rows = logits[0]  # (K, Vd): row d ranks a depth-d node's children
        depth = min(self.depth, self.drafter.config.depth) if self.depth is not None else None
        expander = lambda _, draws: rows_expander(rows, self._to_target, sampling, draws, self.generator)  # noqa: E731
        return build_tree(self.tree, pending, expander, sampled=not sampling.greedy, chain_depth=depth)


def peagle_proposer(config: PEagleConfig, state: dict, target, tree_spec, where, *, seed: int = 0) -> PEagleProposer:
    """config + state dict in PEagleDrafter names (native checkpoint or a read-back export)."""
    check_fits(config, target, where)
    drafter: PEagleDrafter = build_drafter("peagle", config, state, where)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    return PEagleProposer(drafter, target.embed_tokens, tree, seed=seed)


def peagle_export_loader(path, config: dict, target, tree_spec) -> PEagleProposer:
    """A vllm (speculators' peagle) export, ours or another trainer's, read and validated by the independent
    reader (drafters.export.peagle). Its embedding must be the target's: the decoder drafts with the target's."""
    from drafters.checkpoint import target_info
    from drafters.export.peagle import read_peagle_export

    peagle_config, state, embedding, _ = read_peagle_export(path, target=target_info(target))
    own = target.embed_tokens.weight.detach().to("cpu", embedding.dtype)
    if not torch.equal(embedding, own):
        raise ValueError(f"{path}: its embed_tokens differ from target {target.name!r}'s (max |diff| "
                         f"{float((embedding.float() - own.float()).abs().max()):.3g}): this decoder drafts with the "
                         "target's frozen embedding, so the export would draft differently here")
    return peagle_proposer(peagle_config, state, target, tree_spec, path)
