"""EAGLE proposer: a trained EAGLE drafter drafts the decoder's tree from the target's features.

Alignment (docs/conventions.md): drafter position t reads (feature_t, token_{t+1}) and predicts token_{t+2}.
The drafter cache holds one slot per committed pair, slot = RoPE position. After a target prefill
of T tokens the pairs t = 0..T-2 are known; feature T-1 waits for its next token, the pending one,
which arrives with `propose` (the "root pair", slot T-1; its logits rank the root's children).
A tree node at depth d >= 1 is one drafter step on its parent's OUTPUT hidden state and its own
token, at RoPE position root + d, attending to the committed slots, the root pair and its own
ancestors (4D mask), as in the training-time test. `update` crops the tree's slots and appends
the committed pairs computed from the TARGET's features, never the drafter's own.

Sampling (temperature > 0): chain and static trees draw each node's children WITHOUT replacement
from the warped draft distribution q (draft vocabulary scattered into target ids), in child order,
and hand q to the verifier as `draft_probs` (best acceptance, lossless). Dynamic (EAGLE-2) trees
keep deterministic top-k drafts at every temperature: their rerank keeps or drops a node by its
drawn value, which would bias sampled siblings; deterministic drafts are verified as one-hot
proposals (lossless, lower acceptance).

EAGLE-3 and EAGLE-1 differ only in which target features are fused (`eagle3_inputs`). Knows
nothing about the target model (it gets features and the frozen embedding) nor verification.
"""


import torch
from torch import Tensor

from drafters.decode.proposers import TargetNeeds
from drafters.decode.sampling import SamplingConfig, warp
from drafters.decode.tree import (
    ChainSpec,
    Frontier,
    Tree,
    TreeSpec,
    build_tree,
    frontier_mask,
    parse_tree_spec,
    ranked_draws,
)
from drafters.draft_vocab import scatter_to_target
from drafters.eagle3 import Eagle3Config, fuse_features
from drafters.layers import DraftKVCache
from drafters.registry import build_drafter, check_fits


def eagle3_inputs(drafter):
    # EAGLE-3: the aux layers' hidden states concatenated; drafter.fc projects them (3h -> h).
    # differs in EAGLE-1 (drafters.decode.proposers.eagle1.eagle1_inputs): the last hidden state, no fusion
    layers = tuple(drafter.config.aux_layers)
    return TargetNeeds(layers=layers), lambda f: fuse_features(f.hidden_states, layers)  # (1, T, n*h)


