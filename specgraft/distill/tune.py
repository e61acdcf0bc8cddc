"""The distilled draft model's `specgraft tune` search: how many tokens a chain drafts.

A draft model drafts chains of ``k`` tokens. Greedy decoding accepts a chain's prefix exactly as far as a longer
chain's would, so one chain calibration at :data:`DRAFT_CALIBRATION_K` gives ``E[accepted] = sum_{d<=k}
reach[d]`` for every shorter chain exactly. A step costs the profile's ``k``-token chain plus catching up on the
expected accepted tokens (:func:`draft_model_cost`). The tuner (:mod:`specgraft.tuning.tune`) ranks, confirms and
records these predictions as it does a head family's; the registry finds this search by :data:`DRAFT_MODEL_KIND`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.heads.family import Prediction, TuningSearch
from specgraft.tuning.search import section_table

#: The drafter type a draft model's report.json names, and the kind of its tuned.json and cost-profile section.
DRAFT_MODEL_KIND = "draft_model"
#: Depth of the chain calibration run of a draft model (every shorter chain is predicted exactly from it).
DRAFT_CALIBRATION_K = 8
#: A draft model's default setting (what `specgraft eval` uses without flags or tuned.json).
DRAFT_MODEL_DEFAULT = {"mode": "chain", "k": 4}


def draft_model_cost(drafter: Mapping[str, Any], k: int, expected_accepted: float) -> float:
    """A draft-model step: the profile's k-token chain (one-token catch-up) plus catching up on the expected
    accepted tokens and the bonus instead of one (when the profile measured catch-up costs)."""
    draft = section_table(drafter, "chain_s")[str(k)]
    catchup = {int(c): float(s) for c, s in (drafter.get("catchup_s") or {}).items()}
    if catchup:
        tokens = min(max(catchup), max(1.0, 1.0 + expected_accepted))
        low = int(tokens)
        high = min(low + 1, max(catchup))
        value = catchup[low] + (catchup[high] - catchup[low]) * (tokens - low)
        draft += value - catchup[1]
    return draft


def _chain(k: int, reach: Sequence[float], profile: Any, costs: Mapping[str, Any]) -> Prediction:
    accepted = float(sum(reach[:k]))
    return {"setting": {"mode": "chain", "k": k}, "expected_accepted": accepted,
            "draft_s": draft_model_cost(costs, k, accepted), **profile.step_prediction(k + 1, tree=False)}


class DraftModelSearch(TuningSearch):
    """Chains of ``k`` draft tokens, predicted exactly from one longer chain's reach rates."""

    kind = DRAFT_MODEL_KIND

    def default_setting(self, source: Any) -> dict[str, Any]:
        return dict(DRAFT_MODEL_DEFAULT)

    def calibration_setting(self, source: Any) -> dict[str, Any]:
        return {"mode": "chain", "k": DRAFT_CALIBRATION_K}

    def drafter(self, source: Any, setting: Mapping[str, Any]) -> Any:
        # Imported here: the registry (and so `specgraft --help`) imports this module, and the drafter loads torch.
        from specgraft.decoding.drafters import DraftModelDrafter

        return DraftModelDrafter(source, k=int(setting["k"]))

    def profile_drafter(self, source: Any, timed: Callable[[Any], float]) -> dict[str, Any]:
        raise SpecgraftError("a draft model's profile section is measured by specgraft.tuning.cost."
                             "measure_draft_model (its catch-up costs need forwards of their own)")

    def candidates(self, profile: Any, costs: Mapping[str, Any], calibration: Mapping[str, Any]) -> list[Prediction]:
        if ((calibration.get("drafter") or {}).get("mode") or "chain") != "chain":
            raise SpecgraftError("tuning a draft model needs a chain calibration run (its reach rates predict every "
                                 "shorter chain); calibrate with --mode chain")
        reach = calibration["reach"]
        chain_s = section_table(costs, "chain_s")
        return [_chain(int(key), reach, profile, costs) for key in sorted(chain_s, key=int)
                if int(key) <= len(reach) and int(key) + 1 <= max(profile.step_s["chain"])]

    def predict(self, setting: Mapping[str, Any], profile: Any, costs: Mapping[str, Any],
                calibration: Mapping[str, Any]) -> Prediction:
        k = int(setting["k"])
        if k > len(calibration["reach"]):
            raise SpecgraftError(f"the calibration chain reached depth {len(calibration['reach'])}; it cannot "
                                 f"predict k={k}")
        return {**_chain(k, calibration["reach"], profile, costs), "setting": dict(setting)}

    def label(self, setting: Mapping[str, Any]) -> str:
        return f"chain of k={setting['k']}"

    def same_setting(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
        return all(a.get(k) == b.get(k) for k in ("mode", "k"))

    def is_default_run(self, report: Mapping[str, Any], source: Any) -> bool:
        drafter = report.get("drafter") or {}
        return drafter.get("mode") == "chain" and drafter.get("k") == DRAFT_MODEL_DEFAULT["k"]

    def setting_from_report(self, drafter: Mapping[str, Any], statistics: Mapping[str, Any] | None, depth: int,
                            mode: str) -> dict[str, Any]:
        return {"mode": "chain", "k": depth}


#: The one instance the registry hands out.
DRAFT_MODEL_SEARCH = DraftModelSearch()
