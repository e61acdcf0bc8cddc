"""Row-exact attention: every verification row computed by the very call plain one-token decoding makes.

Speculative decoding is lossless in exact arithmetic, but a fused attention kernel does not compute a query row the
same way when the call holds one query as when it holds sixteen: the key dimension it reduces over grows by the
tree's masked keys, its blocking follows the call's shape, and a bf16 logit that sits on a rounding tie flips.
In bf16 the logits of a multi-token verification differ from one-token decoding's by a few ulps in both
transformers' ``sdpa`` and ``eager`` attention, enough for greedy answers to diverge at near-ties; in fp32 the
differences are far below the gaps between tokens.

This module is an attention implementation, registered with transformers' public ``AttentionInterface``, that
makes no arithmetic of its own. A one-token step of plain decoding calls transformers' ``sdpa`` with one query row,
no mask, and the contiguous cache of the ``L`` positions before and at the token: torch's CPU flash kernel then
reduces over those ``L`` keys in the model's dtype with blocks that depend on ``L`` alone. For a verification row
at depth ``d`` after ``past`` cached positions, the row's keys are the prefix and its root-to-row path, ``L = past
+ d + 1`` of them in logical order: this kernel hands exactly those keys (a slice of the cache where they are a
prefix of it, else gathered) and the row's query to the same ``sdpa`` call, with no mask. Rows at equal depth share
``L`` and go in one call as a batch: torch's CPU flash kernel computes each (batch, head) item on its own with the
same products as a batch of one (:func:`rows_match_one_row_calls` checks that wherever the kernel is switched on).
So a verification row's attention output is, by construction, the one plain decoding computes at that position
with the stock kernel, in every dtype, at every row count and cache length; the prompt's prefill (no row layout
passed) is ``sdpa`` unchanged, and so is plain decoding under this kernel.

The rest of the forward must then compute a row alone and among others alike. The linear layers' GEMM does so
only up to some row count, which depends on the machine, dtype and shape (a bf16 GEMM may change kernels above a few
dozen rows on one CPU and regroup a small projection's sum from 3 rows on another); MKL's fp32 GEMM regroups a
row's sum from 2 rows on. So the exact path switches the target's linear layers to products of at most as many rows
as the machine computes row by row (probed per shape with order-revealing inputs, the smallest for all:
:func:`specgraft.kernels.linear.use_row_exact_linears`), one row per product where that is one (exact, and slow: each
verified row reads the weights again). Activations and rotary tables round a row's elements differently when they
fall in a vectorised block or in its scalar tail, which depends on the call's size, so inside a verification forward
they compute each row by its own call too (:func:`use_row_by_row_elementwise`, :func:`rows_one_at_a_time`); norms,
residuals and the rotary products are exact element-wise arithmetic or per-row reductions. Greedy answers are then
token-identical to plain decoding with the stock kernels, in fp32 and bf16: the attention and the row-by-row parts by
construction, the linear products by construction at one row per product and by the order-revealing probe above
that (``tests/kernels/test_kernel_identity.py`` decodes 400 bf16 tokens with every built-in drafter to check it).

:func:`rows_match_one_row_calls` checks the construction once per attention shape on this machine (grouped calls
against one-row calls at row counts and cache lengths around the flash kernel's blocks), as a guard against a torch
build whose kernel is not per-item.

Cost: one ``sdpa`` call per depth of the tree and layer instead of one per layer, plus the gathered keys of branch
rows; selected with ``--attention-kernel exact`` on ``specgraft eval`` / ``tune`` / ``profile``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from specgraft.decoding.kv import EXACT_ATTENTION, GQA_ATTENTION, attention_layout, text_config
from specgraft.decoding.rows import (  # noqa: F401 (the row-layout protocol this kernel implements, re-exported)
    ROW_BY_ROW_FLAG,
    ROWS_KWARG,
    RowGroup,
    RowKeys,
    chain_row_keys,
    row_keys,
    rows_one_at_a_time,
    uses_exact_attention,
)
from specgraft.decoding.tree import tree_structure
from specgraft.errors import SpecgraftError
from specgraft.kernels.choices import ATTENTION_KERNELS
from specgraft.kernels.gqa_attention import grouped_kv_heads
from specgraft.kernels.linear import row_exact_linear_class, use_row_exact_linears, weight_major_linear_class

logger = logging.getLogger(__name__)


def exact_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (see the module docstring).

    Shapes: query [1, H, q, d], key/value [1, KVH, past + q, d] (the cache after this forward's rows were
    appended); returns ([1, q, H, d], None) like transformers' own implementations. Without a
    :class:`RowKeys` under :data:`ROWS_KWARG` (a prompt's prefill, or a caller that is not the decoder) it is
    transformers' ``sdpa``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows: RowKeys | None = kwargs.pop(ROWS_KWARG, None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    if batch != 1 or key.shape[2] != rows.past + q or rows.size != q:
        raise SpecgraftError(f"exact attention got query {tuple(query.shape)} and keys {tuple(key.shape)} for a row "
                             f"layout of {rows.size} rows after {rows.past} positions; it decodes one sequence at a "
                             "time through specgraft's decoder")
    out = query.new_empty(q, 1, heads, value.shape[-1])
    for group in rows.groups:
        if group.keys is None:
            # Plain decoding's own call: one row, the cache's first `length` positions, no mask.
            query_g = query[:, :, group.first_row : group.first_row + 1]
            key_g, value_g = key[:, :, : group.length], value[:, :, : group.length]
        else:
            g = group.rows.shape[0]
            query_g = query[0].index_select(1, group.rows).transpose(0, 1).unsqueeze(2)  # [g, H, 1, d]
            key_g = key[0].index_select(1, group.keys).view(kv_heads, g, group.length, dim).transpose(0, 1)
            value_g = value[0].index_select(1, group.keys).view(kv_heads, g, group.length, -1).transpose(0, 1)
        attended, _ = sdpa_attention_forward(module, query_g.contiguous(), key_g.contiguous(), value_g.contiguous(),
                                             None, dropout=dropout, scaling=scaling, **kwargs)  # [g, 1, H, d]
        out.index_copy_(0, group.rows, attended)
    return out.view(1, q, heads, -1), None


#: Cache lengths the construction check tries: short, on and across the flash kernel's 512-key block.
PROBE_PAST = (0, 1, 7, 30, 509, 517)
#: A tree whose depths hold 1, 3, 4, 2 and 1 rows, paths away from the first rows included.
PROBE_TREE = (-1, -1, -1, 0, 1, 2, 2, 3, 5, 7)


@functools.cache
def rows_match_one_row_calls(kv_heads: int, group: int, dim: int, dtype: str, device: str) -> bool:
    """Whether this machine's torch computes every row of an exact-attention call as transformers' ``sdpa`` computes
    it alone, the way plain decoding calls it (one row, no mask, the contiguous cache): the per-item property of the
    flash kernel the construction rests on. Checked once per attention shape and dtype on random inputs, a tree and
    a chain at several cache lengths."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward


    gen = torch.Generator().manual_seed(0)
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    module = argparse.Namespace(num_key_value_groups=group, is_causal=True)
    for structure in (tree_structure(PROBE_TREE), tree_structure(tuple(range(-1, len(PROBE_TREE) - 1)))):
        q = structure.size + 1
        paths = {row: path for _, rows, row_paths in structure.rows_by_depth for row, path in zip(rows, row_paths)}
        for past in PROBE_PAST:
            keys, values = (torch.randn(1, kv_heads, past + q, dim, generator=gen).to(device=device, dtype=torch_dtype)
                            for _ in range(2))
            query = torch.randn(1, kv_heads * group, q, dim, generator=gen).to(device=device, dtype=torch_dtype)
            out, _ = exact_attention_forward(module, query, keys, values, None,
                                             **{ROWS_KWARG: row_keys(past, structure, device)})
            for r in range(q):
                slots = torch.cat([torch.arange(past), past + torch.tensor(paths[r])]).to(device)
                alone, _ = sdpa_attention_forward(module, query[:, :, r : r + 1].contiguous(),
                                                  keys[:, :, slots].contiguous(), values[:, :, slots].contiguous(),
                                                  None)
                if not torch.equal(out[0, r], alone[0, 0]):
                    return False
    return True


