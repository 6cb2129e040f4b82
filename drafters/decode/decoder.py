"""Speculative decoding with one shared tree verifier, on a stock Hugging Face model, batch size 1.

Per round: the proposer drafts a `Tree` rooted at the pending token; ONE target forward scores all
nodes (4D mask = whole cache + ancestors-or-self in the tree, position = cache length + depth);
verification picks the accepted root-to-node path and a bonus token; the cache is compacted to
that path; the bonus becomes the next pending token.

The target cache is a plain `DynamicCache()` (full-attention layers everywhere): for
sliding-window models (Gemma-3) the window is applied by the masks built here, never by cache
eviction, so compaction is one gather for every layer. Costs memory on long contexts, not
correctness. The decoder knows nothing about how drafts are made (proposers do) nor tokenizers.

Targets with recurrent layers (linear attention, Mamba: Qwen3.5, Qwen3-Next, Granite-4) keep a state per layer
that sums every token it has seen, so tree branches cannot share one forward and a rejected draft cannot be
cropped out. For them a round verifies the tree's first-child chain (the proposer's top path) in the model's own
cache (`DynamicCache(config=...)`), after a `StateSnapshot`; when a draft is rejected the snapshot is restored
and the accepted tokens are fed again, one extra forward of a + 1 tokens.
"""

from dataclasses import dataclass, field
from time import perf_counter

import torch
from torch import Tensor
from transformers import DynamicCache

from drafters.acceptance import depth_acceptance
from drafters.decode.cache import (StateSnapshot, check_tree_decodable, compact_cache, has_recurrent_layers,
                                   model_cache)
from drafters.decode.proposers import Proposer, TargetNeeds
from drafters.decode.sampling import SamplingConfig, sample, warp
from drafters.decode.tree import Tree
from drafters.targets import PreNormCapture, TargetFeatures, with_cache
from drafters.timing import synced_clock


@dataclass
class RoundStats:
    # A round cut short by EOS / max_new_tokens counts the tokens it emitted: sum(accepted + 1) = new
    # tokens after the prefill token.
    accepted: list[int] = field(default_factory=list)  # committed draft tokens per round
    tree_sizes: list[int] = field(default_factory=list)  # nodes per round, root included
    tree_depths: list[int] = field(default_factory=list)  # deepest node drafted per round
    prefill_s: float = 0.0
    draft_s: float = 0.0  # proposer.propose + proposer.update
    verify_s: float = 0.0  # target forward over the tree
    other_s: float = 0.0  # acceptance rule, cache compaction or state rollback, bookkeeping

    @property
    def num_rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:  # mean accepted length: accepted drafts + the bonus token
        return sum(a + 1 for a in self.accepted) / max(self.num_rounds, 1)

    def depth_acceptance(self) -> list[float]:
        # [d - 1] = rounds that accepted depth d / rounds that drafted depth d
        return depth_acceptance(self.accepted, self.tree_depths)


# ---------------------------------------------------------------- target forward over a tree


