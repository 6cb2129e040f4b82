"""DFlash2 proposer: DFlash's proposer (one drafter pass per round, DFlash's context cache) ranking each tree node's
children with the path selector (drafters.dflash2): a node at depth d-1 holding token a proposes its children from
q_d(. | a) = softmax over slot d's top-k candidates of U_d(b) + <P[a] * (H n_d), S[b]>, 0 elsewhere. A greedy
chain with path_search "viterbi" is the best path of sum_d log q_d(x_d | x_{d-1}) over the block (one-hot
proposals); "walk", every tree and every sampled draft take q_d node by node. Sampled chains and static trees hand
each node's own q_d(. | a) (warped) to the verifier as `draft_probs`, so sampled verification stays lossless; the
selector only chooses what is drafted.
"""

import torch
from torch import Tensor

from drafters.decode.proposers.dflash import DFlashProposer, dflash_proposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import ChainSpec, Frontier, Tree, build_tree, node_rows_expander
from drafters.dflash2 import DFlash2Drafter


class DFlash2Proposer(DFlashProposer):
    drafter: DFlash2Drafter

    def draft_tree(self, normed: Tensor, slots: Tensor, pending: int, sampling: SamplingConfig,
                   depth: int | None) -> Tree:
        if isinstance(self.tree, ChainSpec) and sampling.greedy and self.drafter.config.path_search == "viterbi":
            path = self.drafter.best_path(normed[:depth], slots[:depth], pending)  # (depth,) target ids
            return Tree.chain(torch.cat([torch.tensor([pending], device=path.device), path]))
        values, cand = slots.topk(self.drafter.config.path_top_k, dim=-1)  # (B-1, k): U_d at its candidates

        def rows_of(frontier: Frontier) -> Tensor:  # (F, Vd): S_{d+1}(node token, .) on the candidates, -inf off
            d, tokens = frontier.depth, frontier.tokens.to(slots.device)
            scores = self.drafter.transition_scores(normed[d], values[d], cand[d], tokens)  # (F, k)
            row = torch.full((len(tokens), slots.shape[-1]), float("-inf"), dtype=scores.dtype, device=slots.device)
            return row.scatter_(1, cand[d].expand(len(tokens), -1), scores)

        expander = lambda _, draws: node_rows_expander(rows_of, self._to_target, sampling, draws,  # noqa: E731
                                                       self.generator)
        return build_tree(self.tree, pending, expander, sampled=not sampling.greedy, chain_depth=depth)


def dflash2_proposer(config, state: dict, target, tree_spec, where, *, seed: int = 0,
                     head: Tensor | None = None) -> DFlash2Proposer:
    """config + state dict in DFlash2Drafter names (native checkpoint or a read-back export)."""
    base = dflash_proposer(config, state, target, tree_spec, where, seed=seed, head=head)
    return DFlash2Proposer(base.drafter, base.embed, base.tree, seed=seed)


def dflash2_export_loader(path, config: dict, target, tree_spec) -> DFlash2Proposer:
    """An sglang-layout DFlash2DraftModel export (ours or z-lab's), read and validated by the independent reader
    (drafters.export.dflash2); layer ids come back as HF indices."""
    from drafters.checkpoint import target_info
    from drafters.export.dflash2 import read_dflash2_export

    dflash2_config, state, _, _ = read_dflash2_export(path, target=target_info(target))
    return dflash2_proposer(dflash2_config, state, target, tree_spec, path)
