"""Medusa's `specgraft tune` search: which static tree (size, shape, number of heads) is fastest on this device.

A Medusa step costs one call of the ``depth`` heads used (filling every tree node) plus verifying the tree. The
candidates are, for every depth and node count, the optimal static tree of the dynamic program
:func:`~specgraft.decoding.acceptance.optimal_tree` over the per-(depth, rank) acceptance of a calibration eval (the
head's stored top-k accuracies where a cell was never tried: the ``tuning_prior`` hook). The tuner
(:mod:`specgraft.tuning.tune`) turns these predictions into ranked candidates, confirms and records them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from specgraft.decoding.acceptance import calibration_probabilities, optimal_tree, tree_value
from specgraft.errors import SpecgraftError
from specgraft.heads.family import Prediction, TuningSearch
from specgraft.heads.medusa.drafter import (
    build_sparse_tree,
    default_setting,
    drafter_from_setting,
    tuning_prior,
)
from specgraft.tuning.search import max_verified_tokens

if TYPE_CHECKING:  # annotations only: the tuner passes the profile in
    from specgraft.heads.medusa.model import MedusaHead
    from specgraft.tuning.cost import CostProfile


#: Heads (depths) and tree node counts whose call ``specgraft profile`` times; the cost between node counts is
#: interpolated linearly.
PROFILED_MAX_HEADS = 8
PROFILED_NODES = (1, 3, 7, 15, 31, 63)


def profile_drafter(head: MedusaHead, timed: Callable[[Any], float]) -> dict[str, Any]:
    """The cost profile's section: one call runs ``h`` heads and fills (and reports q for) the tree's nodes, so the
    cost goes by heads and nodes; ``timed(drafter)`` is the profile's timer."""
    accuracy = tuning_prior(head)  # the per-head top-k accuracies the untuned tree is built from
    per_call: dict[str, dict[str, float]] = {}
    for h in range(1, min(len(accuracy), PROFILED_MAX_HEADS) + 1):
        per_call[str(h)] = {}
        for nodes in PROFILED_NODES:
            tree = build_sparse_tree(accuracy, nodes, max_depth=h)
            if tree.depth == h and tree.size == nodes:
                per_call[str(h)][str(nodes)] = timed(drafter_from_setting(head, {"paths": tree.paths}))
    return {"kind": "medusa", "num_heads": len(accuracy), "per_call_s": per_call}


def call_cost(per_call: Mapping[str, Any], depth: int, nodes: int) -> float:
    """A Medusa call with ``depth`` heads and ``nodes`` tree nodes, linear in the nodes between measurements."""
    table = per_call.get(str(depth))
    if not isinstance(table, dict) or not table:
        raise SpecgraftError(f"the cost profile has no Medusa cost for {depth} heads; re-run `specgraft profile` "
                             "with this version")
    points = sorted((int(n), float(s)) for n, s in table.items())
    if nodes <= points[0][0]:
        return points[0][1]
    if nodes >= points[-1][0]:
        return points[-1][1]
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if n0 <= nodes <= n1:
            return s0 + (s1 - s0) * (nodes - n0) / (n1 - n0)
    raise AssertionError("unreachable: nodes lies between the measured points")


def is_chain(paths: list[tuple[int, ...]]) -> bool:
    """Whether a static tree is a chain (rank-0 nodes, one per depth): verified with a causal forward."""
    return all(all(r == 0 for r in p) for p in paths) and len({len(p) for p in paths}) == len(paths)


def _prediction(setting: dict[str, Any], paths: list[tuple[int, ...]], value: float, profile: CostProfile,
                per_call: Mapping[str, Any]) -> Prediction:
    depth = max(len(p) for p in paths)
    return {"setting": setting, "expected_accepted": value, "draft_s": call_cost(per_call, depth, len(paths)),
            **profile.step_prediction(len(paths) + 1, tree=not is_chain(paths))}


def candidates(profile: CostProfile, costs: Mapping[str, Any], calibration: Mapping[str, Any]) -> list[Prediction]:
    """Every (depth, size) tree within the token counts the profile measured, each the DP optimum for its size and
    depth (unranked: the tuner computes tokens/s and orders them)."""
    probs = calibration_probabilities(calibration)
    per_call = costs.get("per_call_s") or {}
    limit = max_verified_tokens(profile)
    out = []
    for depth in range(1, len(probs) + 1):
        if str(depth) not in per_call:
            continue
        for nodes in range(1, limit):
            value, paths = optimal_tree(probs, nodes, max_depth=depth)
            if len(paths) < nodes or not paths or max(len(p) for p in paths) < depth:
                continue  # the same tree as a smaller size or depth: already listed
            setting = {"mode": "chain" if is_chain(paths) else "tree", "depth": depth, "tree_size": nodes + 1,
                       "paths": [list(p) for p in paths]}
            out.append(_prediction(setting, paths, value, profile, per_call))
    return out