def tree_attention_mask(tree: Tree, past: int, dtype: torch.dtype, sliding_window: int | None = None,
                        chunk_size: int | None = None) -> Tensor:
    # (1, 1, N, past + N) additive: 0 = attend, dtype min = masked. Every node sees the whole
    # cache and its ancestors-or-self; with a window, key j is visible from query i iff pos_i - pos_j < W; with
    # chunks (Llama-4's chunked attention), iff pos_i // C == pos_j // C.
    n, device = tree.num_nodes, tree.tokens.device
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), tree.ancestor_mask], dim=1)
    q_pos = past + tree.depths  # (N,)
    k_pos = torch.cat([torch.arange(past, device=device), q_pos])  # (past + N,)
    if sliding_window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    if chunk_size is not None:
        visible &= (q_pos[:, None] // chunk_size) == (k_pos[None, :] // chunk_size)
    mask = torch.zeros(n, past + n, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def _model_masks(model, tree: Tree, past: int):
    config = model.config.get_text_config()
    if getattr(config, "layer_types", None) is None and getattr(config, "sliding_window", None) is not None:
        # a window set on the config alone (Mistral-7B-v0.1, Phi-3 / 3.5 / 4-mini): every layer is windowed, as the
        # model's own mask (transformers' sliding-window causal mask for all layers) has it
        return tree_attention_mask(tree, past, model.dtype, config.sliding_window)
    layer_types = check_tree_decodable(model)
    makers = {"full_attention": lambda: tree_attention_mask(tree, past, model.dtype),
              "sliding_attention": lambda: tree_attention_mask(tree, past, model.dtype, config.sliding_window),
              "chunked_attention": lambda: tree_attention_mask(tree, past, model.dtype,
                                                               chunk_size=config.attention_chunk_size)}
    if layer_types == {"full_attention"}:
        return makers["full_attention"]()
    # models with several layer types take one mask per type (Gemma-3's sliding, Llama-4's chunked layers)
    return {kind: makers[kind]() for kind in layer_types}


def tree_forward(model, cache: DynamicCache, tree: Tree, *, hidden_states: bool = False):
    # One target forward over all tree nodes; appends their K/V (N entries) to the cache.
    past = int(cache.get_seq_length())  # an int, not a recurrent layer's live counter (transformers >= 5.25)
    position_ids = (past + tree.depths)[None]  # (1, N)
    return model(input_ids=tree.tokens[None], attention_mask=_model_masks(model, tree, past),
                 position_ids=position_ids, **with_cache(model, cache), use_cache=True,
                 output_hidden_states=hidden_states)


def chain_forward(model, cache: DynamicCache, tokens: Tensor, *, hidden_states: bool = False):
    # tokens (n,) after the cache: the model's own causal (and recurrent) path, no custom mask
    past = int(cache.get_seq_length())
    position_ids = past + torch.arange(tokens.numel(), device=tokens.device)
    return model(input_ids=tokens[None], position_ids=position_ids[None], **with_cache(model, cache), use_cache=True,
                 output_hidden_states=hidden_states)


def first_chain(tree: Tree) -> Tree:
    # the root and, at each depth, the first child: a static or dynamic tree's top path (its draft rows with it)
    nodes = [0]
    while tree.children[nodes[-1]]:
        nodes.append(tree.children[nodes[-1]][0])
    if len(nodes) == tree.num_nodes:
        return tree
    index = torch.tensor(nodes, device=tree.tokens.device)
    probs = None if tree.draft_probs is None else tree.draft_probs[index.to(tree.draft_probs.device)]
    return Tree.chain(tree.tokens[index], probs)


# ---------------------------------------------------------------- verification


def verify_greedy(tree: Tree, logits: Tensor) -> tuple[list[int], int]:
    # logits (N, V). Node i is correct iff its token is the target argmax after its parent; accept
    # the deepest node whose ancestors-or-self are all correct (lowest id on ties), then the bonus
    # token = the target argmax after it.
    argmax = logits.argmax(-1)  # (N,)
    correct = tree.tokens == argmax[tree.parents.clamp(min=0)]  # (N,)
    correct[0] = True
    on_path = ~(tree.ancestor_mask & ~correct[None]).any(1)  # (N,)
    best = (tree.depths * on_path).argmax()  # first maximum
    best, bonus = torch.stack([best, argmax[best]]).tolist()
    return tree.path_to(best), bonus


def residual(p: Tensor, q: Tensor) -> Tensor:
    # norm(max(0, p - q)): what is left of p once a draft from q was rejected. Mass 0 only when
    # p <= q everywhere, where rejection has probability 0: fall back to p.
    r = (p - q).clamp(min=0)
    mass = r.sum()
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def draft_proposal(tree: Tree, child: int, tried: list[int], vocab: int, device) -> Tensor:
    # (V,) the distribution `child` was drawn from. Siblings are drawn without replacement: q_i =
    # the draft row with the tokens of earlier siblings zeroed, renormalised. Deterministic drafts
    # (draft_probs None) count as q = one-hot at the child's token.
    if tree.draft_probs is None:
        return torch.zeros(vocab, device=device).index_fill_(0, tree.tokens[child].to(device), 1.0)
    q = tree.draft_probs[child].to(device=device, dtype=torch.float32).clone()
    q[tried] = 0.0
    return q / q.sum().clamp(min=1e-30)


def verify_sampling(tree: Tree, target_probs, generator=None, *, residual=residual) -> tuple[list[int], int]:
    # target_probs: (N, V) tensor or callable node -> (V,) warped target distribution after that node.
    # Recursive rejection sampling (SpecInfer / EAGLE), lossless: at node u with target p and children
    # c_1..c_m in order, each drawn from q_i:
    #   accept c_i with probability min(1, p(c_i) / q_i(c_i))  -> move to c_i, repeat there;
    #   on rejection p <- norm(max(0, p - q_i)) and try the next sibling;
    #   all rejected (or no children): bonus ~ p.
    tokens, node = tree.tokens.tolist(), 0
    while True:
        p = target_probs(node) if callable(target_probs) else target_probs[node]  # (V,)
        tried, accepted = [], None
        for child in tree.children[node]:
            q = draft_proposal(tree, child, tried, p.shape[-1], p.device)
            u = torch.rand((), generator=generator, device=p.device)
            x = tokens[child]
            if bool(u * q[x] < p[x]):  # u < p/q without dividing; q(x) = p(x) = 0 rejects
                accepted = child
                break
            p = residual(p, q)
            tried.append(x)
        if accepted is None:
            return tree.path_to(node), int(sample(p, generator))
        node = accepted


# ---------------------------------------------------------------- the decode loop


@torch.no_grad()
def speculative_generate(model, proposer: Proposer, prompt_ids: Tensor, *, max_new_tokens: int,
                         sampling: SamplingConfig = SamplingConfig(), eos_token_ids=(), generator=None):
    # prompt_ids (T,) or (1, T) -> (prompt + new tokens (T + n,), RoundStats); stops where
    # `model.generate` would: after the first EOS (kept) or at max_new_tokens (the prefill token counts).
    model = model if isinstance(model, torch.nn.Module) else model.model  # a drafters Target works too
    _check_supported(model, max_new_tokens)
    device, eos, needs = model.device, set(eos_token_ids), proposer.needs
    if generator is None and sampling.seed is not None:
        generator = torch.Generator(device).manual_seed(sampling.seed)
    prompt, stats, cache = prompt_ids.reshape(-1).to(device), RoundStats(), model_cache(model)
    with PreNormCapture(model, needs.pre_norm_last) as pre_norm:  # (1, T, H) of the last forward
        start = perf_counter()
        out = model(input_ids=prompt[None], **with_cache(model, cache), use_cache=True,
                    output_hidden_states=needs.any)
        generated = [_pick(out.logits[0, -1], sampling, generator)]
        proposer.reset(prompt, _features(out, pre_norm, needs, slice(None)))
        stats.prefill_s = perf_counter() - start
        call = Generation(model, proposer, cache, prompt, sampling, generator, eos, max_new_tokens, pre_norm)
        while not call.finished(generated):
            _round(call, generated, stats)
    return torch.cat([prompt, torch.tensor(generated, device=device)]), stats


@dataclass(frozen=True)
class Generation:
    """What every round of one speculative_generate call reads. The objects are fixed for the call; the cache (and
    the proposer's own state) change in place each round."""

    model: torch.nn.Module  # the target
    proposer: Proposer
    cache: DynamicCache  # the target's: prompt + generated[:-1] (the pending token is not in it yet)
    prompt: Tensor  # (T,) on the model's device
    sampling: SamplingConfig
    generator: torch.Generator | None  # draws of the sampling verifier
    eos: set[int]
    max_new_tokens: int
    pre_norm: PreNormCapture  # the last forward's pre-norm hidden state (1, T, H), where the proposer reads it

    def finished(self, generated: list[int]) -> bool:
        return len(generated) >= self.max_new_tokens or generated[-1] in self.eos


def _round(call: Generation, generated: list[int], stats: RoundStats) -> None:
    # one round: propose a tree at the pending token generated[-1], verify it in one target forward, commit the
    # accepted path + bonus to `generated`, then compact the cache to that path and update the proposer
    model, proposer, cache, sampling = call.model, call.proposer, call.cache, call.sampling
    pending, needs, device = generated[-1], proposer.needs, call.prompt.device
    t0 = perf_counter()
    context = torch.cat([call.prompt, torch.tensor(generated[:-1], dtype=torch.long, device=device)])  # (T,) = cache
    tree = _on(proposer.propose(context, pending, sampling), device, pending)
    snapshot = None
    if recurrent := has_recurrent_layers(model):
        tree, snapshot = first_chain(tree), StateSnapshot(cache)
    t1 = synced_clock(device)
    past = int(cache.get_seq_length())
    if recurrent:
        out = chain_forward(model, cache, tree.tokens, hidden_states=needs.any)
    else:
        out = tree_forward(model, cache, tree, hidden_states=needs.any)
    logits = out.logits[0]  # (N, V)
    t2 = synced_clock(device)
    if sampling.greedy:
        path, bonus = verify_greedy(tree, logits)
    else:
        path, bonus = verify_sampling(tree, lambda u: warp(logits[u], sampling), call.generator)
    new = _cut(tree.tokens[path[1:]].tolist() + [bonus], call.eos, call.max_new_tokens - len(generated))
    generated += new
    stats.accepted.append(len(new) - 1)
    stats.tree_sizes.append(tree.num_nodes)
    stats.tree_depths.append(tree.max_depth)
    t3 = perf_counter()
    if not call.finished(generated):  # the last round needs no cache or proposer update
        keep = torch.tensor(path, device=device)
        if not recurrent:
            compact_cache(cache, past, keep)
        elif len(path) < tree.num_nodes:  # a draft was rejected: back to before the round, then the accepted path
            snapshot.restore(cache)
            chain_forward(model, cache, tree.tokens[keep])
        t3 = synced_clock(device)
        proposer.update(tree.tokens[keep], _features(out, call.pre_norm, needs, keep), bonus)
    t4 = synced_clock(device)
    stats.draft_s += (t1 - t0) + (t4 - t3)
    stats.verify_s += t2 - t1
    stats.other_s += t3 - t2


def _cut(new: list[int], eos: set[int], budget: int) -> list[int]:
    # keep up to and including the first EOS, and at most `budget` tokens
    new = new[:budget]
    first_eos = next((i for i, t in enumerate(new) if t in eos), None)
    return new if first_eos is None else new[: first_eos + 1]


def _pick(logits: Tensor, sampling: SamplingConfig, generator) -> int:
    return int(logits.argmax()) if sampling.greedy else int(sample(warp(logits, sampling), generator))


def _on(tree: Tree, device, pending: int) -> Tree:
    if int(tree.tokens[0]) != pending:
        raise ValueError(f"proposer returned a tree whose root is {int(tree.tokens[0])}, not the pending token {pending}")
    if tree.tokens.device == device:
        return tree
    probs = None if tree.draft_probs is None else tree.draft_probs.to(device)
    return Tree(tree.tokens.to(device), tree.parents.to(device), probs)


def _check_supported(model, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if has_recurrent_layers(model):
        return  # chain rounds use the model's own masks
    attn = model.config._attn_implementation
    if attn not in ("sdpa", "eager"):
        raise NotImplementedError(f"tree decoding needs a 4D attention mask: load the target with "
                                  f"attn_implementation='sdpa' or 'eager', not {attn!r}")


# ---------------------------------------------------------------- target features for proposers


def _features(out, pre_norm: PreNormCapture, needs: TargetNeeds, index):
    # TargetFeatures at the given positions of the last forward (index: slice or (a,) node ids)
    if not needs.any:
        return None
    hidden = out.hidden_states  # L + 1 entries of (1, T, H)
    return TargetFeatures(
        hidden_states={layer: hidden[layer][:, index] for layer in needs.layers},
        last_hidden=hidden[-1][:, index],
        pre_norm_last=pre_norm.value[:, index] if needs.pre_norm_last else None,
        logits=out.logits[:, index],
    )
