"""EAGLE's `specgraft tune` search: dynamic trees predicted from the static optimum, scaled on the calibration."""

from __future__ import annotations

import pytest

from specgraft.heads.eagle.tune import _static_tree, dynamic_tree_scale, predict
from specgraft.tuning.cost import CostProfile

#: p[d][r]: acceptance by depth (row) and sibling rank (column), as a calibration eval records them.
PROBS = [[0.6, 0.2, 0.1, 0.05], [0.7, 0.15, 0.05, 0.02], [0.75, 0.1, 0.05, 0.02]]
COUNTS = (1, 2, 3, 4, 8, 12, 16)


def _profile() -> CostProfile:
    return CostProfile(device="cpu", device_name="test-cpu", dtype="float32", threads=1, torch_version="x",
                       target={"name_or_path": "tiny"}, kv_length=64,
                       step_s={"chain": {n: 1e-3 * (1 + 0.1 * (n - 1)) for n in COUNTS},
                               "tree": {n: 1e-3 * (1 + 0.15 * (n - 1)) for n in COUNTS if n >= 3}},
                       forward_s={n: 1e-3 for n in COUNTS}, drafters={})


def _calibration(drafter: dict, tau: float | None) -> dict:
    attempts = [[1000] * len(row) for row in PROBS]
    accepts = [[round(1000 * p) for p in row] for row in PROBS]
    return {"statistics": {"rank_attempts": attempts, "rank_accepts": accepts}, "drafter": drafter, "tau": tau}


COSTS = {"chain_s": {str(d): 3e-4 * d for d in (1, 2, 3)},
         "tree_s": {f"{k},{d}": 4e-4 * d for k in (2, 4) for d in (1, 2, 3)}}


def test_the_calibration_tree_is_predicted_at_its_measured_tau_and_fans_and_chains_are_untouched():
    tree = {"mode": "tree", "top_k": 4, "depth": 3, "total_tokens": 12}
    value, first, paths = _static_tree(tree, PROBS)
    # 11 nodes: the optimum keeps depth-1 ranks 0-2 (rank 3's 0.05 buys less than deeper nodes) and 8 deeper ones
    assert sorted(p for p in paths if len(p) == 1) == [(0,), (1,), (2,)] and len(paths) == 11
    assert first == pytest.approx(0.9) and value > first
    measured_tau = 1 + first + 0.6 * (value - first)  # the dynamic tree realised 60% of the deeper static value
    calibration = _calibration({**tree, "setting_source": "calibration"}, measured_tau)
    assert dynamic_tree_scale(PROBS, calibration) == pytest.approx(0.6, abs=1e-3)
    profile = _profile()
    at_calibration = predict(tree, profile, COSTS, calibration)
    assert 1 + at_calibration["expected_accepted"] == pytest.approx(measured_tau, abs=1e-3)
    # A depth-1 fan has nothing below depth 1 to scale: its exact rank sum, whatever the calibration measured.
    fan = {"mode": "tree", "top_k": 4, "depth": 1, "total_tokens": 4}
    assert predict(fan, profile, COSTS, calibration)["expected_accepted"] == pytest.approx(sum(PROBS[0][:3]),
                                                                                            abs=1e-3)
    # Chains are the product of the rank-0 rates, untouched by the tree scale.
    chain = predict({"mode": "chain", "depth": 2}, profile, COSTS, calibration)
    assert chain["expected_accepted"] == pytest.approx(0.6 + 0.6 * 0.7, abs=1e-3)
    # Not scaled: a chain calibration, a report without tau, or a tree that did better than its static optimum.
    assert dynamic_tree_scale(PROBS, _calibration({"mode": "chain", "depth": 3}, 2.5)) == 1.0
    assert dynamic_tree_scale(PROBS, _calibration(tree, None)) == 1.0
    assert dynamic_tree_scale(PROBS, _calibration(tree, 1 + value + 0.5)) == 1.0
    assert dynamic_tree_scale(PROBS, _calibration(tree, 1.0)) == 0.0  # accepted nothing: no deeper credit
