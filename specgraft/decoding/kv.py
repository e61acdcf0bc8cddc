"""KV-cache and attention-mask plumbing for tree verification on stock transformers models.

The decoder (and draft-model drafters) own a ``DynamicCache`` built WITHOUT a config, so every layer is a plain
``DynamicLayer`` holding keys/values of shape [batch, kv_heads, seq, head_dim] for every position. Models with
sliding-window layers (Gemma-2/3, Mistral, Phi-3 or Qwen-2 with a window) would otherwise get
``DynamicSlidingWindowLayer``s, which drop old positions as soon as the tree is appended and therefore cannot keep an
arbitrary accepted path. Here sliding layers keep the full history instead (the memory cost of a full-attention
layer) and the window is applied by the explicit mask we pass, which is exact. Models whose mask mixes full and
sliding layers get one mask per layer type (``{"full_attention": ..., "sliding_attention": ...}``); every supported
architecture accepts such a mapping. Anything else (chunked or linear attention, bidirectional Gemma-3, attention
kernels without 4D masks) is refused with a SpecgraftError rather than decoded wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from specgraft.decoding.tree import TreeStructure, additive_mask, visibility
from specgraft.errors import SpecgraftError

EXACT_ATTENTION = "specgraft_exact"
"""The name :mod:`specgraft.kernels.exact_attention` registers its kernel under (``config._attn_implementation``); kept
here, below that module, so that the two import in one direction."""

GQA_ATTENTION = "specgraft_gqa"
"""The name :mod:`specgraft.kernels.gqa_attention` registers its kernel under (sdpa broadcasting grouped KV heads)."""

#: Attention kernels that honour an arbitrary 4D additive mask (the exact one takes row layouts instead, and sdpa's
#: masks where it has none).
MASKABLE_ATTENTION = ("eager", "sdpa", EXACT_ATTENTION, GQA_ATTENTION)
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class AttentionLayout:
    """How a model masks attention: one mask for all layers, or one per layer type.

    Attributes:
        kinds: the distinct layer types (``full_attention`` / ``sliding_attention``).
        per_type: True when the model takes a ``{layer_type: mask}`` mapping (its config lists ``layer_types``
            with more than one kind); False when a single 4D tensor serves every layer.
        sliding_window: the window of ``sliding_attention`` layers (None when there are none).
    """

    kinds: tuple[str, ...]
    per_type: bool
    sliding_window: int | None

    def mask(self, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """The ``attention_mask`` argument for a forward with the given [q, kv] visibility and positions."""
        masks = {
            kind: additive_mask(visible, query_positions, key_positions, dtype,
                                self.sliding_window if kind == "sliding_attention" else None)
            for kind in self.kinds
        }
        return masks if self.per_type else masks[self.kinds[0]]

    def tree_mask(self, structure: TreeStructure, past: int, query_positions: torch.Tensor,
                  key_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """The verification mask of ``[root] + nodes`` after ``past`` cached positions (every prefix key visible).

        Full-attention layers reuse the structure's cached additive block (no per-step rebuild); sliding layers
        also need the positions, so their mask is computed from the visibility.
        """
        masks: dict[str, torch.Tensor] = {}
        device = query_positions.device
        for kind in self.kinds:
            if kind == "sliding_attention":
                masks[kind] = additive_mask(visibility(structure, past, device), query_positions, key_positions,
                                            dtype, self.sliding_window)
            else:
                block = structure.additive_block(dtype, device)  # [n+1, n+1]
                prefix = torch.zeros(block.shape[0], past, dtype=dtype, device=device)
                masks[kind] = torch.cat([prefix, block], dim=1).view(1, 1, block.shape[0], -1)
        return masks if self.per_type else masks[self.kinds[0]]


def text_config(model: Any) -> Any:
    """The decoder config of ``model`` (multimodal wrappers keep it in a sub-config)."""
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attention_layout(model: Any) -> AttentionLayout:
    """Inspect ``model``'s config; raise SpecgraftError when tree masks cannot be applied exactly."""
    config = text_config(model)
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASKABLE_ATTENTION:
        raise SpecgraftError(f"attention implementation {impl!r} cannot take a 4D tree mask; load the model with "
                             f"attn_implementation='sdpa' or 'eager'")
    if getattr(config, "use_bidirectional_attention", False):
        raise SpecgraftError("models with bidirectional attention are not causal LMs; speculative decoding needs a "
                             "causal target")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kinds = ("sliding_attention",) if window is not None else ("full_attention",)
        return AttentionLayout(kinds=kinds, per_type=False, sliding_window=window)
    unknown = sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES))
    if unknown:
        raise SpecgraftError(f"layer types {unknown} are not supported by specgraft's speculative decoder (only "
                             f"{', '.join(_SUPPORTED_LAYER_TYPES)}); use a plain attention model")
    kinds = tuple(k for k in _SUPPORTED_LAYER_TYPES if k in layer_types)
    if "sliding_attention" in kinds and window is None:
        raise SpecgraftError("config lists sliding_attention layers but no sliding_window; fix the model config")
    return AttentionLayout(kinds=kinds, per_type=len(kinds) > 1,
                           sliding_window=window if "sliding_attention" in kinds else None)


