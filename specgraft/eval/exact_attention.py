"""Row-exact attention: verification rows computed bit for bit as plain one-token decoding computes them.

Speculative decoding is lossless in exact arithmetic, but a fused attention kernel does not compute a query row the
same way when the call holds one query as when it holds sixteen: the key dimension it reduces over grows by the
tree's masked keys, its blocking follows the call's shape, and a bf16 logit that sits on a rounding tie flips.
Measured on SmolLM2-135M-Instruct in bf16 (2 threads, Intel Xeon): the logits of every row of a 4-16-token
verification differ from one-token decoding (by up to 0.56, several bf16 ulps at logit 26) in both transformers'
``sdpa`` and ``eager`` attention, and 13 of 16 MT-bench answers diverge from plain greedy decoding, every one at
a token within 2 ulps of the top logit. In fp32 the differences are ~3e-5 and the answers happen to agree.

This module is an attention implementation, registered with transformers' public ``AttentionInterface``, whose
result for a query row depends only on the keys that row sees, in their logical order, and not on the other rows of
the call, the masked keys, or where the row's ancestors sit in the cache:

* each row's keys are split into fixed blocks of :data:`KEY_BLOCK` logical positions (a row's position ``j`` is its
  ``j``-th visible key: the committed prefix, then the root-to-row path of the tree);
* whole blocks of the shared prefix are multiplied for every row at once; the row's last, partial blocks (the
  prefix's remainder and its path, gathered into logical order) per row; every product has the same shape per
  row whatever the number of rows (the rows only stack along the batched matmul's M dimension, which these small
  fp32 products compute row-independently: ``tests/eval/test_exact_attention.py`` pins it on the machine it runs
  on);
* the softmax maximum is exact; the exponentials are element-wise; the weighted values and the normaliser (a ones
  column after the values, so one product gives both) are summed within a block over its fixed
  :data:`KEY_BLOCK` entries (masked entries are exact zeros) and across blocks by :func:`pairwise_sum`, a fixed
  tree over block indices, so trailing empty blocks add exact zeros;
* arithmetic is in fp32 whatever the model's dtype (bf16 models get fp32 attention, then the output rounded back).

Plain decoding (the same decoder with no drafter) runs the same function with one row, so a verification row and the
one-token step that plain decoding takes at that position get identical attention outputs. The rest of the forward
is row-wise (norms, rotary embeddings, MLP) apart from the linear layers, whose products must then also compute a
row the same way at 1 and at N rows. oneDNN's bf16 GEMM does on the Intel Xeon (AMX) measured here up to 32 rows
and changes kernels at 33 (a 61-token default EAGLE tree was then not token-identical), so the exact path also
switches the target's linear layers to products of at most as many rows as the machine computes row by row (probed
per shape, the smallest for all: :func:`specgraft.eval.kernels.use_row_exact_linears`): with greedy decoding the
speculative answer is token-identical to plain bf16 decoding by construction, at any tree size. MKL's fp32 GEMM
computes a row differently from 2 rows on (a q_proj row differs by ~1e-6), which no split fixes, so fp32 stays
identical by margin only, as before, and the switch says so in a warning. The prompt's prefill (no row layout
passed) goes through transformers' ``sdpa`` unchanged: plain and speculative decoding prefill the same prompt in the
same call.

That row independence is the BLAS's, not ours: on an AMD EPYC with the same torch/MKL build the batched fp32
products change their summation with the number of rows in the call, so :func:`apply_attention_kernel` probes it
at the model's attention shape (:func:`rows_computed_independently`) and refuses ``exact`` in one line where it
fails, instead of promising bits it cannot deliver.

Cost: some 25 small ops per layer instead of one fused call (measured in the README's bf16 section); selected with
``--attention-kernel exact`` on ``specgraft eval`` / ``tune`` / ``profile``.
"""

from __future__ import annotations

import argparse
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.eval.kv import EXACT_ATTENTION, GQA_ATTENTION, attention_layout, text_config
from specgraft.eval.settings import ATTENTION_KERNELS

logger = logging.getLogger(__name__)

