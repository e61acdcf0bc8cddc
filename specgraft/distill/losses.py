"""Distillation divergences between a student (draft) and a teacher (target): pure functions of logits.

Every loss is token-level: at each position it compares the two next-token distributions over the vocabulary, then
averages over the positions where ``mask`` is 1 (all positions when ``mask`` is None). ``temperature`` T divides
both the student's and the teacher's logits before the softmax (the same T on both sides, no T^2 factor).
Arguments are ``(student_logits, teacher_logits, mask)`` with shapes ``[..., V]``, ``[..., V]`` and ``[...]``;
write ``q`` for the student's distribution and ``p`` for the teacher's:

* ``fkl``: forward KL, ``KL(p || q) = sum_x p(x) log(p(x) / q(x))`` (mode covering; the usual KD loss).
* ``rkl``: reverse KL, ``KL(q || p)`` (mode seeking).
* ``jsd``: generalised Jensen-Shannon divergence with ``m = beta p + (1 - beta) q``:
  ``JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m)``. This is TRL GKDTrainer's convention
  (``generalized_jsd_loss``): ``beta = 0.5`` is the symmetric JSD, and the end points are *defined* as the
  limits the interpolation tends to after normalisation, ``beta = 0`` -> forward KL (``JSD_beta / beta ->
  KL(p || q)``) and ``beta = 1`` -> reverse KL (``JSD_beta / (1 - beta) -> KL(q || p)``). (Unnormalised,
  ``JSD_beta`` itself goes to 0 at both ends.)
* ``tvd``: total variation ``TV(p, q) = 1/2 sum_x |p(x) - q(x)|``. A draft token drawn from q is accepted with
  probability ``1 - TV(p, q) = sum_x min(p, q)`` (speculative sampling), so TV is the loss aligned with acceptance.
* ``ce``: cross-entropy of the student on the teacher's top-1 token, ``-log q(argmax p)``: the surrogate for
  greedy decoding, where a draft token is accepted iff it is the target's argmax.

:func:`alpha_exact` is the acceptance proxy tracked during training: the mean over positions of ``sum_x min(p, q)``.
Computations run in float32 whatever the logits' dtype. Every function takes ``num_items``: the count to divide the
positions' sum by instead of their number (the whole batch's, when the logits are one micro-batch of it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specgraft.errors import SpecgraftError
from specgraft.heads.losses import divide_by_count

#: Loss names accepted by :func:`distill_loss` (``distill.loss`` in a recipe).
LOSS_NAMES: tuple[str, ...] = ("fkl", "rkl", "jsd", "tvd", "ce")


def _select(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None,
            temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked positions' logits as [N, V] float32, divided by ``temperature``."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab)
    t = teacher_logits.reshape(-1, vocab)
    if mask is not None:
        if mask.shape != student_logits.shape[:-1]:
            raise ValueError(f"mask {tuple(mask.shape)} does not match logits {tuple(student_logits.shape[:-1])}")
        keep = mask.reshape(-1).bool()
        # Only the loss positions go through the vocab-sized softmaxes (most of a chat batch is prompt/padding).
        s, t = s[keep], t[keep]
    return s.float() / temperature, t.float() / temperature


def _mean(per_position: torch.Tensor, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over positions; 0 (still attached to the graph) when there is none. ``num_items``: divide the sum by
    this count instead (the whole batch's positions, this being one micro-batch of it)."""
    return divide_by_count(per_position.sum(), per_position.shape[0] if num_items is None else num_items)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    # -inf logits (banned tokens) give -inf log-probs; clamp so 0 * log 0 terms are 0, not nan.
    return torch.log_softmax(logits, dim=-1).clamp_min(torch.finfo(torch.float32).min)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probabilities [N, V] -> [N]."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
               temperature: float = 1.0, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over masked positions of ``KL(p || q)`` (p: teacher, q: student, both at ``temperature``)."""
    s, t = _select(student_logits, teacher_logits, mask, temperature)
    return _mean(_kl(_log_softmax(t), _log_softmax(s)), num_items)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
               temperature: float = 1.0, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over masked positions of ``KL(q || p)`` (p: teacher, q: student, both at ``temperature``)."""
    s, t = _select(student_logits, teacher_logits, mask, temperature)
    return _mean(_kl(_log_softmax(s), _log_softmax(t)), num_items)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                    beta: float = 0.5, temperature: float = 1.0,
                    num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over masked positions of ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``.

    TRL GKD's convention: ``beta = 0`` is forward KL ``KL(p || q)`` and ``beta = 1`` reverse KL ``KL(q || p)``
    (the limits of ``JSD_beta / beta`` and ``JSD_beta / (1 - beta)``); see the module docstring.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, mask, temperature, num_items)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, mask, temperature, num_items)
    s, t = _select(student_logits, teacher_logits, mask, temperature)
    log_q, log_p = _log_softmax(s), _log_softmax(t)
    # log m = log(beta p + (1 - beta) q), computed in log space for stability.
    log_m = torch.logsumexp(torch.stack([log_p + torch.log(torch.tensor(beta)),
                                         log_q + torch.log(torch.tensor(1.0 - beta))]), dim=0)
    return _mean(beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m), num_items)


def total_variation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                    temperature: float = 1.0, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over masked positions of ``TV(p, q) = 1/2 sum_x |p(x) - q(x)|`` (= 1 - acceptance probability)."""
    s, t = _select(student_logits, teacher_logits, mask, temperature)
    return _mean(0.5 * (torch.softmax(t, -1) - torch.softmax(s, -1)).abs().sum(-1), num_items)


def top1_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                       temperature: float = 1.0, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over masked positions of ``-log q(argmax p)``: the student's CE on the teacher's greedy token."""
    s, t = _select(student_logits, teacher_logits, mask, temperature)
    top = t.argmax(-1, keepdim=True)  # [N, 1]; temperature does not move the argmax
    return _mean(-torch.log_softmax(s, -1).gather(-1, top).squeeze(-1), num_items)


@torch.no_grad()
def alpha_exact(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None = None,
                temperature: float = 1.0, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean over masked positions of ``sum_x min(p(x), q(x))``: the probability that a token the draft samples
    from q is accepted by the target p (p: target logits, q: draft logits, both at ``temperature``)."""
    q, p = _select(q_logits, p_logits, mask, temperature)
    return _mean(torch.minimum(torch.softmax(p, -1), torch.softmax(q, -1)).sum(-1), num_items)


@torch.no_grad()
def top1_agreement(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None = None,
                   num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Fraction of masked positions where the draft's argmax equals the target's (greedy acceptance)."""
    q, p = _select(q_logits, p_logits, mask, 1.0)
    return _mean((q.argmax(-1) == p.argmax(-1)).float(), num_items)


def distill_loss(name: str, beta: float = 0.5) -> Callable[..., torch.Tensor]:
    """The loss called ``name`` as ``fn(student_logits, teacher_logits, mask, temperature=..., num_items=None)``.

    Raises:
        SpecgraftError: an unknown name.
    """
    if name == "jsd":
        if not 0.0 <= beta <= 1.0:
            raise SpecgraftError(f"distill.beta must be in [0, 1], got {beta}")

        def jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                temperature: float = 1.0, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
            return generalized_jsd(student_logits, teacher_logits, mask, beta=beta, temperature=temperature,
                                   num_items=num_items)

        return jsd
    table = {"fkl": forward_kl, "rkl": reverse_kl, "tvd": total_variation, "ce": top1_cross_entropy}
    if name not in table:
        raise SpecgraftError(f"unknown distillation loss {name!r}; use one of {', '.join(LOSS_NAMES)}")
    return table[name]
