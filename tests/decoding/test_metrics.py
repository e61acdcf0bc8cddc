"""Metrics and the closed-form simulator against hand computations."""

from __future__ import annotations

import math

import pytest

from specgraft.decoding import metrics
from specgraft.decoding.decoder import GenerationResult


def test_tau_counts_the_bonus_token():
    assert metrics.tau([0, 2, 4, 1]) == pytest.approx((1 + 3 + 5 + 2) / 4)
    assert math.isnan(metrics.tau([]))


def test_acceptance_by_depth():
    assert metrics.acceptance_by_depth([10, 6, 3, 0], [6, 3, 0, 0])[:3] == [0.6, 0.5, 0.0]
    assert math.isnan(metrics.acceptance_by_depth([10, 6, 3, 0], [6, 3, 0, 0])[3])
    with pytest.raises(ValueError):
        metrics.acceptance_by_depth([1], [2])
    assert metrics.add_depth_counts([1, 2], [3, 4, 5]) == [4, 6, 5]


def test_speedup_mean_of_ratios_and_ratio_of_totals():
    base = [(100, 2.0), (50, 0.5)]  # 50 tok/s and 100 tok/s
    spec = [(100, 1.0), (50, 0.5)]  # 100 tok/s and 100 tok/s
    out = metrics.speedup(base, spec)
    assert out["mean_of_ratios"] == pytest.approx((2.0 + 1.0) / 2)
    assert out["ratio_of_totals"] == pytest.approx((150 / 1.5) / (150 / 2.5))
    with pytest.raises(ValueError):
        metrics.speedup(base, spec[:1])


def test_expected_tokens_chain_by_hand():
    # alpha 0.5, gamma 3: 1 + 0.5 + 0.25 + 0.125
    assert metrics.expected_tokens_chain(0.5, 3) == pytest.approx(1.875)
    assert metrics.expected_tokens_chain(1.0, 4) == 5.0
    assert metrics.expected_tokens_chain(0.0, 4) == 1.0
    assert metrics.expected_tokens_chain(0.8, 0) == 1.0
    with pytest.raises(ValueError):
        metrics.expected_tokens_chain(1.2, 3)


def test_expected_tokens_from_depth_profile_matches_chain_and_hand():
    assert metrics.expected_tokens_from_depth_acceptance([0.7] * 5) == pytest.approx(
        metrics.expected_tokens_chain(0.7, 5))
    # 1 + 0.9 + 0.9*0.5 + 0.9*0.5*0.2
    assert metrics.expected_tokens_from_depth_acceptance([0.9, 0.5, 0.2]) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert metrics.expected_tokens_from_depth_acceptance([]) == 1.0


def test_tree_depth_acceptance_by_hand():
    rates = metrics.tree_depth_acceptance([0.5, 0.4], [2, 1])
    assert rates == pytest.approx([0.75, 0.4])
    assert metrics.expected_tokens_from_depth_acceptance(rates) == pytest.approx(1 + 0.75 + 0.3)


def test_simulated_speedup_by_hand():
    # alpha 0.8, gamma 4, c 0.05: E = (1 - 0.8^5) / 0.2 = 3.3616 ; cost = 4 * 0.05 + 1 = 1.2
    assert metrics.chain_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert metrics.simulated_speedup(4.0, 3, 0.5, verify_cost=1.5) == pytest.approx(4.0 / 3.0)
    with pytest.raises(ValueError):
        metrics.simulated_speedup(2.0, 1, 0.1, verify_cost=0.0)


def test_summarize_pools_steps_across_prompts():
    a = GenerationResult(prompt_ids=[1], generated_ids=[5, 6, 7], accepted_lengths=[2, 0],
                         depth_attempted=[2, 1], depth_accepted=[1, 1], alpha_sum=1.5, alpha_count=3,
                         num_target_forwards=3, wall_time_s=1.0)
    b = GenerationResult(prompt_ids=[1], generated_ids=[8], accepted_lengths=[0], depth_attempted=[1],
                         depth_accepted=[0], alpha_sum=0.1, alpha_count=1, num_target_forwards=2, wall_time_s=1.0)
    s = metrics.summarize([a, b])
    assert s["tau"] == pytest.approx((3 + 1 + 1) / 3)
    assert s["depth_attempted"] == [3, 1] and s["depth_accepted"] == [1, 1]
    assert s["acceptance_by_depth"] == pytest.approx([1 / 3, 1.0])
    assert s["alpha_exact"] == pytest.approx(1.6 / 4)
    assert s["new_tokens"] == 4 and s["tokens_per_s"] == pytest.approx(2.0) and s["target_forwards"] == 5
    assert a.tau == pytest.approx(2.0) and a.alpha_exact == pytest.approx(0.5)
    assert a.acceptance_by_depth() == [0.5, 1.0]
