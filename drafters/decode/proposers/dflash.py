"""DFlash proposer: one drafter pass per round drafts the whole block; the decoder verifies it as a
chain or as a tree built from the per-slot top-k.

Alignment (docs/conventions.md "DFlash"): after a target prefill of T tokens, the drafter cache holds
the context keys / values of positions 0..T-1 (every committed token's fused features: unlike EAGLE,
a feature needs no next token). `propose` runs the block [pending, M, ..., M] at positions T..T+B-1;
slot j scores token T+j, i.e. a tree node at depth j. `update` appends the committed tokens' features
(old pending + accepted drafts, from the TARGET's verification forward); drafted tokens never enter
the cache.

Trees. A slot's distribution q_j does not depend on the tokens drafted at other slots (they are masks
to the drafter), so every node at depth d-1 proposes its children from q_d: a chain takes the top-1 of
each slot, a static tree gives child rank r of a depth-(d-1) node the r-th best token of q_d, a dynamic
(EAGLE-2) tree expands every frontier node with q_d and reranks by cumulative log-probability. Depth is
at most B-1. Sampling (temperature > 0): chain and static trees draw each node's children WITHOUT
replacement from the warped q_d, independently per node, and hand q_d to the verifier as `draft_probs`
(lossless); dynamic trees keep deterministic top-k drafts, verified as one-hot proposals (lossless).
Knows nothing about the target model (it gets features, the frozen embedding and head) nor verification.
"""

import torch
from torch import Tensor

from drafters.decode.proposers import TargetNeeds
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import ChainSpec, DynamicSpec, Tree, TreeSpec, build_tree, parse_tree_spec, rows_expander
from drafters.dflash import DFlashCache, DFlashConfig, DFlashDrafter
from drafters.draft_vocab import scatter_to_target
from drafters.eagle3 import fuse_features
from drafters.registry import build_drafter, check_fits, family_of


def tree_name(tree: TreeSpec) -> str:
    if isinstance(tree, ChainSpec):
        return f"chain:{tree.length}"
    if isinstance(tree, DynamicSpec):
        return f"dynamic:total={tree.total},depth={tree.depth},topk={tree.topk}"
    return f"static:{tree.name}"


class DFlashProposer:
    def __init__(self, drafter: DFlashDrafter, embed, tree: TreeSpec, *, seed: int = 0):
        block = drafter.config.block_size
        if tree.depth > block - 1:
            raise ValueError(f"tree {tree_name(tree)} is {tree.depth} deep, but this DFlash drafter drafts at most "
                             f"block_size - 1 = {block - 1} tokens per pass; use a tree of depth <= {block - 1} "
                             f"(e.g. chain:{block - 1})")
        self.drafter, self.embed, self.tree = drafter, embed, tree
        layers = tuple(drafter.config.aux_layers)
        self.needs = TargetNeeds(layers=layers)
        self.fuse = lambda f: fuse_features(f.hidden_states, layers)  # (1, T, n*h)
        self.depth = tree.length if isinstance(tree, ChainSpec) else None  # AdaptiveChain sets it
        device = drafter.head.device
        self.used = drafter.draft_vocab.used.to(device)  # (Vd,) draft id -> target id
        self.generator = torch.Generator(device).manual_seed(seed)  # sampled drafts only
        self.cache, self.length = DFlashCache(), None

    # ------------------------------------------------------------ committed context

    @torch.no_grad()
    def reset(self, prompt_ids: Tensor, features) -> None:
        self.cache, self.length = DFlashCache(), 0
        self._commit(self.fuse(features))

    @torch.no_grad()
    def update(self, new_tokens: Tensor, features, pending: int) -> None:
        # new_tokens (a,) = old pending + accepted drafts; features at their positions
        self._commit(self.fuse(features))

    def _commit(self, fused: Tensor) -> None:
        self.drafter.extend_context(fused.to(self.drafter.head.dtype), self.cache)
        self.length = len(self.cache)

    # ------------------------------------------------------------ drafting

    @torch.no_grad()
    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        if self.length is None or context.numel() != self.length:
            raise RuntimeError(f"DFlashProposer: the decoder's context has {context.numel()} tokens, the drafter "
                               f"holds {self.length or 0}; call reset() after the prefill and update() every round")
        # a chain's length may grow under AdaptiveChain: one pass drafts at most block_size - 1
        depth = min(self.depth, self.drafter.config.block_size - 1) if self.depth is not None else None
        pending_ids = torch.tensor([pending], device=self.drafter.head.device)
        normed, logits = self.drafter.draft(pending_ids, self.embed, self.cache)
        return self.draft_tree(normed[0, 1:], logits[0], pending, sampling, depth)

    def draft_tree(self, normed: Tensor, slots: Tensor, pending: int, sampling: SamplingConfig,
                   depth: int | None) -> Tree:
        """normed (B-1, h), slots (B-1, Vd): slot d's output and logits, row d-1 = q_d, the distribution of a
        depth-d node -> the tree (DFlash2's proposer ranks its own way)."""
        # top-k drafts for dynamic trees at every temperature (module docstring)
        expander = lambda _, draws: rows_expander(slots, self._to_target, sampling, draws, self.generator)  # noqa: E731
        return build_tree(self.tree, pending, expander, sampled=not sampling.greedy, chain_depth=depth)

    def _to_target(self, x: Tensor, fill: float) -> Tensor:  # (F, Vd) -> (F, V), `fill` off the draft vocab
        return scatter_to_target(x, self.used, self.drafter.config.vocab_size, fill)


# ---------------------------------------------------------------- loading


def dflash_proposer(config: DFlashConfig, state: dict, target, tree_spec: str | TreeSpec, where, *,
                    seed: int = 0, head: Tensor | None = None) -> DFlashProposer:
    """config + state dict in DFlashDrafter names (native checkpoint or a read-back export). head (Vd, h):
    the export's own LM head rows if it has one (speculators' reduced-vocabulary saves), else the target's."""
    check_fits(config, target, where)
    drafter: DFlashDrafter = build_drafter(family_of(config), config, state, where)  # dflash, or dspark (a subclass)
    drafter.attach_head(target.lm_head.weight)
    if head is not None:
        with torch.no_grad():
            drafter.head.copy_(head)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    return DFlashProposer(drafter, target.embed_tokens, tree, seed=seed)


def dflash_export_loader(fmt: str):
    """-> load(path, config, target, tree) for an sglang / vllm DFlash export (ours or another trainer's),
    read and validated by the independent export reader; layer ids come back as HF indices."""
    from drafters.checkpoint import target_info
    from drafters.export.dflash import read_dflash_export

    def load(path, config: dict, target, tree_spec) -> DFlashProposer:
        dflash_config, state, head, _, _ = read_dflash_export(path, fmt, target=target_info(target))
        return dflash_proposer(dflash_config, state, target, tree_spec, path, head=head)

    return load
