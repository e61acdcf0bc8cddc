"""EAGLE-1/2 and EAGLE-3's `specgraft tune` search: which chain depth or dynamic tree is fastest on this device.

A step drafts ``depth`` sequential draft forwards (a chain: one token each; an EAGLE-2 tree: ``top_k`` children
per expanded node, reranked to ``total_tokens``) and verifies them. Candidates:

* chains of depth ``D``: ``E[accepted] = sum_d prod_{j<=d} p[j][0]``;
* dynamic trees (top-k ``k``, depth ``D``, ``T`` tokens), predicted as the optimal static tree with ranks ``< k``,
  depth ``<= D`` and ``T - 1`` nodes (the dynamic tree picks its nodes by draft confidence, which the static
  optimum approximates), its nodes below depth 1 scaled by :func:`dynamic_tree_scale`: the share of the static
  optimum's deeper acceptance the calibration run's own dynamic tree realised. The optimum is chosen with
  hindsight of every (depth, rank) rate and overstates a dynamic tree; the depth-1 fan is exact and keeps its
  value.

``p[d][r]`` comes from the per-(depth, rank) statistics of a calibration eval at the default tree; the tuner
(:mod:`specgraft.tuning.tune`) ranks, confirms and records the predictions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from specgraft.decoding.acceptance import calibration_probabilities, optimal_tree, tree_value
from specgraft.errors import SpecgraftError
from specgraft.heads.eagle.drafter import EagleDrafter, drafter_from_setting
from specgraft.heads.family import Prediction, TuningSearch
from specgraft.tuning.search import max_verified_tokens, monotone, section_table

if TYPE_CHECKING:  # annotations only: the tuner passes the profile in
    from specgraft.heads.eagle.model import EagleHeadBase
    from specgraft.tuning.cost import CostProfile


#: Draft depths and tree widths whose propose call ``specgraft profile`` times.
PROFILED_DEPTHS = (1, 2, 3, 4, 5, 6)
PROFILED_TOP_KS = (2, 3, 4, 6, 8, 10)


def default_setting(head: EagleHeadBase) -> dict[str, Any]:
    """What an untuned ``specgraft eval`` drafts: :class:`EagleDrafter`'s own defaults (the GPU-sized tree)."""
    params = inspect.signature(EagleDrafter.__init__).parameters
    return {key: params[key].default for key in ("mode", "top_k", "depth", "total_tokens")}


def profile_drafter(head: EagleHeadBase, timed: Callable[[Any], float]) -> dict[str, Any]:
    """The cost profile's section: one propose call per chain depth and per (top-k, depth) tree; ``timed(drafter)``
    is the profile's timer."""
    chain = {d: timed(drafter_from_setting(head, {"mode": "chain", "depth": d})) for d in PROFILED_DEPTHS}
    tree: dict[tuple[int, int], float] = {}
    for k in PROFILED_TOP_KS:
        for d in PROFILED_DEPTHS:
            total = 1 + k * d  # about the nodes an EAGLE-2 tree of this width and depth keeps
            tree[k, d] = timed(drafter_from_setting(head, {"mode": "tree", "top_k": k, "depth": d,
                                                           "total_tokens": total}))
    # Drafting deeper or wider never costs less: smooth timing noise along depth, then along width.
    chain = monotone(chain)
    for k in PROFILED_TOP_KS:
        tree.update({(k, d): v for d, v in monotone({d: tree[k, d] for d in PROFILED_DEPTHS}).items()})
    for d in PROFILED_DEPTHS:
        tree.update({(k, d): v for k, v in monotone({k: tree[k, d] for k in PROFILED_TOP_KS}).items()})
    return {"kind": head.head_type, "chain_s": {str(d): v for d, v in chain.items()},
            "tree_s": {f"{k},{d}": v for (k, d), v in tree.items()}}


def _chain(depth: int, probs: list[list[float]], profile: CostProfile, draft_s: float) -> Prediction:
    value, reach = 1.0, 0.0
    for row in probs[:depth]:
        value *= row[0] if row else 0.0
        reach += value
    return {"setting": {"mode": "chain", "depth": depth}, "expected_accepted": reach, "draft_s": draft_s,
            **profile.step_prediction(depth + 1, tree=False)}


