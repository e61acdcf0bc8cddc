"""Loss functions shared by the head families: pure functions of tensors, pinned by tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

#: ``term -> number of loss items`` of the whole optimiser step (all micro-batches of all processes), as the trainer
#: passes it to a loss (TRL's ``num_items_in_batch``, one count per term normalised over its own mask).
ItemCounts = Mapping[str, torch.Tensor]


def divide_by_count(total: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """``total / count``, an empty count dividing by 1 (the term is then 0, keeping the graph)."""
    return total / torch.as_tensor(count, device=total.device).to(total.dtype).clamp_min(1.0)


def item_mean(total: torch.Tensor, local_count: torch.Tensor | int, num_items: ItemCounts | None,
              term: str) -> torch.Tensor:
    """``total`` (a sum over this micro-batch's items of loss term ``term``) divided by the term's item count.

    Without ``num_items`` that is this micro-batch's own count ``local_count`` (a per-micro-batch mean); with it,
    the global count ``num_items[term]``, so that summing the results over the micro-batches of all processes gives
    the token mean of the whole batch.
    """
    return divide_by_count(total, local_count if num_items is None else num_items[term])


def masked_mean(values: torch.Tensor, mask: torch.Tensor, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty, keeping the graph): the masked sum divided
    by ``mask.sum()``, or by ``num_items`` when given (the whole batch's count, this being one micro-batch of it)."""
    mask = mask.to(values.dtype)
    return divide_by_count((values * mask).sum(), mask.sum() if num_items is None else num_items)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                         num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean CE of ``logits`` [..., V] against integer ``labels`` [...] over positions where ``mask`` [...] is 1
    (divided by ``num_items`` instead of the mask's sum when given, see :func:`masked_mean`)."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    return masked_mean(ce, mask.flatten(), num_items)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor,
                       num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over masked positions of ``-sum_v p(v) log softmax(logits)(v)`` (p: target probabilities; divided by
    ``num_items`` instead of the mask's sum when given, see :func:`masked_mean`)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ce = -(target_probs.float() * logp).sum(-1)
    return masked_mean(ce, mask, num_items)


def topk_distillation(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor, k: int,
                      num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """HASS's harmonized objective distillation: the mean over masked positions of
    ``-sum_{v in topK(p)} p(v) log softmax(logits)(v)``.

    ``topK(p)`` are the ``k`` most likely tokens of the target distribution ``target_probs`` [..., V] (clipped to
    V); p is NOT renormalised over them and the log-softmax is over the whole vocabulary of ``logits`` [..., V], as
    in the HASS reference, so the term is the part of the soft cross-entropy on the target's likeliest tokens
    (gradient only through ``logits``; divided by ``num_items`` instead of the mask's sum when given).
    """
    probs = target_probs.float()
    top = probs.topk(min(int(k), probs.shape[-1]), dim=-1).indices  # [..., k]
    logp = torch.log_softmax(logits.float(), dim=-1)
    ce = -(probs.gather(-1, top) * logp.gather(-1, top)).sum(-1)
    return masked_mean(ce, mask, num_items)


@torch.no_grad()
def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Fraction of masked positions whose label is among the top-``k`` logits."""
    k = min(k, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices  # [..., k]
    hit = (top == labels.unsqueeze(-1)).any(-1).float()
    return masked_mean(hit, mask)


def decayed_sum(losses: Sequence[torch.Tensor], decay: float, what: str) -> torch.Tensor:
    """``sum_k decay**k * losses[k]``, accumulated in order: the per-head (Medusa) and per-step (EAGLE-3) weighting.

    ``what`` names the caller in the error raised for an empty list.
    """
    if not losses:
        raise ValueError(f"{what} needs at least one loss term")
    total = None
    for k, loss in enumerate(losses):
        term = (decay ** k) * loss
        total = term if total is None else total + term
    return total


#: Elements (rows x vocabulary) of the fp32 logits one chunk of :func:`linear_cross_entropy` materialises: 2**23
#: is 32 MiB, e.g. 256 rows of a 32k draft vocabulary, large enough that the chunk's matmuls stay efficient.
LOGITS_CHUNK_ELEMENTS = 1 << 23


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
    target_rows: torch.Tensor | None = None,
    target_columns: torch.Tensor | None = None,
    with_rank: bool = False,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross-entropy of ``logits = hidden @ weight.T + bias`` without holding [N, V] fp32 logits.

    The logits are computed ``chunk_elements // V`` rows at a time, and each chunk's gradients (w.r.t. ``hidden``,
    ``weight`` and ``bias``) are computed right there in the forward, so nothing vocabulary-sized outlives its chunk
    and the backward only scales the stored gradients. Equal (to float rounding) to the plain
    ``F.cross_entropy(logits, labels, reduction="sum")`` or ``-(p * log_softmax(logits)).sum()``.

    Args:
        hidden: [N, h] rows to project (gradients flow to it).
        weight: [V, h] the projection (an lm_head's weight); bias: [V] or None.
        labels: [N] target ids (hard cross-entropy); exactly one of ``labels`` and ``target_logits``.
        target_logits: [M, V'] logits of the target distribution (soft cross-entropy, no gradient): row
            ``target_rows[n]`` (default n) holds row n's, restricted to the columns ``target_columns`` [V] (default
            all) and renormalised, i.e. ``p = softmax(target_logits[target_rows][:, target_columns])``.
        with_rank: also return, per row, how many logits are strictly greater than the logit of the label (hard) or
            of the target's top-1 (soft): 0 means a top-1 hit (no gradient; costs one comparison per chunk).
        chunk_elements: the rows x V budget of one chunk (default :data:`LOGITS_CHUNK_ELEMENTS`).

    Returns:
        (the scalar fp32 loss sum, the [N] int32 ranks or None).
    """
    if (labels is None) == (target_logits is None):
        raise ValueError("linear_cross_entropy needs exactly one of labels and target_logits")
    total, _, rank = _linear_losses(hidden, weight, bias, labels, target_logits, target_rows, target_columns,
                                    0, 0.0, with_rank, chunk_elements)
    return total, rank


def linear_topk_distillation(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    target_logits: torch.Tensor,
    topk: int,
    topk_weight: float,
    target_rows: torch.Tensor | None = None,
    target_columns: torch.Tensor | None = None,
    with_rank: bool = False,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`linear_cross_entropy` (soft targets) plus ``topk_weight`` times HASS's top-K distillation term, in
    the same chunks (one projection, nothing [N, V] kept).

    With ``p = softmax(target_logits[target_rows][:, target_columns])`` and ``q = softmax(hidden @ weight.T +
    bias)`` per row, the differentiable sum is ``sum_rows [-sum_v p_v log q_v + topk_weight * -sum_{v in topK(p)}
    p_v log q_v]``: the second term is :func:`topk_distillation`'s (p not renormalised over its top ``topk``).

    Returns:
        (the scalar fp32 sum of both terms, the scalar top-K term's sum alone (no gradient; for metrics), the [N]
        int32 ranks or None).
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"linear_topk_distillation needs topk >= 1, got {topk!r}")
    total, topk_sum, rank = _linear_losses(hidden, weight, bias, None, target_logits, target_rows, target_columns,
                                           topk, float(topk_weight), with_rank, chunk_elements)
    return total, topk_sum.detach(), rank


def _linear_losses(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   labels: torch.Tensor | None, target_logits: torch.Tensor | None,
                   target_rows: torch.Tensor | None, target_columns: torch.Tensor | None, topk: int,
                   topk_weight: float, with_rank: bool, chunk_elements: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What :func:`linear_cross_entropy` and :func:`linear_topk_distillation` share (see them)."""
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias))
    budget = LOGITS_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    rows_per_chunk = max(1, budget // max(weight.shape[0], 1))
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, target_logits, target_rows, target_columns,
                                     topk, topk_weight, with_rank, rows_per_chunk, needs)


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked projection + cross-entropy (+ an optional weighted top-K term) with the gradients computed in the
    forward (see linear_cross_entropy and linear_topk_distillation)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor | None, target_logits: torch.Tensor | None, target_rows: torch.Tensor | None,
                target_columns: torch.Tensor | None, topk: int, topk_weight: float, with_rank: bool,
                rows_per_chunk: int, needs: tuple[bool, bool, bool]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        need_hidden, need_weight, need_bias = needs
        num_rows = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        topk_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rank = torch.empty(num_rows, dtype=torch.int32, device=hidden.device) if with_rank else None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        for start in range(0, num_rows, rows_per_chunk):
            end = min(start + rows_per_chunk, num_rows)
            x = hidden[start:end]  # [n, h]
            logits = F.linear(x, weight, bias).float()  # [n, V]
            draft_probs = torch.softmax(logits, dim=-1)  # [n, V]
            # log-sum-exp from the row maximum, whose probability (>= 1/V) cannot underflow: one exponential pass
            # over [n, V] instead of log_softmax's and then exp's
            lse = logits.amax(-1) - draft_probs.amax(-1).log()  # [n]
            if labels is not None:
                ref = labels[start:end]  # [n]
                total += (lse - logits.gather(-1, ref.unsqueeze(-1)).squeeze(-1)).sum()
                probs = None
            else:
                rows = target_logits[start:end] if target_rows is None else target_logits[target_rows[start:end]]
                if target_columns is not None:
                    rows = rows.index_select(-1, target_columns)
                probs = torch.softmax(rows.float(), dim=-1)  # [n, V]
                # -sum_v p_v (z_v - lse), row by row
                total += (lse * probs.sum(-1) - (probs * logits).sum(-1)).sum()
                ref = probs.argmax(-1) if rank is not None else None  # [n]: the target's top-1
                if topk:
                    top = probs.topk(min(topk, probs.shape[-1]), dim=-1).indices  # [n, k]
                    top_probs = probs.gather(-1, top)  # [n, k]
                    topk_total += -(top_probs * (logits.gather(-1, top) - lse.unsqueeze(-1))).sum()
            if rank is not None:
                rank[start:end] = (logits > logits.gather(-1, ref.unsqueeze(-1))).sum(-1, dtype=torch.int32)
            if not (need_hidden or need_weight or need_bias):
                continue
            # d/dlogits of -sum_v p_v log softmax(z)_v is softmax(z) * sum(p) - p = softmax(z) - p, p being a
            # distribution (hard labels: p one-hot). The top-K term sums over S = topK(p) only:
            # softmax(z) * p(S) - p restricted to S, added with its weight w.
            grad_logits = draft_probs  # [n, V], updated in place
            if probs is None:
                grad_logits.scatter_add_(-1, ref.unsqueeze(-1), grad_logits.new_full((end - start, 1), -1.0))
            else:
                if topk:
                    grad_logits.mul_(1.0 + topk_weight * top_probs.sum(-1, keepdim=True))
                    grad_logits.scatter_add_(-1, top, -topk_weight * top_probs)
                grad_logits.sub_(probs)
            grad_logits = grad_logits.to(weight.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight.to(grad_logits.dtype)
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), x.to(grad_logits.dtype))
            if need_bias:
                grad_bias += grad_logits.sum(0)
        if topk:
            total += topk_weight * topk_total
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(topk_total)
        if rank is not None:
            ctx.mark_non_differentiable(rank)
        return total, topk_total, rank

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_topk: Any, _grad_rank: Any
                 ) -> tuple[torch.Tensor | None, ...]:
        stored = ctx.saved_tensors
        grads = [None if g is None else (g * grad_total).to(dtype) for g, dtype in zip(stored, ctx.dtypes)]
        return (*grads, None, None, None, None, None, None, None, None, None)
