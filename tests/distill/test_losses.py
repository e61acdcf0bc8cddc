"""Distillation losses pinned against explicit Python sums over a small vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from specgraft.distill.losses import (
    LOSS_NAMES,
    alpha_exact,
    distill_loss,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    top1_agreement,
    top1_cross_entropy,
    total_variation,
)
from specgraft.errors import SpecgraftError

V = 5


def _softmax(row: list[float], temperature: float) -> list[float]:
    exps = [math.exp(x / temperature) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def _kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def _reference(name: str, s_row: list[float], t_row: list[float], temperature: float, beta: float = 0.5) -> float:
    q, p = _softmax(s_row, temperature), _softmax(t_row, temperature)
    if name == "fkl":
        return _kl(p, q)
    if name == "rkl":
        return _kl(q, p)
    if name == "jsd":
        m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
        return beta * _kl(p, m) + (1 - beta) * _kl(q, m)
    if name == "tvd":
        return 0.5 * sum(abs(x - y) for x, y in zip(p, q))
    if name == "ce":
        top = max(range(V), key=lambda i: t_row[i])
        return -math.log(q[top])
    if name == "alpha":
        return sum(min(x, y) for x, y in zip(p, q))
    raise AssertionError(name)


def _masked_reference(name, student, teacher, mask, temperature, beta=0.5) -> float:
    values = [_reference(name, s, t, temperature, beta)
              for s, t, m in zip(student.reshape(-1, V).tolist(), teacher.reshape(-1, V).tolist(),
                                 mask.reshape(-1).tolist()) if m]
    return sum(values) / len(values)


@pytest.fixture
def logits():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, V, generator=gen, dtype=torch.float64) * 2
    teacher = torch.randn(2, 3, V, generator=gen, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    return student, teacher, mask


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("name,fn", [("fkl", forward_kl), ("rkl", reverse_kl), ("tvd", total_variation),
                                     ("ce", top1_cross_entropy)])
def test_losses_match_python_sums(logits, name, fn, temperature):
    student, teacher, mask = logits
    got = fn(student, teacher, mask, temperature=temperature)
    assert got.item() == pytest.approx(_masked_reference(name, student, teacher, mask, temperature), rel=1e-5)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_matches_python_sums(logits, beta, temperature):
    student, teacher, mask = logits
    got = generalized_jsd(student, teacher, mask, beta=beta, temperature=temperature)
    want = _masked_reference("jsd", student, teacher, mask, temperature, beta)
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_jsd_edge_betas_follow_trl_convention(logits):
    student, teacher, mask = logits
    fkl = forward_kl(student, teacher, mask).item()
    rkl = reverse_kl(student, teacher, mask).item()
    # The end points ARE forward and reverse KL ...
    assert generalized_jsd(student, teacher, mask, beta=0.0).item() == pytest.approx(fkl, rel=1e-6)
    assert generalized_jsd(student, teacher, mask, beta=1.0).item() == pytest.approx(rkl, rel=1e-6)
    # ... the limits of JSD_beta / beta (beta -> 0) and JSD_beta / (1 - beta) (beta -> 1).
    eps = 1e-4
    assert (generalized_jsd(student, teacher, mask, beta=eps).item() / eps) == pytest.approx(fkl, rel=1e-2)
    assert (generalized_jsd(student, teacher, mask, beta=1 - eps).item() / eps) == pytest.approx(rkl, rel=1e-2)
    # beta = 0.5 is the symmetric Jensen-Shannon divergence.
    assert generalized_jsd(student, teacher, mask, beta=0.5).item() == pytest.approx(
        generalized_jsd(teacher, student, mask, beta=0.5).item(), rel=1e-6)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(student, teacher, mask, beta=1.5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_alpha_exact_is_one_minus_tv(logits, temperature):
    student, teacher, mask = logits
    alpha = alpha_exact(teacher, student, mask, temperature=temperature).item()
    assert alpha == pytest.approx(_masked_reference("alpha", student, teacher, mask, temperature), rel=1e-6)
    tv = total_variation(student, teacher, mask, temperature=temperature).item()
    assert alpha == pytest.approx(1.0 - tv, rel=1e-6)


def test_alpha_exact_of_identical_distributions_is_one(logits):
    student, _, mask = logits
    assert alpha_exact(student, student, mask).item() == pytest.approx(1.0)
    assert forward_kl(student, student, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert top1_agreement(student, student, mask).item() == 1.0


def test_masked_positions_do_not_matter(logits):
    student, teacher, mask = logits
    changed = student.clone()
    changed[0, 1] = torch.tensor([50.0, -50.0, 3.0, 0.0, 1.0], dtype=changed.dtype)  # a masked-out position
    for name in LOSS_NAMES:
        fn = distill_loss(name, beta=0.3)
        assert fn(changed, teacher, mask).item() == pytest.approx(fn(student, teacher, mask).item(), rel=1e-9)


def test_no_mask_means_every_position(logits):
    student, teacher, _ = logits
    ones = torch.ones(2, 3)
    assert total_variation(student, teacher).item() == pytest.approx(total_variation(student, teacher, ones).item())


def test_empty_mask_gives_zero_with_a_graph(logits):
    student, teacher, mask = logits
    student = student.clone().requires_grad_(True)
    loss = forward_kl(student, teacher, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(student.grad) == 0


def test_gradients_flow_to_the_student_only_and_are_finite(logits):
    student, teacher, mask = logits
    student = student.float().requires_grad_(True)
    teacher = teacher.float()
    teacher[0, 0, 3] = float("-inf")  # a banned token: 0 * log 0 must not produce nan
    for name in LOSS_NAMES:
        student.grad = None
        loss = distill_loss(name, beta=0.5)(student, teacher, mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(student.grad).all(), name


def test_bf16_logits_are_computed_in_float32(logits):
    student, teacher, mask = logits
    got = forward_kl(student.bfloat16(), teacher.bfloat16(), mask)
    assert got.dtype == torch.float32
    want = forward_kl(student.bfloat16().float(), teacher.bfloat16().float(), mask)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_minimising_tvd_drives_acceptance_to_one():
    teacher = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0]])
    student = torch.zeros(1, V, requires_grad=True)
    opt = torch.optim.Adam([student], lr=0.05)
    for _ in range(400):
        opt.zero_grad()
        total_variation(student, teacher).backward()
        opt.step()
    assert alpha_exact(teacher, student.detach()).item() > 0.99


def test_unknown_loss_name_is_a_one_line_error():
    with pytest.raises(SpecgraftError, match="unknown distillation loss 'kld'; use one of fkl, rkl, jsd, tvd, ce"):
        distill_loss("kld")
    with pytest.raises(SpecgraftError, match="distill.beta"):
        distill_loss("jsd", beta=2.0)