KEY_BLOCK = 16
"""Logical key positions per block. Any fixed size is exact. Each row gathers its own last one or two blocks (the
prefix's remainder, then its path), so the gathered volume grows with the block: 16 timed faster than 32 and 64
for 17-row trees at 200-600 cached positions on the 2-core CPU (``index_select`` dominated at 64)."""


ROWS_KWARG = "specgraft_rows"
"""The keyword the decoder passes a :class:`RowKeys` under; transformers forwards it to every attention call."""


@dataclass(frozen=True)
class RowKeys:
    """Which cached keys each query row of one forward attends to, in logical order.

    The forward appends ``q`` rows after ``past`` cached positions. Row ``i`` sees the whole prefix ``[0, past)``
    and then the rows of its root-to-row path (``past + path[i]``).

    Attributes:
        past: cached positions before this forward.
        shared: ``(past // KEY_BLOCK) * KEY_BLOCK``: keys ``[0, shared)`` are whole blocks every row sees.
        tail_index: [q, T] int64 cache positions of each row's remaining keys (``T`` a multiple of KEY_BLOCK;
            padding points at position 0 and is masked).
        tail_padding: [q, T] bool, True on padding (the mask every layer applies; built once per forward).
    """

    past: int
    shared: int
    tail_index: torch.Tensor
    tail_padding: torch.Tensor