def _static_tree(setting: Mapping[str, Any], probs: list[list[float]]) -> tuple[float, float,
                                                                                 list[tuple[int, ...]]]:
    """(expected accepted drafts, the part of it at depth 1, the paths) of a dynamic tree's static optimum."""
    top_k, depth, total = int(setting["top_k"]), int(setting["depth"]), int(setting["total_tokens"])
    value, paths = optimal_tree(probs, total - 1, max_depth=depth, max_rank=top_k)
    first = sum(probs[0][p[0]] for p in paths if len(p) == 1 and probs and p[0] < len(probs[0]))
    return value, first, paths


def dynamic_tree_scale(probs: list[list[float]], calibration: Mapping[str, Any]) -> float:
    """The share of the static optimum's acceptance below depth 1 that the calibration run's own dynamic tree
    realised: ``(tau - 1 - depth-1 part) / (static value - depth-1 part)`` at its setting, within [0, 1]; 1 when the
    calibration drafted no tree (or recorded no tau) or its static optimum accepts nothing below depth 1."""
    tree, tau = _reported_tree(calibration.get("drafter") or {}), calibration.get("tau")
    if tree is None or not isinstance(tau, (int, float)):
        return 1.0
    value, first, _ = _static_tree(tree, probs)
    if value - first <= 0:
        return 1.0
    return min(1.0, max(0.0, (float(tau) - 1.0 - first) / (value - first)))


def _tree(setting: dict[str, Any], probs: list[list[float]], profile: CostProfile, draft_s: float,
          scale: float) -> tuple[Prediction, list[tuple[int, ...]]]:
    value, first, paths = _static_tree(setting, probs)
    return {"setting": setting, "expected_accepted": first + scale * (value - first), "draft_s": draft_s,
            **profile.step_prediction(int(setting["total_tokens"]), tree=True)}, paths


def candidates(profile: CostProfile, costs: Mapping[str, Any], calibration: Mapping[str, Any]) -> list[Prediction]:
    """Chains by depth and dynamic trees by (top-k, depth, total tokens) within the token counts the profile
    measured (unranked: the tuner computes tokens/s and orders them)."""
    probs = calibration_probabilities(calibration)
    scale = dynamic_tree_scale(probs, calibration)
    chain_s, tree_s = section_table(costs, "chain_s"), section_table(costs, "tree_s")
    limit = max_verified_tokens(profile)
    out = [_chain(d, probs, profile, chain_s[str(d)]) for d in range(1, len(probs) + 1)
           if str(d) in chain_s and d + 1 <= max(profile.step_s["chain"])]
    for key, draft_s in tree_s.items():
        top_k, depth = (int(x) for x in key.split(","))
        if depth > len(probs):
            continue
        for total in sorted(profile.step_s.get("tree") or {}):
            # An EAGLE-2 tree of depth D and width k has at most k + (D - 1) k^2 candidates to keep.
            if total < 3 or total > limit or total - 1 > top_k + (depth - 1) * top_k * top_k:
                continue
            prediction, paths = _tree({"mode": "tree", "top_k": top_k, "depth": depth, "total_tokens": total},
                                      probs, profile, draft_s, scale)
            if paths and max(len(p) for p in paths) >= depth:  # else: the same tree as a shallower setting
                out.append(prediction)
    return out


def predict(setting: Mapping[str, Any], profile: CostProfile, costs: Mapping[str, Any],
            calibration: Mapping[str, Any]) -> Prediction:
    """The prediction for one chain or tree setting (e.g. the default)."""
    probs = calibration_probabilities(calibration)
    depth = int(setting["depth"])
    if setting.get("mode") == "chain":
        return _chain(depth, probs, profile, section_table(costs, "chain_s")[str(depth)])
    key = f"{int(setting['top_k'])},{depth}"
    tree_s = section_table(costs, "tree_s")
    if key not in tree_s:
        raise SpecgraftError(f"the cost profile has no EAGLE tree cost for top-k {setting['top_k']}, depth {depth}; "
                             "re-run `specgraft profile` for this head")
    return _tree(dict(setting), probs, profile, tree_s[key], dynamic_tree_scale(probs, calibration))[0]


