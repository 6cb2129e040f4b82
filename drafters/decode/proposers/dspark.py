"""DSpark proposer: DFlash's proposer (one drafter pass per round drafts the block's base logits, the context
cache is DFlash's) with the Markov head applied per tree node: a node at depth d-1 holding token t proposes its
children from q_d(. | t) = softmax(head(normed_d) + W2 W1[t]) (drafters.dspark). A chain is drafted slot by slot
on its own argmax (greedy) or draws (sampled), as llama.cpp drafts in its graph. Sampled chains and static trees
hand each node's own q_d(. | t) to the verifier as `draft_probs`, so sampled verification stays lossless.

Confidence gate (`conf_min` > 0, chains only; llama.cpp's --spec-draft-p-min for a DSpark drafter): before
drafting, the greedy chain is walked slot by slot and cut at the first slot whose confidence
sigmoid(proj([normed_j ; W1[prev_j]])) is below conf_min. The depth is fixed before any draw, so sampled
verification stays lossless; a round whose first slot is below verifies no draft (a plain target step).
"""

import torch
from torch import Tensor

from drafters.decode.proposers.dflash import DFlashProposer, dflash_proposer
from drafters.decode.sampling import SamplingConfig, warp
from drafters.decode.tree import ChainSpec, Frontier, Tree, TreeSpec, build_tree, ranked_draws
from drafters.dspark import DSparkDrafter


class DSparkProposer(DFlashProposer):
    def __init__(self, drafter: DSparkDrafter, embed, tree: TreeSpec, *, seed: int = 0, conf_min: float = 0.0):
        super().__init__(drafter, embed, tree, seed=seed)
        if conf_min and not isinstance(tree, ChainSpec):
            raise ValueError("the DSpark confidence gate (conf_min) cuts chains only; use a tree spec chain:K")
        if conf_min and drafter.confidence_head is None:
            raise ValueError("conf_min needs a DSpark drafter trained with a confidence head "
                             "(dspark.confidence_head: true); this one has none")
        if not 0.0 <= conf_min <= 1.0:
            raise ValueError(f"conf_min={conf_min} must be in [0, 1]")
        self.conf_min = conf_min

    @torch.no_grad()
    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        if self.length is None or context.numel() != self.length:
            raise RuntimeError(f"DSparkProposer: the decoder's context has {context.numel()} tokens, the drafter "
                               f"holds {self.length or 0}; call reset() after the prefill and update() every round")
        depth = min(self.depth, self.drafter.config.block_size - 1) if self.depth is not None else None
        normed, base = self.drafter.draft(torch.tensor([pending], device=self.drafter.head.device), self.embed,
                                          self.cache)
        normed, base = normed[0, 1:], base[0]  # (B-1, h), (B-1, Vd): slot d's outputs, base logits
        if self.conf_min:
            depth = self._confident_depth(normed, base, pending, depth)
            if depth == 0:  # not even the first slot is confident: verify the root alone (a plain step)
                return Tree(torch.tensor([pending]), torch.tensor([-1]))
        return build_tree(self.tree, pending, lambda _, draws: self._markov_expander(base, sampling, draws),
                          sampled=not sampling.greedy, chain_depth=depth)

    def _confident_depth(self, normed: Tensor, base: Tensor, pending: int, depth: int) -> int:
        prev = torch.tensor([pending], device=base.device)
        for j in range(depth):
            if torch.sigmoid(self.drafter.confidence_logits(normed[j][None], prev)).item() < self.conf_min:
                return j
            prev = self.used[self.drafter.slot_logits(normed[j][None], prev).argmax(-1)]
        return depth

    def _markov_expander(self, base: Tensor, sampling: SamplingConfig, draws: int):
        probs = {}

        def expand(frontier: Frontier) -> Tensor:
            bias, _ = self.drafter.markov_head(frontier.tokens.to(base.device))  # (F, Vd): W2 W1[node token]
            row = base[frontier.depth][None] + bias.to(base.dtype)  # (F, Vd) q_{d+1}(. | node token)
            if not draws:
                return self._to_target(row.float().log_softmax(-1), float("-inf"))
            q = self._to_target(warp(row, sampling), 0.0)  # (F, V) float32, one row per node
            probs.update(zip(frontier.nodes.tolist(), q))
            return ranked_draws(q, draws, self.generator)

        return expand, probs


def dspark_proposer(config, state: dict, target, tree_spec, where, *, seed: int = 0, conf_min: float = 0.0,
                    head: Tensor | None = None) -> DSparkProposer:
    """config + state dict in DSparkDrafter names (native checkpoint or a read-back export)."""
    base = dflash_proposer(config, state, target, tree_spec, where, seed=seed, head=head)
    return DSparkProposer(base.drafter, base.embed, base.tree, seed=seed, conf_min=conf_min)


def dspark_export_loader(path, config: dict, target, tree_spec) -> DSparkProposer:
    """A vllm (speculators' dspark) export, ours or another trainer's, read and validated by the independent
    export reader (drafters.export.dflash); layer ids come back as HF indices."""
    from drafters.checkpoint import target_info
    from drafters.export.dflash import read_dflash_export

    dspark_config, state, head, _, _ = read_dflash_export(path, "vllm", target=target_info(target))
    return dspark_proposer(dspark_config, state, target, tree_spec, path, head=head)