def new_cache() -> DynamicCache:
    """An empty cache whose layers keep every position (see the module docstring for why)."""
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held in the cache."""
    return int(cache.get_seq_length()) if len(cache.layers) else 0


def _check_layers(cache: DynamicCache) -> None:
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or isinstance(layer, DynamicSlidingWindowLayer):
            raise SpecgraftError(f"cache layer {i} is a {type(layer).__name__}; the speculative decoder only rolls "
                                 "back plain DynamicLayer caches (build it with specgraft.decoding.kv.new_cache())")


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer."""
    _check_layers(cache)
    current = cache_length(cache)
    if length < current:
        cache.crop(length - current)  # transformers 5.x: a NEGATIVE count of tokens to remove


def keep_positions(cache: DynamicCache, start: int, keep: Sequence[int]) -> None:
    """Keep positions ``[0, start)`` plus ``start + j`` for each ``j`` in ``keep`` (ascending), drop the rest.

    This is how an accepted tree path survives: the tree's rows follow the committed prefix in the cache. Only the
    accepted rows that are not already in place move (copied down, in place, along the sequence axis of every
    layer's keys and values); the cache is then cropped, so nothing of the prefix is ever copied.
    """
    _check_layers(cache)
    current = cache_length(cache)
    keep = list(keep)
    # Rows keep[:first] are already where they belong (the accepted rows are a prefix up to there).
    first = next((j for j, k in enumerate(keep) if k != j), len(keep))
    if first < len(keep):
        sources: dict[torch.device, torch.Tensor] = {}
        for layer in cache.layers:
            if not layer.is_initialized or layer.keys is None:
                continue
            if layer.keys.shape[-2] != current:
                raise SpecgraftError(f"cache layers disagree on length ({layer.keys.shape[-2]} vs {current}); this "
                                     "architecture's cache is not supported by the speculative decoder")
            device = layer.keys.device
            if device not in sources:
                sources[device] = torch.tensor(keep[first:], dtype=torch.long, device=device) + start
            src = sources[device]
            # keep is ascending and keep[j] >= j, so index_select's temporary makes the overlapping move safe.
            layer.keys[..., start + first : start + len(keep), :] = layer.keys.index_select(-2, src)
            layer.values[..., start + first : start + len(keep), :] = layer.values.index_select(-2, src)
    crop_cache(cache, start + len(keep))


def model_dtype(model: Any) -> torch.dtype:
    """The floating dtype of ``model``'s parameters (what attention masks must match)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def masked_forward(
    model: Any,
    layout: AttentionLayout,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    visible: torch.Tensor,
    output_hidden_states: bool = False,
) -> Any:
    """One forward of ``input_ids`` [1, q] appended to ``cache`` with an explicit mask and positions.

    Args:
        query_positions: [q] absolute positions of the new tokens (rotary position ids).
        key_positions: [kv] absolute positions of every key (cached slots, then the q new tokens), kv = len + q.
        visible: [q, kv] bool, which keys each new token may attend to (before any sliding window).
    """
    mask = layout.mask(visible, query_positions, key_positions, model_dtype(model))
    return model(input_ids=input_ids, attention_mask=mask, position_ids=query_positions.unsqueeze(0), cache=cache,
                 use_cache=True, output_hidden_states=output_hidden_states)