class EagleProposer:
    def __init__(self, drafter, embed, tree: TreeSpec, *, inputs=eagle3_inputs, seed: int = 0):
        # drafting runs under no_grad: a drafter being trained can be evaluated as it is
        self.drafter, self.embed, self.tree = drafter, embed, tree
        self.needs, self.fuse = inputs(drafter)
        self.depth = tree.length if isinstance(tree, ChainSpec) else None  # AdaptiveChain sets it
        device = drafter.lm_head.weight.device
        self.used = drafter.draft_vocab.used.to(device)  # (Vd,) draft id -> target id
        self.generator = torch.Generator(device).manual_seed(seed)  # sampled drafts only
        self.cache, self.length, self.last = DraftKVCache(), 0, None
        self.notes: list[str] = []  # how the drafter's files were read (defaults applied), for reports

    # ------------------------------------------------------------ committed pairs

    def reset(self, prompt_ids: Tensor, features) -> None:
        fused = self.fuse(features)  # (1, T, n*h) at prompt positions 0..T-1
        self.cache, self.length, self.last = DraftKVCache(), 0, fused[:, :0]
        self._commit(fused, prompt_ids[1:])

    def update(self, new_tokens: Tensor, features, pending: int) -> None:
        # new_tokens (a,) = old pending + accepted drafts; features at their positions
        self._commit(self.fuse(features), new_tokens)

    @torch.no_grad()
    def _commit(self, fused: Tensor, next_tokens: Tensor) -> None:
        # pairs (feature_t, token_{t+1}) for every position whose next token is now known; the
        # newest feature waits for the pending token. The root pair is recomputed here (1 row).
        fused = torch.cat([self.last, fused], dim=1)  # (1, a + 1, n*h), a = len(next_tokens)
        self.cache.crop(self.length)  # drop the draft tree's slots
        if next_tokens.numel():
            self.drafter.prefill(fused[:, :-1], next_tokens[None].to(fused.device), self.embed, self.cache)
        self.length, self.last = self.length + next_tokens.numel(), fused[:, -1:]

    @torch.no_grad()
    def draft_root(self, pending: int) -> tuple[Tensor, Tensor]:
        # the root pair (newest feature, pending) at slot self.length
        # -> (output hidden (1, 1, h), logits (1, 1, Vd) over the root's children)
        self.cache.crop(self.length)
        ids = torch.tensor([[pending]], device=self.last.device)
        return self.drafter.prefill(self.last, ids, self.embed, self.cache)

    # ------------------------------------------------------------ drafting

    @torch.no_grad()
    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        if self.last is None or context.numel() != self.length + 1:
            raise RuntimeError(f"EagleProposer: the decoder's context has {context.numel()} tokens, the drafter "
                               f"holds {self.length + 1}; call reset() after the prefill and update() every round")
        hidden, logits = self.draft_root(pending)
        root = hidden[0], logits[0]  # (1, h), (1, Vd)
        # top-k drafts for dynamic trees at every temperature (module docstring)
        return build_tree(self.tree, pending, lambda depth, draws: self._expander(*root, sampling, draws),
                          sampled=not sampling.greedy, chain_depth=self.depth)

    def _expander(self, root_hidden: Tensor, root_logits: Tensor, sampling: SamplingConfig, draws: int):
        # -> (expand, probs). expand(Frontier) -> (F, V) scores over target ids: draft log-probs
        # (top-k drafts) or, with draws > 0, `draws` samples per node without replacement ranked
        # in draw order; probs[node] = (V,) the warped q its children were drawn from.
        slots, hidden, probs = {0: self.length}, {0: root_hidden[0]}, {}

        def expand(frontier: Frontier) -> Tensor:
            logits = root_logits if frontier.depth == 0 else self._step(frontier, slots, hidden)  # (F, Vd)
            if not draws:
                return self._to_target(logits.float().log_softmax(-1), float("-inf"))
            q = self._to_target(warp(logits, sampling), 0.0)  # (F, V) float32
            probs.update(zip(frontier.nodes.tolist(), q))
            return ranked_draws(q, draws, self.generator)

        return expand, probs

    def _step(self, frontier: Frontier, slots: dict, hidden: dict) -> Tensor:
        # one drafter step over the frontier (F nodes at depth d): hidden input = parent's output,
        # RoPE position = root + d, keys = committed slots + root pair + ancestors-or-self
        nodes, parents = frontier.nodes.tolist(), frontier.pool_parents.tolist()
        device = self.last.device
        mask = frontier_mask(frontier, slots, self.length + 1, len(self.cache))  # (F, S + F); sets slots
        inputs = torch.stack([hidden[parents[node]] for node in nodes])[None]  # (1, F, h)
        positions = torch.full((1, len(nodes)), self.length + frontier.depth, device=device)
        out, logits = self.drafter.step(inputs, frontier.tokens[None].to(device), self.embed, self.cache,
                                        positions, mask[None, None].to(device))
        hidden.update(zip(nodes, out[0]))
        return logits[0]  # (F, Vd)

    def _to_target(self, x: Tensor, fill: float) -> Tensor:  # (F, Vd) -> (F, V), `fill` off the draft vocab
        return scatter_to_target(x, self.used, self.drafter.config.vocab_size, fill)


# ---------------------------------------------------------------- building one (a native checkpoint's: loading.py)


def eagle3_proposer(config: Eagle3Config, state: dict, target, tree_spec: str | TreeSpec, where, *,
                    seed: int = 0, embed: Tensor | None = None) -> EagleProposer:
    # config + state dict in Eagle3Drafter names, from a native checkpoint or an sglang / vllm export;
    # embed (V, h): the drafter's own token embedding if the export has one, else the target's is used
    check_fits(config, target, where)
    drafter = build_drafter("eagle3", config, state, where)
    drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    tree = parse_tree_spec(tree_spec) if isinstance(tree_spec, str) else tree_spec
    if embed is not None:  # as vLLM does: the checkpoint's embedding wins over the target's
        embed = torch.nn.Embedding.from_pretrained(embed.to(device=target.device, dtype=target.dtype))
    return EagleProposer(drafter, embed if embed is not None else target.embed_tokens, tree, seed=seed)


# ---------------------------------------------------------------- loading an exported drafter


def eagle3_export_loader(fmt: str):
    """-> load(path, config, target, tree, aux_layers=None) for an sglang / vllm EAGLE-3 export: ours,
    or one written by another trainer (SpecForge, speculators, the EAGLE repository), so its tau can
    be measured here. The files are read and validated by the independent export reader; layer ids
    come back as HF indices. A config without layer ids drafts from the engine's default layers, or
    from `aux_layers` (HF indices); `proposer.notes` says which (the lines the caller prints)."""
    from drafters.checkpoint import target_info
    from drafters.export.eagle3_reader import export_embedding, read_eagle3_export

    def load(path, config: dict, target, tree_spec, *, aux_layers: list[int] | None = None) -> EagleProposer:
        notes = []
        eagle_config, state, _, _ = read_eagle3_export(path, fmt, target=target_info(target), aux_layers=aux_layers,
                                                       notes=notes)
        embed = export_embedding(path) if fmt == "vllm" else None  # speculators saves one
        proposer = eagle3_proposer(eagle_config, state, target, tree_spec, path, embed=embed)
        proposer.notes = notes
        return proposer

    return load
