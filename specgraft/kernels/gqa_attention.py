"""Grouped-query attention that broadcasts the KV heads instead of copying them, for speculative decoding's
multi-row calls on the CPU.

Most current LLMs share each key/value head among several query heads (GQA: SmolLM2-135M 9 over 3, Llama-3 32 over
8). transformers' ``sdpa`` integration hands torch's ``scaled_dot_product_attention`` the grouping itself
(``enable_gqa``) only when the call has no mask, because CUDA's fused kernels fall back to the math kernel with
both; with a mask it first copies every KV head ``group`` times (``repeat_kv``). A one-token decoding step has no
mask (and is packed by head group), but every verification step of a speculative decoder does (a causal block
after the cache, or a tree mask), so it pays a copy of the whole KV cache per layer that plain decoding does not,
a cost that grows with the cache length.

:func:`gqa_attention_forward` is that ``sdpa`` call with ``enable_gqa=True`` for masked multi-row calls on the CPU
(torch's CPU kernels take a mask and a grouping together), and transformers' own ``sdpa`` for everything else (one
query row, no mask, dropout, soft-capping, position biases, attention sinks, other devices). Registered with
transformers' public ``AttentionInterface``; selected by ``--attention-kernel gqa`` (``auto``, the default, picks
it on the CPU for models with grouped KV heads; see :mod:`specgraft.kernels.exact_attention` for the choices).
Plain decoding runs the same function, through the one-row branch that is ``sdpa`` itself.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specgraft.decoding.kv import GQA_ATTENTION, text_config

#: Keyword arguments of transformers' attention functions that this kernel leaves to ``sdpa`` when present.
DELEGATED_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")


def gqa_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function. Shapes: query [B, H, q, d], key/value [B, KVH, kv, d], mask
    [B or 1, 1, q, kv] (bool or additive); returns ([B, q, H, d], None) like transformers' ``sdpa``."""
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if (groups == 1 or query.shape[2] == 1 or attention_mask is None or dropout or query.device.type != "cpu"
            or any(kwargs.get(name) is not None for name in DELEGATED_KWARGS)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=scaling, enable_gqa=True)  # [B, H, q, d]
    return out.transpose(1, 2).contiguous(), None


def register_gqa_attention() -> None:
    """Register :func:`gqa_attention_forward` with transformers (idempotent; called when a model switches)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, gqa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_ATTENTION, sdpa_mask)  # the masks sdpa gets


def grouped_kv_heads(model: Any) -> bool:
    """Whether ``model`` shares its key/value heads among several query heads."""

    config = text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads) and int(kv_heads) < int(heads)
