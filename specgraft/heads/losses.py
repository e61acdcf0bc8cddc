"""Loss functions shared by the head families: pure functions of tensors, pinned by tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty, keeping the graph)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean CE of ``logits`` [..., V] against integer ``labels`` [...] over positions where ``mask`` [...] is 1."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    return masked_mean(ce, mask.flatten())


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of ``-sum_v p(v) log softmax(logits)(v)`` (p: target probabilities)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ce = -(target_probs.float() * logp).sum(-1)
    return masked_mean(ce, mask)


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