def predict(setting: Mapping[str, Any], profile: CostProfile, costs: Mapping[str, Any],
            calibration: Mapping[str, Any]) -> Prediction:
    """The prediction for one tree (``setting["paths"]``, e.g. the default's)."""
    if not setting.get("paths"):
        raise SpecgraftError("a Medusa setting to predict needs its tree (paths); use the tuned.json or the "
                             "default setting of the head")
    paths = [tuple(p) for p in setting["paths"]]
    probs = calibration_probabilities(calibration)
    return _prediction(dict(setting), paths, tree_value(paths, probs), profile, costs.get("per_call_s") or {})


def expected_accepted(setting: Mapping[str, Any], probs: list[list[float]]) -> float:
    """Expected accepted drafts per step of a static tree (``setting["paths"]``) under ``p[d][r]`` (the trainer's
    simulated tau)."""
    return tree_value([tuple(p) for p in setting["paths"]], probs)


def setting_label(setting: Mapping[str, Any]) -> str:
    return f"{setting.get('mode')} of {setting.get('tree_size')} tokens, depth {setting.get('depth')}"


def same_setting(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("mode", "tree_size", "depth"))


def is_default_run(report: Mapping[str, Any], head: MedusaHead) -> bool:
    """Whether an eval report was drafted at the untuned tree (its size: the paths are not recorded)."""
    drafter = report.get("drafter") or {}
    return drafter.get("mode") == "tree" and drafter.get("tree_size") == default_setting(head)["tree_size"]


class MedusaSearch(TuningSearch):
    """Medusa's static trees: every depth and node count's optimal tree, the head's top-k accuracies as prior."""

    kind = "medusa"

    def default_setting(self, source: MedusaHead) -> dict[str, Any]:
        return default_setting(source)

    def calibration_label(self, setting: Mapping[str, Any]) -> str:
        return "the default tree"

    def drafter(self, source: MedusaHead, setting: Mapping[str, Any]) -> Any:
        return drafter_from_setting(source, setting)

    def profile_drafter(self, source: MedusaHead, timed: Callable[[Any], float]) -> dict[str, Any]:
        return profile_drafter(source, timed)

    def candidates(self, profile: Any, costs: Mapping[str, Any], calibration: Mapping[str, Any]) -> list[Prediction]:
        return candidates(profile, costs, calibration)

    def predict(self, setting: Mapping[str, Any], profile: Any, costs: Mapping[str, Any],
                calibration: Mapping[str, Any]) -> Prediction:
        return predict(setting, profile, costs, calibration)

    def label(self, setting: Mapping[str, Any]) -> str:
        return setting_label(setting)

    def same_setting(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
        return same_setting(a, b)

    def is_default_run(self, report: Mapping[str, Any], source: MedusaHead) -> bool:
        return is_default_run(report, source)

    def prior(self, source: MedusaHead) -> list[list[float]]:
        return tuning_prior(source)

    def expected_accepted(self, setting: Mapping[str, Any], probs: list[list[float]]) -> float:
        return expected_accepted(setting, probs)

    def setting_from_report(self, drafter: Mapping[str, Any], statistics: Mapping[str, Any] | None, depth: int,
                            mode: str) -> dict[str, Any]:
        """The report's static tree (its paths, recorded in the acceptance statistics) cut to ``depth``."""
        paths = (statistics or {}).get("static_tree_paths")
        if not paths:
            raise SpecgraftError("the report lacks acceptance_statistics.static_tree_paths; re-run `specgraft eval` "
                                 "with this version")
        paths = [p for p in paths if len(p) <= depth]
        return {"mode": mode, "paths": paths, "depth": depth, "tree_size": len(paths) + 1}

    def engine_settings(self, setting: Mapping[str, Any], default_tokens: int) -> dict[str, Any]:
        # No vLLM entry: vLLM's Medusa runs every exported head and needs num_speculative_tokens == num_heads, so a
        # tuned tree only reaches engines that take the tree itself (TensorRT-LLM's medusa_choices).
        choices = [list(p) for p in setting.get("paths") or []]
        return {"trtllm": {"max_draft_len": int(setting["depth"]), "medusa_choices": choices}}


#: The family's search (its ``FAMILY.search``).
SEARCH = MedusaSearch()
