"""Draft-model speculation: a small causal LM with the target's tokenizer drafts the tree.

The draft model keeps its own KV cache. It is synchronised lazily: each round the cached tokens
are compared with the committed context plus the pending token, the cache is cropped to the
common prefix (this drops rejected drafts and keeps accepted ones) and the missing tokens are fed
in one forward. Shapes:
  - chain:K   K sequential one-token forwards; greedy at temperature 0, otherwise each token is
              sampled from the warped draft distribution q, which goes into `draft_probs` so the
              decoder can run lossless rejection sampling;
  - static / dynamic trees: the generic builders of drafters.decode.tree; `expand` is ONE batched
    forward of the draft model over the frontier with a 4D tree mask (ancestors-or-self plus the
    whole committed prefix, sliding windows honoured); candidates are the top-k tokens, so tree
    drafts are deterministic (`draft_probs` None) at any temperature.
A draft model with recurrent layers (Qwen3.5, Granite-4, LFM2: drafters.decode.cache) keeps its own cache layout,
whose states cannot be cropped: it drafts chains only, and each round's drafted tokens are undone by a
`StateSnapshot` taken once the committed tokens are fed, so its cache never holds an uncommitted token.
The proposer never runs the target; it only needs the target's vocabulary size to check that the
two models share one vocabulary.
"""

import torch
from torch import Tensor
from transformers import DynamicCache

from drafters.decode.cache import StateSnapshot, has_recurrent_layers, model_cache
from drafters.decode.proposers import TargetNeeds
from drafters.decode.sampling import SamplingConfig, sample, warp
from drafters.decode.tree import ChainSpec, Frontier, Tree, TreeSpec, build_tree, frontier_mask
from drafters.targets import with_cache


def check_same_vocabulary(draft_model, draft_tokenizer, target_vocab_size: int, target_tokenizer) -> None:
    draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
    if draft_vocab != target_vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft_vocab} logits) differs from the target's "
            f"({target_vocab_size}); a draft model must share the target's tokenizer and vocabulary"
        )
    if draft_tokenizer is not None and target_tokenizer is not None:
        if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(
                "draft model tokenizer differs from the target's (same size, different token ids); "
                "pick a draft model from the target's family"
            )