def register_exact_attention() -> None:
    """Register :func:`exact_attention_forward` with transformers (idempotent; called when a model switches)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
    # Masks as for sdpa: the prefill (and any caller without a row layout) runs sdpa with them.
    ALL_MASK_ATTENTION_FUNCTIONS.register(EXACT_ATTENTION, sdpa_mask)


def attention_kernel_of(model: Any) -> str:
    """``exact``, ``gqa`` or ``stock``: the ``--attention-kernel`` ``model`` runs (what cost profiles record)."""
    if uses_exact_attention(model):
        return "exact"
    return "gqa" if getattr(model.config, "_attn_implementation", None) == GQA_ATTENTION else "stock"


def resolve_attention_kernel(choice: str, model: Any) -> str:
    """``stock``, ``gqa`` or ``exact`` for a ``--attention-kernel`` choice on ``model`` (``auto`` resolved)."""
    if choice not in ATTENTION_KERNELS:
        raise SpecgraftError(f"--attention-kernel {choice!r} is not one of {', '.join(ATTENTION_KERNELS)}")
    if choice != "auto":
        return choice

    on_cpu = next(model.parameters()).device.type == "cpu"
    sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
    softcap = getattr(text_config(model), "attn_logit_softcapping", None)
    return "gqa" if on_cpu and sdpa and not softcap and grouped_kv_heads(model) else "stock"


STOCK_ATTENTION_ATTR = "specgraft_stock_attention"
"""Instance attribute recording the attention implementation a model had before a kernel switch (what
:func:`stock_kernels` restores for the baseline)."""


def apply_attention_kernel(choice: str, model: Any) -> str:
    """Switch the target ``model`` to the ``--attention-kernel`` ``choice``; returns the kernel it runs."""
    choice = resolve_attention_kernel(choice, model)
    if choice == "stock":
        return choice
    if not hasattr(model, STOCK_ATTENTION_ATTR):
        object.__setattr__(model, STOCK_ATTENTION_ATTR, getattr(model.config, "_attn_implementation", None))
    if choice == "gqa":
        from specgraft.kernels.gqa_attention import register_gqa_attention

        softcap = getattr(text_config(model), "attn_logit_softcapping", None)
        if softcap:
            raise SpecgraftError(f"--attention-kernel gqa runs sdpa, which has no attention logit soft-capping (this "
                                 f"model caps its attention logits at {softcap}); use --attention-kernel stock")
        register_gqa_attention()
        model.set_attn_implementation(GQA_ATTENTION)
        return choice
    layout = attention_layout(model)
    config = text_config(model)
    if layout.sliding_window is not None or layout.kinds != ("full_attention",):
        raise SpecgraftError("--attention-kernel exact supports full-attention models only (this one has "
                             "sliding-window layers); use --attention-kernel stock")
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "use_alibi", False):
        raise SpecgraftError("--attention-kernel exact does not implement logit soft-capping or ALiBi; use "
                             "--attention-kernel stock")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    parameter = next(model.parameters())
    dtype = str(parameter.dtype).removeprefix("torch.")
    if not rows_match_one_row_calls(kv_heads, heads // kv_heads, dim, dtype, str(parameter.device)):
        raise SpecgraftError(f"--attention-kernel exact cannot be bit-exact with this torch build: its attention "
                             f"kernel computes a query row differently in a batch than alone (checked at this "
                             f"model's attention shape, {kv_heads} KV heads x {heads // kv_heads} of {dim}, {dtype}); "
                             f"use --attention-kernel stock (greedy answers then match plain decoding up to "
                             f"rounding, which the eval's lossless check reports)")
    _use_row_exact_linears(model, dtype)
    use_row_by_row_elementwise(model)
    register_exact_attention()
    model.set_attn_implementation(EXACT_ATTENTION)
    return choice


def _use_row_exact_linears(model: Any, dtype: str) -> None:
    """The rest of the exact path: the target's linear layers split a call into products of as many rows as this
    machine's GEMM computes row by row (:func:`specgraft.kernels.linear.use_row_exact_linears`), one row each where
    that is one (then a verification reads every weight once per row: exact, and slower than plain decoding's
    products; the eval's speedup against the stock baseline shows it)."""

    chunk, switched = use_row_exact_linears(model)
    if chunk < 2:
        logger.warning("exact attention: this machine's %s matrix products compute a row differently beside another "
                       "one, so the %d linear layers multiply one row per product in verification (exact, but each "
                       "verified row reads the weights again); --attention-kernel stock is faster and matches plain "
                       "decoding up to rounding", dtype, switched)
    else:
        logger.info("exact attention: %d linear layers multiply at most %d rows per product (row-exact up to there "
                    "on this machine in %s)", switched, chunk, dtype)


@functools.cache  # one subclass per module class, built on first use
def _row_by_row_class(cls: type) -> type:
    """A subclass of the activation or rotary-embedding class ``cls`` whose forward, inside
    :func:`rows_one_at_a_time`, computes each row of a multi-row call by the call plain decoding makes for it."""
    rotary = cls.__name__.endswith("RotaryEmbedding")

    def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        base = super(subclass, self).forward
        if not getattr(self, ROW_BY_ROW_FLAG, False):
            return base(x, *args, **kwargs)
        if rotary:  # (x, position_ids) -> (cos, sin), each [B, q, dim]; per position, as a one-token step asks
            (positions,) = args or (kwargs.pop("position_ids"),)
            if positions.shape[-1] == 1:
                return base(x, positions, **kwargs)
            parts = [base(x, positions[..., r : r + 1], **kwargs) for r in range(positions.shape[-1])]
            return tuple(torch.cat(halves, dim=-2) for halves in zip(*parts))
        if x.dim() < 2 or x.shape[-2] == 1:
            return base(x, *args, **kwargs)
        return torch.cat([base(x[..., r : r + 1, :], *args, **kwargs) for r in range(x.shape[-2])], dim=-2)

    subclass = type(f"RowByRow{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return subclass


def use_row_by_row_elementwise(model: Any) -> int:
    """Switch ``model``'s activation functions and rotary embeddings to compute a verification's rows one call
    each (same object and state, new forward, as :func:`specgraft.kernels.linear.use_row_exact_linears`); returns how
    many modules were switched. Idempotent.

    Why: their transcendental functions (exp in SiLU, cos/sin of the rotary angles) are vectorised in blocks of
    the tensor's elements with a scalar tail, and the two can round differently. A row computed alone and the same
    row inside a bigger call can fall on different sides of that boundary (stories260K's 172-wide MLP, its 8-wide
    rotary table), so a one-token step and the verification of that token get different bf16 values now and then
    (the first such flip came after 219 greedy tokens from ``[1]``). The prefill and every call outside
    :func:`rows_one_at_a_time` are unchanged."""
    from transformers.activations import ACT2CLS

    activations = tuple({entry[0] if isinstance(entry, tuple) else entry for entry in ACT2CLS.values()})
    switched = 0
    for module in model.modules():
        cls = type(module)
        base = cls.__bases__[0] if cls.__name__.startswith("RowByRow") else cls
        if isinstance(module, activations) or base.__name__.endswith("RotaryEmbedding"):
            module.__class__ = _row_by_row_class(base)
            setattr(module, ROW_BY_ROW_FLAG, False)
            switched += 1
    return switched


def _switched_modules(model: Any) -> list[tuple[Any, type]]:
    """Every module of ``model`` that a kernel switch gave another class, with its stock class."""
    from torch import nn


    linear_classes = (row_exact_linear_class(), weight_major_linear_class())
    out = []
    for module in model.modules():
        cls = type(module)
        if cls in linear_classes:
            out.append((module, nn.Linear))
        elif hasattr(module, ROW_BY_ROW_FLAG):
            out.append((module, cls.__bases__[0]))
    return out


def kernel_setting(model: Any) -> str:
    """What ``model`` decodes with, in words: ``stock``, or its attention and linear kernels (``attention exact,
    linear row-exact``): the name of a plain-decoding setting in reports."""
    linears = {type(m).__name__ for m, stock in _switched_modules(model) if stock.__name__ == "Linear"}
    attention = attention_kernel_of(model)
    if attention == "stock" and not linears:
        return "stock"
    linear = "weight-major" if "WeightMajorLinear" in linears else "row-exact" if linears else "stock"
    return f"attention {attention}, linear {linear}"


def plain_decoding_differs(model: Any) -> bool:
    """Whether ``model``'s kernels run plain decoding's one-token steps other than the stock ones: switched linear
    layers (another product, or a wrapper around it) or the exact attention path. ``gqa`` alone does not: its
    one-row calls are transformers' ``sdpa`` itself, so timing plain decoding under it again would measure nothing
    new."""
    return attention_kernel_of(model) == "exact" or any(stock.__name__ == "Linear"
                                                        for _, stock in _switched_modules(model))


@contextlib.contextmanager
def stock_kernels(model: Any) -> Iterator[None]:
    """Run ``model`` with the stock kernels for a while (transformers' own attention, ``nn.Linear``, the stock
    activations and rotary tables): plain decoding as the user runs it without specgraft, the baseline every
    speedup is measured against. The switched kernels come back afterwards; parameters are untouched."""
    switched = [(module, type(module), stock) for module, stock in _switched_modules(model)]
    kernel_impl = getattr(model.config, "_attn_implementation", None)
    stock_impl = getattr(model, STOCK_ATTENTION_ATTR, kernel_impl)
    for module, _, stock in switched:
        module.__class__ = stock
    if stock_impl != kernel_impl:
        model.set_attn_implementation(stock_impl)
    try:
        yield
    finally:
        if stock_impl != kernel_impl:
            model.set_attn_implementation(kernel_impl)
        for module, kernel_class, _ in switched:
            module.__class__ = kernel_class
