"""The target's cache, as the decoder and the draft-model proposer keep it: which layers a model has and whether
its drafts can be verified as a tree (`check_tree_decodable`), the cache to build for it (`model_cache`), and the
two ways back after a verification: `compact_cache` (attention-only caches: keep the accepted path's columns) and
`StateSnapshot` (caches with recurrent layers, whose states cannot be cropped: copy them back).

Knows nothing of trees' verification, proposers or tokenizers; imports transformers' cache layers only.
"""

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

TREE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # what _model_masks masks
# layers that keep a recurrent state (transformers' cache layer types): verified as chains, rolled back by snapshots
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")


def check_tree_decodable(model) -> set[str]:
    """The target's layer types (TREE_LAYER_TYPES, plus RECURRENT_LAYER_TYPES where `has_recurrent_layers`), or
    one sentence on why the decoder cannot run it, raised before any forward."""
    config = model.config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
                      or ["full_attention"])
    layer_types -= {"dummy", "moe", "mlp"}  # layers that keep no cache at all
    recurrent = layer_types & set(RECURRENT_LAYER_TYPES)
    other = sorted(layer_types - set(TREE_LAYER_TYPES) - recurrent)
    if other:
        raise NotImplementedError(
            f"decoding: {type(model).__name__} has {', '.join(other)} layers, which this decoder cannot verify drafts "
            f"on (it runs attention layers: {', '.join(TREE_LAYER_TYPES)}; and recurrent ones: "
            f"{', '.join(RECURRENT_LAYER_TYPES)}). Training and export work for this target; measure tau in an "
            "engine that serves it")
    if recurrent and layer_types & {"sliding_attention", "chunked_attention"}:
        raise NotImplementedError(
            f"decoding: {type(model).__name__} mixes recurrent layers with windowed attention, whose cache evicts "
            "keys a rejected draft would have to restore; this decoder does not roll that back. Training and export "
            "work for this target; measure tau in an engine that serves it")
    return layer_types


def has_recurrent_layers(model) -> bool:
    # True: rounds verify first-child chains and roll back by StateSnapshot (the module docstring)
    return bool(check_tree_decodable(model) & set(RECURRENT_LAYER_TYPES))


def model_cache(model) -> DynamicCache:
    # attention-only targets: plain DynamicLayers (compact_cache gathers them); recurrent ones: the model's own
    # layout, whose linear layers hold the states StateSnapshot copies
    return DynamicCache(config=model.config) if has_recurrent_layers(model) else DynamicCache()


class StateSnapshot:
    """What a chain verification must undo, taken before the verification forward; `restore` leaves the cache as
    it was then. Per layer: an attention layer's key/value length (cut back to it), a recurrent layer's conv and
    recurrent states (copied back in place: a state sums all its tokens and cannot be cropped) and its token count
    (transformers >= 5.25 counts tokens in a tensor the forward increases in place, and `cache.get_seq_length()` may
    return that live tensor: lengths are kept as ints, counts as copies). A layer may be both attention and
    recurrent (transformers' LinearAttentionAndFullAttentionLayer)."""

    def __init__(self, cache: DynamicCache):
        self.layers = [self._save(layer) for layer in cache.layers]

    @staticmethod
    def _save(layer) -> dict:
        if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(
                layer, (DynamicLayer, LinearAttentionCacheLayerMixin, DummyLayer)):
            raise NotImplementedError(f"StateSnapshot: cache layer {type(layer).__name__} is neither plain "
                                      "attention nor a recurrent state; it cannot be rolled back")
        saved = {}
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            saved["keys"] = int(DynamicLayer.get_seq_length(layer))  # the attention part's own length
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            saved["states"] = tuple({i: t.clone() for i, t in states.items() if t is not None}
                                    for states in (layer.conv_states, layer.recurrent_states))
            if isinstance(count := getattr(layer, "cumulative_length_linear", None), Tensor):  # transformers >= 5.25
                saved["count"] = count.clone()
        return saved

    def restore(self, cache: DynamicCache) -> None:
        for layer, saved in zip(cache.layers, self.layers):
            if "keys" in saved:
                layer.keys, layer.values = layer.keys[:, :, :saved["keys"]], layer.values[:, :, :saved["keys"]]
            if "states" in saved:
                for states, copies in zip((layer.conv_states, layer.recurrent_states), saved["states"]):
                    for i, copy in copies.items():
                        states[i].copy_(copy)  # in place: the layer keeps its tensors' addresses
            if "count" in saved:
                layer.cumulative_length_linear.copy_(saved["count"])


def compact_cache(cache: DynamicCache, past: int, keep: Tensor) -> None:
    # keep (a,) tree node ids in path order: cache[:past] + tree block[keep] -> cache of length past + a
    odd = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if odd:
        raise NotImplementedError(f"compact_cache: cache layers {sorted(odd)} may evict or roll keys; tree "
                                  "decoding needs plain DynamicLayer everywhere (build the cache with DynamicCache())")
    src, end = past + keep.to(cache.layers[0].keys.device), past + len(keep)
    for layer in cache.layers:
        layer.keys[:, :, past:end] = layer.keys[:, :, src]  # (B, Hkv, a, D); advanced indexing copies first
        layer.values[:, :, past:end] = layer.values[:, :, src]
        layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
