"""Heads proposer: a trained Medusa or Blockwise drafter drafts the decoder's tree.

The heads read one vector per round: the target's final-normed last hidden state x_t at the last
committed position t (TargetNeeds(last_hidden=True); from the prefill at `reset`, from the
verification forward at `update`). The target predicted token t+1 from x_t: that is the pending
token, the tree's root. Head k predicts t+k+2, so every node at depth d is drawn from head d-1's
distribution, whatever its parent; a rank path (r_1 .. r_d) holds head 0's rank-r_1 candidate,
..., head d-1's rank-r_d candidate. Trees: `chain:K` (each head's top-1), a static shape (the
calibrated one a training run writes to its checkpoint: `static:CHECKPOINT/tree.json`, or
`tree=None` from Python), or `dynamic:` (EAGLE-2 expansion by cumulative head log-probs). Depth
is at most the number of heads.

Sampling (temperature > 0) on chain and static trees: each node's children are drawn WITHOUT
replacement from q = warp(head d logits) (the sampling settings of the target), in child order,
and q is handed to the verifier as `draft_probs`: lossless, whatever q is. Draws are independent
per parent node. Dynamic trees keep deterministic top-k drafts at every temperature (verified as
one-hot proposals, lossless), as in the EAGLE proposer. Knows nothing about the target model (it
gets the last hidden state and the frozen LM head weight) nor verification.
"""

import torch
from torch import Tensor

from drafters.checkpoint import Checkpoint, CheckpointError
from drafters.decode.proposers import TargetNeeds
from drafters.decode.sampling import SamplingConfig, warp
from drafters.decode.tree import (
    ChainSpec,
    Frontier,
    StaticSpec,
    Tree,
    TreeShape,
    TreeSpec,
    build_tree,
    parse_tree_spec,
    ranked_draws,
)
from drafters.medusa import MedusaHeads
from drafters.registry import build_drafter, check_fits, family_of

TREE_FILE = "tree.json"  # the calibrated rank paths a training run writes into each evaluated checkpoint


class HeadsProposer:
    needs = TargetNeeds(last_hidden=True)

    def __init__(self, drafter, lm_head: Tensor, tree: TreeSpec, *, seed: int = 0):
        # drafter: MedusaHeads | BlockwiseHeads; lm_head (V, d) the frozen target LM head weight
        self.drafter, self.lm_head, self.tree = drafter, lm_head, tree
        self.num_heads = drafter.config.num_heads
        if tree.depth > self.num_heads:
            raise ValueError(f"tree of depth {tree.depth} for a drafter with {self.num_heads} heads: depth d is "
                             f"drafted by head d-1, so use a tree of depth <= {self.num_heads}")
        self.depth = tree.length if isinstance(tree, ChainSpec) else None  # AdaptiveChain sets it
        self.generator = torch.Generator(lm_head.device).manual_seed(seed)  # sampled drafts only
        self.last = None  # (d,) x_t at the last committed position

    def reset(self, prompt_ids: Tensor, features) -> None:
        self.last = features.last_hidden[0, -1]

    def update(self, new_tokens: Tensor, features, pending: int) -> None:
        # features at the committed tokens' positions; the last one is the new t
        self.last = features.last_hidden[0, -1]

    @torch.no_grad()
    def head_logits(self, depth: int) -> Tensor:
        # -> (depth, V): row d = head d's logits at x_t, the candidates for tree depth d+1
        heads = list(range(depth))
        states = self.drafter.states(self.last.to(self.lm_head.dtype), heads)  # (depth, d)
        return torch.stack([self.drafter.project(states[k], k, self.lm_head) for k in heads])

    @torch.no_grad()
    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        if self.last is None:
            raise RuntimeError("HeadsProposer: no target hidden state yet; call reset() after the prefill and "
                               "update() every round")
        # top-k drafts for dynamic trees at every temperature (module docstring)
        chain_depth = None if self.depth is None else min(self.depth, self.num_heads)
        return build_tree(self.tree, pending, lambda depth, draws: self._expander(depth, draws, sampling),
                          sampled=not sampling.greedy, chain_depth=chain_depth)

    def _expander(self, depth: int, draws: int, sampling: SamplingConfig):
        # -> (expand, probs) for build_tree: a node at depth d+1 is head d's candidate, whatever its parent
        logits = self.head_logits(depth)  # (depth, V)
        if not draws:
            logp = logits.float().log_softmax(-1)
            return lambda f: logp[f.depth].expand(len(f.nodes), -1), {}
        q, probs = warp(logits, sampling), {}  # (depth, V) float32

        def expand(frontier: Frontier) -> Tensor:
            # every frontier node draws its own children from q[depth], in draw order
            probs.update((node, q[frontier.depth]) for node in frontier.nodes.tolist())
            return ranked_draws(q[frontier.depth].expand(len(frontier.nodes), -1), draws, self.generator)

        return expand, probs


# ---------------------------------------------------------------- loading a native checkpoint


def calibrated_tree(ckpt: Checkpoint) -> StaticSpec:
    tree = ckpt.extra.get("tree") or {}
    if not tree.get("paths"):
        raise CheckpointError(f"{ckpt.path}: no calibrated tree in the checkpoint (the run had no held-out "
                              "rows to calibrate on); give a tree spec such as chain:3 or static:medusa")
    return StaticSpec(TreeShape.from_paths(tree["paths"]), f"calibrated:{ckpt.path}")


def heads_proposer(config, state: dict, target, tree_spec: str | TreeSpec, where, *, seed: int = 0) -> HeadsProposer:
    # config + state dict of a Medusa or Blockwise drafter (a native checkpoint's); the weights are checked against
    # the config before the config against the target
    drafter = build_drafter(family_of(config), config, state, where)
    check_fits(config, target, where)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    return HeadsProposer(drafter, target.lm_head.weight.detach(), tree, seed=seed)


# ---------------------------------------------------------------- loading a Medusa-format export


def medusa_export_proposer(path, config: dict, target, tree_spec: str | TreeSpec) -> HeadsProposer:
    """An exported Medusa directory (ours or another trainer's: config.json + medusa_lm_head.safetensors),
    read and validated by the independent reader in drafters.export.medusa."""
    from drafters.checkpoint import target_info
    from drafters.export.medusa import read_medusa_export

    medusa, state, _, _ = read_medusa_export(path, target=target_info(target))
    drafter = MedusaHeads(medusa)
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    return HeadsProposer(drafter, target.lm_head.weight.detach(), tree)
