"""The chunked projection + cross-entropy equals the plain one, value and gradients, whatever the chunking; HASS's
top-K distillation equals its hand formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specgraft.heads.losses import linear_cross_entropy, linear_topk_distillation, topk_distillation

ROWS, HIDDEN, VOCAB, TARGET_ROWS, TARGET_VOCAB = 37, 8, 50, 60, 80


def _inputs(bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, requires_grad=True)
    b = torch.randn(VOCAB, generator=g, requires_grad=True) if bias else None
    return hidden, weight, b


def _rank(logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (logits > logits.gather(-1, ref.unsqueeze(-1))).sum(-1).to(torch.int32)


# One chunk holding every row, 3 rows per chunk (13 chunks, the last one short), and one row per chunk.
CHUNKINGS = [1 << 23, 3 * VOCAB, 1]


@pytest.mark.parametrize("chunk_elements", CHUNKINGS)
@pytest.mark.parametrize("bias", [False, True])
def test_hard_labels_equal_plain_cross_entropy_and_its_gradients(chunk_elements, bias):
    hidden, weight, b = _inputs(bias)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(1))
    params = [t for t in (hidden, weight, b) if t is not None]
    got, rank = linear_cross_entropy(hidden, weight, b, labels=labels, with_rank=True, chunk_elements=chunk_elements)
    got_grads = torch.autograd.grad(2.5 * got, params)  # a non-unit upstream gradient scales the stored ones
    logits = F.linear(hidden, weight, b)
    ref = F.cross_entropy(logits, labels, reduction="sum")
    ref_grads = torch.autograd.grad(2.5 * ref, params)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert torch.equal(rank, _rank(logits.detach(), labels))


@pytest.mark.parametrize("logit_scale", [30.0, 1000.0])
def test_far_apart_logits_keep_a_finite_exact_loss(logit_scale):
    # At these scales most probabilities underflow to 0 in fp32 (log p would be -inf); the label's loss must still
    # be lse - z[label], finite and equal to the plain cross-entropy, for hard and soft targets.
    hidden, weight, _ = _inputs(False)
    hidden = (hidden.detach() * logit_scale).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(1))
    logits = F.linear(hidden, weight)
    got, _ = linear_cross_entropy(hidden, weight, labels=labels)
    torch.testing.assert_close(got, F.cross_entropy(logits, labels, reduction="sum"), rtol=1e-6, atol=1e-3)
    target_logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(2)) * logit_scale
    soft, _ = linear_cross_entropy(hidden, weight, target_logits=target_logits)
    ref = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum()
    assert torch.isfinite(got) and torch.isfinite(soft)
    torch.testing.assert_close(soft, ref, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("chunk_elements", CHUNKINGS)
def test_soft_targets_on_selected_rows_and_columns_equal_the_plain_soft_cross_entropy(chunk_elements):
    hidden, weight, _ = _inputs(False)
    g = torch.Generator().manual_seed(2)
    target_logits = torch.randn(TARGET_ROWS, TARGET_VOCAB, generator=g)
    rows = torch.randint(0, TARGET_ROWS, (ROWS,), generator=g)
    columns = torch.randperm(TARGET_VOCAB, generator=g)[:VOCAB]
    got, rank = linear_cross_entropy(hidden, weight, target_logits=target_logits, target_rows=rows,
                                     target_columns=columns, with_rank=True, chunk_elements=chunk_elements)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    probs = torch.softmax(target_logits[rows][:, columns], dim=-1)  # [N, V] the restricted target distribution
    logits = F.linear(hidden, weight)
    ref = -(probs * torch.log_softmax(logits, dim=-1)).sum()
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    for g_, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g_, r, rtol=1e-5, atol=1e-5)
    assert torch.equal(rank, _rank(logits.detach(), probs.argmax(-1)))


def test_soft_targets_default_to_all_rows_and_columns():
    hidden, weight, _ = _inputs(False)
    target_logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(3))
    got, rank = linear_cross_entropy(hidden, weight, target_logits=target_logits, chunk_elements=2 * VOCAB)
    ref = -(torch.softmax(target_logits, -1) * torch.log_softmax(F.linear(hidden, weight), -1)).sum()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    assert rank is None


def test_no_gradient_work_without_grad_and_empty_rows_give_zero():
    hidden, weight, _ = _inputs(False)
    labels = torch.zeros(ROWS, dtype=torch.long)
    with torch.no_grad():
        loss, _ = linear_cross_entropy(hidden, weight, labels=labels)
    assert not loss.requires_grad
    empty, rank = linear_cross_entropy(hidden[:0], weight, labels=labels[:0], with_rank=True)
    assert empty.item() == 0.0 and rank.shape == (0,)
    (grad_weight,) = torch.autograd.grad(empty, (weight,))
    assert torch.count_nonzero(grad_weight) == 0


def test_needs_exactly_one_kind_of_target():
    hidden, weight, _ = _inputs(False)
    with pytest.raises(ValueError, match="exactly one"):
        linear_cross_entropy(hidden, weight)
    with pytest.raises(ValueError, match="exactly one"):
        linear_cross_entropy(hidden, weight, labels=torch.zeros(ROWS, dtype=torch.long),
                             target_logits=torch.zeros(ROWS, VOCAB))


def test_topk_distillation_equals_the_hand_formula_and_its_gradient():
    """-sum over the target's K likeliest tokens of p log q, p NOT renormalised over them and q the softmax over
    the whole vocabulary (HASS's train/main_hass.py), averaged over the masked rows or divided by num_items."""
    g = torch.Generator().manual_seed(4)
    batch, length, vocab, k = 3, 5, 11, 4
    logits = torch.randn(batch, length, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(batch, length, vocab, generator=g, dtype=torch.float64) * 2, -1)
    mask = (torch.rand(batch, length, generator=g) > 0.3).float()
    got = topk_distillation(logits, probs, mask, k)
    (got_grad,) = torch.autograd.grad(got, (logits,))
    count = int(mask.sum())
    ref, ref_grad = 0.0, torch.zeros(batch, length, vocab, dtype=torch.float64)
    for b in range(batch):
        for i in range(length):
            if not mask[b, i]:
                continue
            p, z = probs[b, i].tolist(), logits[b, i].detach().tolist()
            top = sorted(range(vocab), key=lambda v: -p[v])[:k]
            log_norm = math.log(sum(math.exp(x) for x in z))
            ref += -sum(p[v] * (z[v] - log_norm) for v in top) / count
            # d/dz_u of -sum_{v in S} p_v (z_v - logsumexp z) = softmax(z)_u * p(S) - p_u [u in S]
            p_top = sum(p[v] for v in top)
            for u in range(vocab):
                ref_grad[b, i, u] = (math.exp(z[u] - log_norm) * p_top - (p[u] if u in top else 0.0)) / count
    assert got.item() == pytest.approx(ref, rel=1e-5)
    torch.testing.assert_close(got_grad.float(), ref_grad.float(), rtol=1e-5, atol=1e-7)
    # K >= V is the whole soft cross-entropy; num_items replaces the row count.
    full = topk_distillation(logits.detach(), probs, mask, vocab + 3, num_items=7)
    plain = -(probs * torch.log_softmax(logits.detach(), -1)).sum(-1)
    assert full.item() == pytest.approx(float((plain * mask).sum()) / 7, rel=1e-6)


@pytest.mark.parametrize("chunk_elements", CHUNKINGS)
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_topk_distillation_equals_the_plain_losses_and_their_gradients(chunk_elements, bias):
    hidden, weight, b = _inputs(bias)
    g = torch.Generator().manual_seed(5)
    target_logits = torch.randn(TARGET_ROWS, TARGET_VOCAB, generator=g) * 2
    rows = torch.randint(0, TARGET_ROWS, (ROWS,), generator=g)
    columns = torch.randperm(TARGET_VOCAB, generator=g)[:VOCAB]
    params = [t for t in (hidden, weight, b) if t is not None]
    total, topk_sum, rank = linear_topk_distillation(
        hidden, weight, b, target_logits=target_logits, topk=10, topk_weight=0.7, target_rows=rows,
        target_columns=columns, with_rank=True, chunk_elements=chunk_elements)
    assert not topk_sum.requires_grad
    got_grads = torch.autograd.grad(1.5 * total, params)
    probs = torch.softmax(target_logits[rows][:, columns], dim=-1)  # [N, V] the restricted target distribution
    logits = F.linear(hidden, weight, b)
    ones = torch.ones(ROWS)
    ref_topk = topk_distillation(logits, probs, ones, 10, num_items=1)  # a sum over the rows
    ref = -(probs * torch.log_softmax(logits, dim=-1)).sum() + 0.7 * ref_topk
    ref_grads = torch.autograd.grad(1.5 * ref, params)
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(topk_sum, ref_topk.detach(), rtol=1e-6, atol=1e-5)
    for got_grad, ref_grad in zip(got_grads, ref_grads):
        torch.testing.assert_close(got_grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(rank, _rank(logits.detach(), probs.argmax(-1)))
    # Weight 0 is the plain soft cross-entropy.
    zero, _, _ = linear_topk_distillation(hidden, weight, b, target_logits=target_logits, topk=10, topk_weight=0.0,
                                          target_rows=rows, target_columns=columns)
    plain, _ = linear_cross_entropy(hidden, weight, b, target_logits=target_logits, target_rows=rows,
                                    target_columns=columns)
    torch.testing.assert_close(zero, plain, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="topk >= 1"):
        linear_topk_distillation(hidden, weight, target_logits=target_logits, topk=0, topk_weight=1.0)
