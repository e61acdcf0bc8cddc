"""DFlash's `specgraft tune` search: which chain length, or which per-slot top-k tree, is fastest on this device.

A DFlash step costs ONE draft forward of the whole block whatever the number of slots used (the block always runs
``block_size`` slots; a shorter draft only keeps fewer of them), plus verifying the drafted tokens. So the search
trades acceptance against verification only:

* chains of depth ``D`` in ``1 .. block_size - 1``: ``D + 1`` tokens verified (root counted);
* trees of per-slot top-``k`` below the argmax spine (:meth:`~.drafter.DFlashDrafter._tree`), depth ``D``:
  ``1 + D k`` tokens verified (a 4D tree mask).

Predicted acceptance comes from the per-(depth, rank) statistics of one calibration eval in tree mode at the
widest profiled ``k`` and full depth (:func:`calibration_setting`). ``p[d][r]`` there is the probability that
slot ``d``'s rank-``r`` token is accepted given that the spine reached depth ``d - 1`` (only the spine has
children), and the spine is the same argmax chain at every width, so for greedy decoding

    E[accepted] = sum_{d <= D} (prod_{j < d} p[j][0]) * sum_{r < k} p[d][r]

predicts every narrower tree and every shorter chain (``k = 1``) from that one run; tokens/s is
``(1 + E) / (draft forward + step cost(tokens verified))`` as for the other families
(:mod:`specgraft.tuning.tune`, which turns these hooks' predictions into ranked candidates). The draft forward is
measured by ``specgraft profile`` (:func:`profile_drafter`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from specgraft.decoding.acceptance import calibration_probabilities, tree_value
from specgraft.errors import SpecgraftError
from specgraft.heads.dflash.drafter import DFlashDrafter, drafter_from_setting
from specgraft.heads.dflash.model import DFlashHead
from specgraft.heads.family import Prediction, TuningSearch

if TYPE_CHECKING:  # annotations only: a family uses eval's public protocol, the tuner passes the profile in
    from specgraft.tuning.cost import CostProfile


#: Tree widths (siblings per slot) whose draft forward ``specgraft profile`` measures; the widest is calibrated.
PROFILED_TOP_KS = (2, 3, 4)


def _slots(head: DFlashHead) -> int:
    return int(head.config.block_size) - 1


def default_setting(head: DFlashHead) -> dict[str, Any]:
    """What an untuned ``specgraft eval`` drafts: the chain of every slot (block_size - 1 tokens)."""
    return {"mode": "chain", "depth": _slots(head)}


def calibration_setting(head: DFlashHead) -> dict[str, Any]:
    """The one calibration run that predicts every candidate: the widest profiled tree at full depth."""
    return {"mode": "tree", "top_k": max(PROFILED_TOP_KS), "depth": _slots(head)}


def profile_drafter(head: DFlashHead, timed: Callable[[Any], float]) -> dict[str, Any]:
    """The cost profile's section for a DFlash head: one propose call (the block forward) for the full chain, and
    for each tree width at full depth; ``timed(drafter)`` is the profile's timer (a ratio to its reference
    forward, which the profile scales back to seconds in the ``chain_s`` and ``tree_s`` tables)."""
    slots = _slots(head)
    widths = {1: timed(DFlashDrafter(head, mode="chain"))}
    for k in PROFILED_TOP_KS:
        # A wider tree never drafts faster (the same forward plus a wider top-k): a dip is timing noise.
        widths[k] = max(timed(DFlashDrafter(head, mode="tree", top_k=k)), widths[max(widths)])
    return {"kind": "dflash", "block_size": slots + 1, "chain_s": {str(slots): widths[1]},
            "tree_s": {str(k): widths[k] for k in PROFILED_TOP_KS}}


# -- prediction ----------------------------------------------------------------------------------------------------
def setting_paths(depth: int, top_k: int) -> list[tuple[int, ...]]:
    """The rank paths of a DFlash draft: at each depth ``d`` the top-``k`` tokens of slot ``d``, all children of
    the spine (rank-0 path) of depth ``d - 1``; ``top_k = 1`` is the chain."""
    return [(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(top_k)]


def _section(costs: Mapping[str, Any]) -> tuple[int, float, dict[int, float]]:
    """(slots, chain draft seconds, {top_k: tree draft seconds}) of a profile section (one error line if
    incomplete)."""
    try:
        slots = int(costs["block_size"]) - 1
        chain = float(next(iter(costs["chain_s"].values())))
        trees = {int(k): float(v) for k, v in (costs.get("tree_s") or {}).items()}
    except (KeyError, TypeError, ValueError, StopIteration):
        raise SpecgraftError("the cost profile's dflash drafter lacks block_size/chain_s; re-run `specgraft profile "
                             "--head DIR` with this version") from None
    return slots, chain, trees


def _candidate(setting: dict[str, Any], probs: list[list[float]], profile: CostProfile,
               draft_s: float) -> Prediction:
    depth = int(setting["depth"])
    top_k = int(setting.get("top_k", 1)) if setting.get("mode") == "tree" else 1
    tokens = 1 + depth * top_k
    return {"setting": dict(setting), "expected_accepted": tree_value(setting_paths(depth, top_k), probs),
            "draft_s": draft_s, **profile.step_prediction(tokens, tree=top_k > 1)}


def candidates(profile: CostProfile, costs: Mapping[str, Any], calibration: Mapping[str, Any]) -> list[Prediction]:
    """Every chain depth ``1 .. block_size - 1`` and every profiled tree width at every depth, within the token
    counts the profile measured (unranked: the tuner computes tokens/s and orders them)."""
    slots, chain_s, tree_s = _section(costs)
    probs = calibration_probabilities(calibration)
    widths = [len(row) for row in probs]
    max_chain = max(profile.step_s["chain"])
    max_tree = max(profile.step_s.get("tree") or {0: 0})
    out = [_candidate({"mode": "chain", "depth": d}, probs, profile, chain_s)
           for d in range(1, slots + 1) if d + 1 <= max_chain]
    for k, draft_s in sorted(tree_s.items()):
        if k < 2:
            continue
        for d in range(1, slots + 1):
            # Predict only what the calibration measured: every depth up to d had k siblings to try.
            if 1 + d * k > max_tree or len(widths) < d or min(widths[:d]) < k:
                continue
            out.append(_candidate({"mode": "tree", "top_k": k, "depth": d}, probs, profile, draft_s))
    return out


def predict(setting: Mapping[str, Any], profile: CostProfile, costs: Mapping[str, Any],
            calibration: Mapping[str, Any]) -> Prediction:
    """The prediction for one setting (``depth`` defaults to every slot, as the drafter's does)."""
    slots, chain_s, tree_s = _section(costs)
    full = {"mode": setting.get("mode", "chain"), "depth": int(setting.get("depth") or slots)}
    if full["mode"] == "tree":
        full["top_k"] = int(setting.get("top_k") or 2)
        if full["top_k"] not in tree_s:
            raise SpecgraftError(f"the cost profile has no DFlash tree cost for top-k {full['top_k']} (it has "
                                 f"{sorted(tree_s)}); re-run `specgraft profile` for this head")
        return _candidate(full, calibration_probabilities(calibration), profile, tree_s[full["top_k"]])
    return _candidate(full, calibration_probabilities(calibration), profile, chain_s)


def expected_accepted(setting: Mapping[str, Any], probs: list[list[float]]) -> float:
    """Expected accepted drafts per step of a chain or per-slot top-k tree under ``p[d][r]`` (the trainer's
    simulated tau)."""
    top_k = int(setting.get("top_k") or 2) if setting.get("mode") == "tree" else 1
    return tree_value(setting_paths(int(setting["depth"]), top_k), probs)


def setting_label(setting: Mapping[str, Any]) -> str:
    if setting.get("mode") == "tree":
        depth, top_k = int(setting["depth"]), int(setting["top_k"])
        return f"tree top-{top_k} per slot, depth {depth} ({1 + depth * top_k} tokens)"
    return f"chain of {setting.get('depth', 'block_size - 1')}"


def same_setting(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = ("mode", "depth", "top_k") if a.get("mode") == "tree" else ("mode", "depth")
    return all(a.get(k) == b.get(k) for k in keys)


def is_default_run(report: Mapping[str, Any], head: DFlashHead) -> bool:
    """Whether an eval report was drafted at the untuned setting (the chain of every slot)."""
    drafter = report.get("drafter") or {}
    return drafter.get("mode") == "chain" and drafter.get("k", drafter.get("depth")) == _slots(head)


class DFlashSearch(TuningSearch):
    """DFlash's chains and per-slot top-k trees, calibrated once at the widest profiled tree."""

    kind = "dflash"

    def default_setting(self, source: DFlashHead) -> dict[str, Any]:
        return default_setting(source)

    def calibration_setting(self, source: DFlashHead) -> dict[str, Any]:
        return calibration_setting(source)

    def drafter(self, source: DFlashHead, setting: Mapping[str, Any]) -> Any:
        return drafter_from_setting(source, setting)

    def profile_drafter(self, source: DFlashHead, timed: Callable[[Any], float]) -> dict[str, Any]:
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

    def is_default_run(self, report: Mapping[str, Any], source: DFlashHead) -> bool:
        return is_default_run(report, source)

    def expected_accepted(self, setting: Mapping[str, Any], probs: list[list[float]]) -> float:
        return expected_accepted(setting, probs)


#: The family's search (its ``FAMILY.search``).
SEARCH = DFlashSearch()