def row_keys(past: int, paths: torch.Tensor, depths: torch.Tensor) -> RowKeys:
    """The :class:`RowKeys` of rows whose root-to-row paths are ``paths`` after ``past`` cached positions.

    Args:
        past: cached positions before the forward.
        paths: [q, D+1] int64 row indices (0 = the first new row) of each row's path, root first; entries past
            ``depths[i]`` are ignored.
        depths: [q] int64 depth of each row (its path has ``depth + 1`` rows).
    """
    if past < 0:
        raise SpecgraftError(f"past length {past} is negative")
    device = paths.device
    shared = (past // KEY_BLOCK) * KEY_BLOCK
    remainder = past - shared  # prefix keys after the last whole block
    width = remainder + paths.shape[1]
    padded = -(-width // KEY_BLOCK) * KEY_BLOCK
    t = torch.arange(padded, device=device)  # [T] logical offset after `shared`
    in_prefix = t < remainder
    step = (t - remainder).clamp(0, paths.shape[1] - 1)  # [T] index into the path
    in_path = (t >= remainder).unsqueeze(0) & ((t - remainder).unsqueeze(0) <= depths.unsqueeze(1))  # [q, T]
    path_rows = paths.index_select(1, step)  # [q, T]
    index = torch.where(in_prefix.unsqueeze(0), shared + t.unsqueeze(0), past + path_rows)
    valid = in_prefix.unsqueeze(0) | in_path
    return RowKeys(past=past, shared=shared, tail_index=torch.where(valid, index, 0), tail_padding=~valid)


def chain_paths(length: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(paths [q, q], depths [q]) of ``length`` rows that form a causal chain (row ``i``'s path is rows ``0..i``)."""
    idx = torch.arange(length, device=device)
    return torch.where(idx.unsqueeze(0) <= idx.unsqueeze(1), idx.unsqueeze(0), 0), idx


def chain_row_keys(past: int, length: int, device: torch.device | str | None = None) -> RowKeys:
    """:func:`row_keys` for ``length`` rows that form a causal chain (row ``i`` sees rows ``0..i``)."""
    return row_keys(past, *chain_paths(length, device))


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
    rows: RowKeys | None = kwargs.pop(ROWS_KWARG, None)
    if rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    if batch != 1 or heads % kv_heads or key.shape[2] != rows.past + q or rows.tail_index.shape[0] != q:
        raise SpecgraftError(f"exact attention got query {tuple(query.shape)} and keys {tuple(key.shape)} for a row "
                             f"layout of {rows.tail_index.shape[0]} rows after {rows.past} positions; it decodes one "
                             "sequence at a time through specgraft's decoder")
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else float(scaling)
    shared, blocks = rows.shared, rows.shared // KEY_BLOCK
    tail = rows.tail_index.shape[1]
    qf = (query[0].float() * scale).view(kv_heads, group, q, dim).transpose(1, 2)  # [KVH, q, G, d]
    kf = key[0].float()  # [KVH, L, d]
    # A ones column after the values: each block's product then also sums its weights (the softmax normaliser),
    # so one matmul and one block sum give both, computed alike.
    vf = torch.nn.functional.pad(value[0].float(), (0, 1), value=1.0)  # [KVH, L, d + 1]
    flat = rows.tail_index.reshape(-1)
    k_tail = kf.index_select(1, flat).view(kv_heads, q, tail, dim)
    v_tail = vf.index_select(1, flat).view(kv_heads, q, tail // KEY_BLOCK, KEY_BLOCK, dim + 1)
    s_tail = torch.matmul(qf, k_tail.transpose(-1, -2))  # [KVH, q, G, T]
    s_tail.masked_fill_(rows.tail_padding.view(1, q, 1, tail), float("-inf"))
    top = s_tail.amax(-1, keepdim=True)  # [KVH, q, G, 1]; every row sees at least itself
    if blocks:
        s_shared = torch.matmul(qf.reshape(kv_heads, q * group, dim), kf[:, :shared].transpose(-1, -2))
        s_shared = s_shared.view(kv_heads, q, group, shared)
        top = torch.maximum(top, s_shared.amax(-1, keepdim=True))
    p_tail = torch.exp(s_tail - top).view(kv_heads, q, group, tail // KEY_BLOCK, KEY_BLOCK)
    # [KVH, q, blocks, G, d + 1]: per block, the G query heads of a row times that block's values (and ones),
    # then blocks first: [KVH, blocks, q, G, d + 1]
    outs = torch.matmul(p_tail.transpose(2, 3), v_tail).transpose(1, 2)
    if blocks:
        p_shared = torch.exp(s_shared - top).view(kv_heads, q * group, blocks, KEY_BLOCK)
        o_shared = torch.matmul(p_shared.transpose(1, 2),
                                vf[:, :shared].view(kv_heads, blocks, KEY_BLOCK, dim + 1))  # [KVH, blocks, q*G, d+1]
        outs = torch.cat([o_shared.view(kv_heads, blocks, q, group, dim + 1), outs], dim=1)
    # Across blocks by a fixed pairwise tree over block indices: trailing all-padding blocks add exact zeros.
    summed = pairwise_sum(outs, dim=1)  # [KVH, q, G, d + 1]
    out = (summed[..., :dim] / summed[..., dim:]).permute(1, 0, 2, 3).reshape(1, q, heads, dim)
    return out.to(query.dtype), None


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``x`` over ``dim`` by a fixed binary tree over the indices, zero-padded to a power of two.

    The grouping of index ``i`` depends on ``i`` alone: appending zeros (a longer padded call) leaves every partial
    sum as it was and adds exact zeros, so the same leading values give the same bits whatever the length. (A
    library reduction may regroup by length, vectorise differently, or cascade.) ``dim`` must count from the start
    or be negative; returns ``x`` with ``dim`` removed.
    """
    dim = dim % x.dim()
    size = x.shape[dim]
    half = (1 << max(size - 1, 0).bit_length()) // 2
    if half and size > half:
        # The first level of the tree over the zero-padded power of two, without materialising the zeros: index
        # i < half adds index i + half where that exists, else an exact zero (nothing).
        first = x.narrow(dim, 0, half).clone()
        first.narrow(dim, 0, size - half).add_(x.narrow(dim, half, size - half))
        x = first
    while x.shape[dim] > 1:
        x = x.narrow(dim, 0, x.shape[dim] // 2) + x.narrow(dim, x.shape[dim] // 2, x.shape[dim] // 2)
    return x.squeeze(dim)


#: Cache lengths the row-independence probe tries, each with a tree and a chain: empty, inside the first key
#: block, on and across a block boundary, and several blocks in (the shared-prefix products).
PROBE_PAST = (0, 1, KEY_BLOCK - 3, KEY_BLOCK, KEY_BLOCK + 1, 3 * KEY_BLOCK - 2, 5 * KEY_BLOCK + 7)
PROBE_TREE = (-1, -1, -1, 1, 1, 4, 2, 5, 7)


@functools.cache
def rows_computed_independently(kv_heads: int, group: int, dim: int, dtype: str, device: str) -> bool:
    """Whether this machine's kernels give every row of an exact-attention call the bits its one-row call gets, at
    this attention shape and dtype: the premise the kernel rests on (its products stack rows along batch and M
    dimensions that the BLAS must treat row by row). True on the Intel Xeon (AMX) it was built on; false on an AMD
    EPYC with the same MKL build, whose batched fp32 products change their summation with the batch count and the
    row count (2026-12-05). Probed once per shape on random inputs: a 9-node tree and a chain at seven cache lengths,
    every row against its one-row call."""
    from specgraft.eval.tree import tree_structure

    gen = torch.Generator().manual_seed(0)
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    module = argparse.Namespace(num_key_value_groups=group, is_causal=True)
    structure = tree_structure(PROBE_TREE)
    q = structure.size + 1
    layouts = ((structure.row_paths(), structure.row_depths()), chain_paths(q))  # a tree, a chain of as many rows
    for past in PROBE_PAST:
        for paths, depths in layouts:
            keys, values = (torch.randn(1, kv_heads, past + q, dim, generator=gen).to(device=device, dtype=torch_dtype)
                            for _ in range(2))
            query = torch.randn(1, kv_heads * group, q, dim, generator=gen).to(device=device, dtype=torch_dtype)
            out, _ = exact_attention_forward(module, query, keys, values, None,
                                             **{ROWS_KWARG: row_keys(past, paths.to(device), depths.to(device))})
            for r in range(q):
                slots = torch.cat([torch.arange(past), past + paths[r, : int(depths[r]) + 1]]).to(device)
                alone, _ = exact_attention_forward(module, query[:, :, r : r + 1], keys[:, :, slots],
                                                   values[:, :, slots], None,
                                                   **{ROWS_KWARG: chain_row_keys(len(slots) - 1, 1, device)})
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


def uses_exact_attention(model: Any) -> bool:
    """True when ``model`` runs :data:`EXACT_ATTENTION` (the decoder then passes row layouts)."""
    return getattr(model.config, "_attn_implementation", None) == EXACT_ATTENTION


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
    from specgraft.eval.gqa_attention import grouped_kv_heads

    on_cpu = next(model.parameters()).device.type == "cpu"
    sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
    return "gqa" if on_cpu and sdpa and grouped_kv_heads(model) else "stock"


def apply_attention_kernel(choice: str, model: Any) -> str:
    """Switch the target ``model`` to the ``--attention-kernel`` ``choice``; returns the kernel it runs."""
    choice = resolve_attention_kernel(choice, model)
    if choice == "stock":
        return choice
    if choice == "gqa":
        from specgraft.eval.gqa_attention import register_gqa_attention

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
    if not rows_computed_independently(kv_heads, heads // kv_heads, dim, str(parameter.dtype),
                                       str(parameter.device)):
        raise SpecgraftError(f"--attention-kernel exact cannot be bit-exact on this machine: its matmul kernels "
                             f"compute a query row differently when other rows share the call (probed at this "
                             f"model's attention shape, {kv_heads} KV heads x {heads // kv_heads} of {dim}, "
                             f"{str(parameter.dtype).removeprefix('torch.')}); use --attention-kernel stock (greedy "
                             "answers then match plain decoding up to rounding, which the eval's lossless check "
                             "reports)")
    register_exact_attention()
    model.set_attn_implementation(EXACT_ATTENTION)
    _use_row_exact_linears(model, str(parameter.dtype).removeprefix("torch."))
    return choice


def _use_row_exact_linears(model: Any, dtype: str) -> None:
    """The rest of the exact path: the target's linear layers split a call into products of as many rows as this
    machine's GEMM computes row by row (:func:`specgraft.eval.kernels.use_row_exact_linears`), and say so."""
    from specgraft.eval.kernels import use_row_exact_linears

    chunk, switched = use_row_exact_linears(model)
    if switched:
        logger.info("exact attention: %d linear layers multiply at most %d rows per product (row-exact up to there "
                    "on this machine in %s)", switched, chunk, dtype)
    else:
        logger.warning("exact attention: the linear layers compute a row differently beside another one in %s on "
                       "this machine (already at 2 rows), so verification matches one-token decoding there up to "
                       "rounding only: greedy answers are identical by margin, which the eval's lossless check "
                       "reports", dtype)
