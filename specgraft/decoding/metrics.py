"""Speculative-decoding metrics and a closed-form speedup simulator (pure functions).

Conventions (field notes section 5):

* tau, the mean accepted length, is the mean over verification steps of (accepted drafts + 1): the bonus token
  counts, as in the papers' "acceleration rate".
* Acceptance by depth ("n-alpha"): for depth ``d``, ``accepted[d] / attempted[d]`` where ``attempted[d]`` counts the
  steps in which the verifier tested at least one depth-``d`` node (the accepted path reached depth ``d - 1`` and
  the node there had children) and ``accepted[d]`` the steps in which a depth-``d`` node was accepted. It is the
  conditional probability of getting one level deeper, so ``tau = 1 + sum_d prod_{j<=d} rate_j`` holds for a
  fixed-depth draft.
* alpha_exact is the mean over verified positions of the probability that the position's first draft is accepted,
  without the noise of actual draws: ``sum_x min(p(x), q(x))`` for a sampled draft (drawn from q), ``p(token)`` for a
  deterministic one (greedy chains, top-k trees, Medusa: q is a point mass on the drafted token). In greedy mode p is
  one-hot, so alpha is the share of drafts equal to the target's argmax, whatever the drafter.
* Speedup compares tokens/s of speculative and plain decoding of the same target on the same prompts, reported
  both as the mean of per-prompt ratios (Spec-Bench) and as the ratio of totals.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def tau(accepted_lengths: Iterable[int]) -> float:
    """Mean over steps of (accepted drafts + 1); nan when there are no steps."""
    values = [int(a) + 1 for a in accepted_lengths]
    return sum(values) / len(values) if values else float("nan")


def acceptance_by_depth(attempted: Sequence[int], accepted: Sequence[int]) -> list[float]:
    """``accepted[d] / attempted[d]`` per depth (index 0 = depth 1); nan where never attempted."""
    if len(attempted) != len(accepted):
        raise ValueError(f"attempted ({len(attempted)}) and accepted ({len(accepted)}) differ in length")
    out = []
    for t, a in zip(attempted, accepted):
        if a > t:
            raise ValueError(f"accepted {a} exceeds attempted {t}")
        out.append(a / t if t else float("nan"))
    return out


def add_depth_counts(totals: list[int], counts: Sequence[int]) -> list[int]:
    """Element-wise sum of two per-depth count lists of possibly different lengths."""
    out = list(totals) + [0] * max(0, len(counts) - len(totals))
    for i, c in enumerate(counts):
        out[i] += int(c)
    return out


def alpha_exact(alpha_sum: float, alpha_count: int) -> float:
    """Mean per-position acceptance probability (see the module docstring) from its running sum and count; nan
    without positions."""
    return alpha_sum / alpha_count if alpha_count else float("nan")


def tokens_per_second(num_tokens: int, seconds: float) -> float:
    """Throughput; nan for a non-positive duration."""
    return num_tokens / seconds if seconds > 0 else float("nan")


def speedup(baseline: Sequence[tuple[int, float]], speculative: Sequence[tuple[int, float]]) -> dict[str, float]:
    """Wall-clock speedup from per-prompt ``(new tokens, seconds)`` pairs of the same prompts.

    Returns ``{"mean_of_ratios": mean_i (tps_spec_i / tps_base_i), "ratio_of_totals": (sum tokens_spec /
    sum seconds_spec) / (sum tokens_base / sum seconds_base)}``.
    """
    if len(baseline) != len(speculative) or not baseline:
        raise ValueError("speedup needs the same non-zero number of baseline and speculative prompts")
    ratios = [tokens_per_second(*s) / tokens_per_second(*b) for b, s in zip(baseline, speculative)]
    base_total = tokens_per_second(sum(t for t, _ in baseline), sum(s for _, s in baseline))
    spec_total = tokens_per_second(sum(t for t, _ in speculative), sum(s for _, s in speculative))
    return {"mean_of_ratios": sum(ratios) / len(ratios), "ratio_of_totals": spec_total / base_total}


# -- closed-form simulator ---------------------------------------------------------------------------------------
def expected_tokens_chain(alpha: float, gamma: int) -> float:
    """Expected tokens per step of a chain of ``gamma`` drafts, each accepted with probability ``alpha``
    independently: ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (``gamma + 1`` when ``alpha == 1``)."""
    if not 0.0 <= alpha <= 1.0 or gamma < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and gamma >= 0, got alpha={alpha}, gamma={gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_from_depth_acceptance(rates: Sequence[float]) -> float:
    """Expected tokens per step from per-depth conditional acceptance rates (chain or tree):
    ``1 + sum_d prod_{j<=d} rates[j]``."""
    total, reach = 1.0, 1.0
    for r in rates:
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"acceptance rates must be in [0, 1], got {r}")
        reach *= r
        total += reach
    return total


def tree_depth_acceptance(alpha: Sequence[float], branching: Sequence[int]) -> list[float]:
    """Per-depth acceptance of a tree with ``branching[d]`` candidates at depth ``d``, each accepted with
    probability ``alpha[d]`` independently of its siblings: ``1 - (1 - alpha)^b``. (Independence is an
    approximation: real siblings are correlated; measured per-depth rates are better when available.)"""
    if len(alpha) != len(branching):
        raise ValueError("alpha and branching need one entry per depth")
    return [1.0 - (1.0 - a) ** int(b) for a, b in zip(alpha, branching)]


def simulated_speedup(expected_tokens: float, draft_forwards: int, cost_ratio: float,
                      verify_cost: float = 1.0) -> float:
    """Speedup over plain decoding: ``expected_tokens / (draft_forwards * cost_ratio + verify_cost)``.

    ``cost_ratio`` (c) is one draft forward's cost relative to one target forward; ``verify_cost`` is the cost of
    the verification forward relative to a plain decoding step (1 when verifying the tree is as cheap as decoding
    one token, i.e. memory bound)."""
    if draft_forwards < 0 or cost_ratio < 0 or verify_cost <= 0:
        raise ValueError("need draft_forwards >= 0, cost_ratio >= 0 and verify_cost > 0")
    return expected_tokens / (draft_forwards * cost_ratio + verify_cost)


def chain_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """The classic estimate ``(1 - a^(g+1)) / ((1 - a) (g c + 1))`` (Leviathan et al. 2023)."""
    return simulated_speedup(expected_tokens_chain(alpha, gamma), gamma, cost_ratio)


# -- aggregation -------------------------------------------------------------------------------------------------
def summarize(results: Sequence[Any]) -> dict[str, Any]:
    """Pool :class:`specgraft.decoding.decoder.GenerationResult`s of several prompts (steps pooled, not averaged per
    prompt): tau, acceptance by depth, alpha_exact, token and time totals, tokens/s, target forwards."""
    steps = [a for r in results for a in r.accepted_lengths]
    attempted: list[int] = []
    accepted: list[int] = []
    for r in results:
        attempted = add_depth_counts(attempted, r.depth_attempted)
        accepted = add_depth_counts(accepted, r.depth_accepted)
    tokens = sum(r.num_new_tokens for r in results)
    seconds = sum(r.wall_time_s for r in results)
    a_sum = sum(r.alpha_sum for r in results)
    a_cnt = sum(r.alpha_count for r in results)
    return {
        "prompts": len(results),
        "steps": len(steps),
        "new_tokens": tokens,
        "wall_time_s": seconds,
        "tokens_per_s": tokens_per_second(tokens, seconds),
        "tau": tau(steps),
        "acceptance_by_depth": acceptance_by_depth(attempted, accepted),
        "depth_attempted": attempted,
        "depth_accepted": accepted,
        "alpha_exact": alpha_exact(a_sum, a_cnt),
        "target_forwards": sum(r.num_target_forwards for r in results),
        "draft_time_s": sum(r.draft_time_s for r in results),
        "prefill_time_s": sum(r.prefill_time_s for r in results),
        "verify_time_s": sum(r.verify_time_s for r in results),
    }