class DraftModelProposer:
    needs = TargetNeeds()  # only token ids: the draft model runs on its own

    def __init__(self, model, tree: TreeSpec, *, target_vocab_size: int, tokenizer=None,
                 target_tokenizer=None):
        check_same_vocabulary(model, tokenizer, target_vocab_size, target_tokenizer)
        self.model = model.eval().requires_grad_(False)
        self.tree = tree
        self.depth = tree.length if isinstance(tree, ChainSpec) else None  # adaptive chains
        self.sliding_window = _sliding_window(model.config)
        self.recurrent = has_recurrent_layers(model)
        if self.recurrent and self.depth is None:
            raise ValueError(f"draft model {type(model).__name__} has recurrent layers, which cannot draft a tree "
                             "in one forward: use a chain (--tree chain:K)")
        self._new_cache()

    def _new_cache(self) -> None:
        # A config-less DynamicCache keeps every layer full-length (croppable); the sliding
        # windows are applied by the model's own masks, or by `_tree_mask` for tree expansion.
        # Recurrent models get their own layout (conv and recurrent states beside the attention layers).
        self.cache = model_cache(self.model) if self.recurrent else DynamicCache()
        self.cached = torch.empty(0, dtype=torch.long)  # (C,) tokens whose KV is in the cache

    def reset(self, prompt_ids: Tensor, features=None) -> None:
        self._new_cache()
        if prompt_ids.numel() > 0:
            self._feed(prompt_ids.cpu())

    def update(self, new_tokens: Tensor, features=None, pending: int | None = None) -> None:
        pass  # the cache is synchronised lazily in `propose`

    def propose(self, context: Tensor, pending: int, sampling: SamplingConfig) -> Tree:
        sequence = torch.cat([context.cpu(), torch.tensor([pending])])  # (T+1,)
        logits = self._sync(sequence)  # (V,) draft logits after the pending token
        if self.recurrent:  # back to the committed tokens once the chain is drafted (module docstring)
            snapshot, committed = StateSnapshot(self.cache), self.cached
            chain = self._chain(pending, logits, sampling)
            snapshot.restore(self.cache)
            self.cached = committed
            return chain
        if isinstance(self.tree, ChainSpec):
            return self._chain(pending, logits, sampling)
        tree = self._tree(pending, logits)
        self._crop(sequence.numel())  # drop the tree nodes' KV; keep the committed prefix + root
        return tree

    # ------------------------------------------------------------ cache bookkeeping

    @torch.no_grad()
    def _feed(self, tokens: Tensor) -> Tensor:
        # tokens (n,) appended after the cached ones -> logits (n, V)
        start = int(self.cache.get_seq_length())
        positions = torch.arange(start, start + tokens.numel())
        out = self.model(
            input_ids=tokens[None].to(self.model.device),
            position_ids=positions[None].to(self.model.device),
            **with_cache(self.model, self.cache),
            use_cache=True,
        )
        self.cached = torch.cat([self.cached, tokens])
        return out.logits[0]

    def _crop(self, length: int) -> None:
        remove = int(self.cache.get_seq_length()) - length
        if remove > 0:
            self.cache.crop(-remove)  # transformers 5: a negative count removes that many tokens
        self.cached = self.cached[:length]

    def _sync(self, sequence: Tensor) -> Tensor:
        # Keep the longest cached prefix of `sequence` (at least one token must be fed to get logits).
        n = min(self.cached.numel(), sequence.numel() - 1)
        same = (self.cached[:n] == sequence[:n]).long()
        common = int(same.cumprod(0).sum()) if n else 0
        if self.recurrent and common < self.cached.numel():  # a state cannot be cropped: feed it all again
            self._new_cache()
            common = 0
        self._crop(common)
        return self._feed(sequence[common:])[-1]

    # ------------------------------------------------------------ chains

    def _chain(self, root: int, logits: Tensor, sampling: SamplingConfig) -> Tree:
        tokens, rows = [root], []
        for i in range(self.depth):
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q = warp(logits, sampling)  # (V,) the draft distribution the token is drawn from
                token = int(sample(q))
                rows.append(q)
            tokens.append(token)
            if i + 1 < self.depth:
                logits = self._feed(torch.tensor([token]))[-1]
        draft_probs = None
        if rows:
            draft_probs = torch.stack([torch.zeros_like(rows[0])] + rows)  # (K+1, V), row 0 unused
        return Tree.chain(torch.tensor(tokens), draft_probs)

    # ------------------------------------------------------------ trees

    def _tree(self, root: int, root_logits: Tensor) -> Tree:
        prefix = self.cache.get_seq_length()  # committed tokens + root; the root sits at prefix-1
        column = {0: prefix - 1}  # pool node -> cache column of its KV

        def expand(frontier: Frontier) -> Tensor:
            if frontier.depth == 0:
                return root_logits.float().log_softmax(-1)[None]  # (1, V)
            mask = self._tree_mask(frontier, column, prefix)
            position = prefix - 1 + frontier.depth
            logits = self._forward_tree(frontier.tokens, position, mask)  # (F, V)
            return logits.float().log_softmax(-1)

        # deterministic top-k drafts at any temperature (module docstring); chains are drafted by _chain
        return build_tree(self.tree, root, lambda depth, draws: (expand, {}), sampled=False)

    def _tree_mask(self, frontier: Frontier, column: dict[int, int], prefix: int):
        # -> (1, 1, F, C+F) bool: the whole prefix (committed + root) plus each node's expanded
        # ancestors and itself. Tree columns after the prefix hold earlier frontier nodes.
        depth = frontier.depth
        mask = frontier_mask(frontier, column, prefix, self.cache.get_seq_length())  # sets column[node]
        mask = mask[None, None].to(self.model.device)
        if self.sliding_window is None:
            return mask
        # Sliding layers see only keys with query_pos - key_pos < window. Prefix column j holds
        # position j; tree columns (>= prefix) are never further than `depth` from the query.
        query_pos = prefix - 1 + depth
        key_pos = torch.arange(mask.shape[-1], device=mask.device)
        sliding = mask & (query_pos - key_pos < self.sliding_window)
        return {"full_attention": mask, "sliding_attention": sliding}

    @torch.no_grad()
    def _forward_tree(self, tokens: Tensor, position: int, mask) -> Tensor:
        # tokens (F,) all at the same depth -> logits (F, V); appends their KV to the cache
        device = self.model.device
        out = self.model(
            input_ids=tokens[None].to(device),
            position_ids=torch.full((1, tokens.numel()), position, device=device),
            attention_mask=mask,
            **with_cache(self.model, self.cache),
            use_cache=True,
        )
        return out.logits[0]


def _sliding_window(config) -> int | None:
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        return config.sliding_window
    return None