def expected_accepted(setting: Mapping[str, Any], probs: list[list[float]]) -> float:
    """Expected accepted drafts per step of a chain or dynamic-tree setting under ``p[d][r]``: the chain's
    top-1 reach, a tree's static optimum (unscaled: no calibration run of a dynamic tree to scale it by). The
    trainer's simulated tau (:mod:`specgraft.train.acceptance_eval`) reads it."""
    if setting.get("mode") == "chain":
        return tree_value([(0,) * d for d in range(1, int(setting["depth"]) + 1)], probs)
    return _static_tree(setting, probs)[0]


def setting_label(setting: Mapping[str, Any]) -> str:
    if setting.get("mode") == "chain":
        return f"chain of depth {setting['depth']}"
    return f"tree top-k {setting['top_k']}, depth {setting['depth']}, {setting['total_tokens']} tokens"


def same_setting(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = ("mode", "depth") if a.get("mode") == "chain" == b.get("mode") else ("mode", "depth", "top_k",
                                                                                 "total_tokens")
    return all(a.get(k) == b.get(k) for k in keys)


def _reported_tree(drafter: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"top_k", "depth", "total_tokens"}`` of the tree an eval report's ``drafter`` section drafted (older
    reports name depth ``k`` and the size ``tree_size``), or None when it drafted no complete tree setting."""
    tree = {"top_k": drafter.get("top_k"), "depth": drafter.get("k", drafter.get("depth")),
            "total_tokens": drafter.get("tree_size", drafter.get("total_tokens"))}
    return tree if drafter.get("mode") == "tree" and None not in tree.values() else None


def is_default_run(report: Mapping[str, Any], head: EagleHeadBase) -> bool:
    """Whether an eval report was drafted at the untuned tree."""
    tree, default = _reported_tree(report.get("drafter") or {}), default_setting(head)
    return tree is not None and all(tree[key] == default[key] for key in tree)


class EagleSearch(TuningSearch):
    """EAGLE-1/2 and EAGLE-3's chains and dynamic trees (one search, one tuned.json kind, for both families)."""

    kind = "eagle"

    def default_setting(self, source: EagleHeadBase) -> dict[str, Any]:
        return default_setting(source)

    def drafter(self, source: EagleHeadBase, setting: Mapping[str, Any]) -> Any:
        return drafter_from_setting(source, setting)

    def profile_drafter(self, source: EagleHeadBase, timed: Callable[[Any], float]) -> dict[str, Any]:
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

    def is_default_run(self, report: Mapping[str, Any], source: EagleHeadBase) -> bool:
        return is_default_run(report, source)

    def expected_accepted(self, setting: Mapping[str, Any], probs: list[list[float]]) -> float:
        return expected_accepted(setting, probs)

    def setting_from_report(self, drafter: Mapping[str, Any], statistics: Mapping[str, Any] | None, depth: int,
                            mode: str) -> dict[str, Any]:
        if mode == "chain":
            return {"mode": "chain", "depth": depth}
        return {"mode": "tree", "depth": depth, "top_k": drafter.get("top_k"), "total_tokens": drafter.get("tree_size")}

    def engine_settings(self, setting: Mapping[str, Any], default_tokens: int) -> dict[str, Any]:
        depth = int(setting["depth"])
        tree = setting.get("mode") == "tree"
        top_k = int(setting["top_k"]) if tree else 1
        tokens = int(setting["total_tokens"]) if tree else depth + 1
        return {"vllm": {"num_speculative_tokens": depth},
                "sglang": {"speculative_num_steps": depth, "speculative_eagle_topk": top_k,
                           "speculative_num_draft_tokens": tokens},
                "trtllm": {"max_draft_len": depth}}


#: The search of the EAGLE and EAGLE-3 families (their ``FAMILY.search``).
SEARCH = EagleSearch()
