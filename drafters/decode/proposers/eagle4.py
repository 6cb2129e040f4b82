"""EAGLE-4 proposer: EAGLE's (drafters.decode.proposers.eagle: committed pairs, cache, trees, sampling), drafting from
the candidate head (drafters.eagle4): every node's children are ranked by the exact logits of the low-rank head's
top-k candidates, -inf elsewhere. Greedy takes the argmax among the candidates; sampling draws from softmax over
the candidates, and that restricted q is the `draft_probs` the verifier reads, so verification stays lossless.
A node whose tree asks for more children than there are candidates gets only candidates under sampling (the rest
of the support is zero); under greedy the extra children are verified and rejected like any wrong draft.
"""

import torch
from torch import Tensor

from drafters.decode.proposers.eagle import EagleProposer
from drafters.decode.tree import TreeSpec, parse_tree_spec
from drafters.eagle4 import Eagle4Config, Eagle4Drafter
from drafters.registry import build_drafter, check_fits


def eagle4_proposer(config: Eagle4Config, state: dict, target, tree_spec: str | TreeSpec, where, *,
                    seed: int = 0, embed: Tensor | None = None) -> EagleProposer:
    """config + state dict in Eagle4Drafter names (a native checkpoint or a read-back export); embed (V, h): the
    export's own token embedding if it has one (as vLLM uses it), else the target's."""
    check_fits(config, target, where)
    drafter: Eagle4Drafter = build_drafter("eagle4", config, state, where)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    if embed is not None:
        embed = torch.nn.Embedding.from_pretrained(embed.to(device=target.device, dtype=target.dtype))
    return EagleProposer(drafter, embed if embed is not None else target.embed_tokens, tree, seed=seed)


def eagle4_export_loader(path, config: dict, target, tree_spec) -> EagleProposer:
    """A vllm (LlamaForCausalLMEagle4) export, read and validated by the independent reader (drafters.export.eagle4)."""
    from drafters.checkpoint import target_info
    from drafters.export.eagle4 import read_eagle4_export

    eagle4_config, state, embedding, _ = read_eagle4_export(path, target=target_info(target))
    return eagle4_proposer(eagle4_config, state, target, tree_spec, path, embed=embedding)


def draft_step_cost(config: Eagle4Config) -> dict[str, int]:
    """Multiply-adds of one drafted position's head: full W x = h Vd; candidate head r (h + Vd) + k h."""
    h, vd, r, k = config.hidden_size, config.draft_vocab_size, config.rank, config.candidates
    return {"full_head": h * vd, "candidate_head": r * (h + vd) + k * h}
