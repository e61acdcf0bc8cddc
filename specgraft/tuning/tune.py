"""Choose the speculation setting that is fastest on this device, and prove it with a measured run.

``specgraft tune --target PATH (--head DIR | --draft DIR) --prompts FILE... [--cost-profile FILE]
[--calibration REPORT]`` predicts, for every candidate setting,

    tokens/s = E[accepted + 1] / (draft cost + step cost(N tokens verified))

from a device cost profile (:mod:`specgraft.tuning.cost`; measured now when none is given) and the acceptance
statistics of a calibration eval (:mod:`specgraft.decoding.acceptance`; run now at the default setting when none is
given), picks the best, runs a confirming eval at the chosen and the default settings on the calibration prompts,
and writes ``tuned.json`` beside the head (``specgraft eval`` then uses it unless a setting flag is given).

Candidates and their predicted acceptance come from a :class:`~specgraft.heads.family.TuningSearch`, found by its
tuned.json kind in the registry (:func:`~specgraft.heads.registry.tuning_search`): each head family's own
(``specgraft/heads/<family>/tune.py``: Medusa's static trees, EAGLE / EAGLE-3's chains and dynamic trees,
DFlash's chains and per-slot trees) and the distilled draft model's chains (:mod:`specgraft.distill.tune`). This
module ranks, confirms and records them all alike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specgraft.decoding.acceptance import reach_rates
from specgraft.distill.tune import (  # noqa: F401 (re-exported)
    DRAFT_CALIBRATION_K,
    DRAFT_MODEL_DEFAULT,
    DRAFT_MODEL_KIND,
    DRAFT_MODEL_SEARCH,
    draft_model_cost,
)
from specgraft.errors import SpecgraftError
from specgraft.evaluation.report import run_eval
from specgraft.evaluation.report_reader import (  # noqa: F401 (re-exported: the tuned.json reader lives there)
    PLAIN_SETTING,
    TUNED_NAME,
    check_report_for_head,
    drafter_info,
    is_plain,
    read_report,
    read_tuned,
)
from specgraft.heads.family import TuningSearch
from specgraft.heads.registry import search_for_drafter, tuning_search
from specgraft.kernels.exact_attention import attention_kernel_of
from specgraft.tuning.cost import CostProfile, check_profile
from specgraft.tuning.settings import DEFAULT_MIN_SPEEDUP

logger = logging.getLogger(__name__)

TUNED_VERSION = 1
#: Candidates listed in tuned.json and printed.
TOP_CANDIDATES = 8
#: A predicted best whose confirming eval measures a speedup more than this fraction below its prediction gets a
#: second opinion: the best candidate of the other verification shape (chain vs tree) is confirmed too (see
#: :func:`second_opinion`). Chains and trees are predicted by different parts of the model (EAGLE's dynamic trees
#: as optimal static trees, for one), so one shape's miss says little about the other's.
SECOND_OPINION_SHORTFALL = 0.15
#: Fields a calibration report must have.
CALIBRATION_FIELDS = ("steps", "depth_accepted")

@dataclass
class Candidate:
    """One setting with its predicted numbers (times in seconds)."""

    setting: dict[str, Any]
    expected_accepted: float
    draft_s: float
    step_s: float
    tokens_per_s: float = 0.0
    speedup: float = 0.0
    #: What a real step pays beyond the profile's draft + verify times (the drafter catching up on accepted
    #: tokens, KV rollback of accepted paths, tree bookkeeping), calibrated on the calibration run: see
    #: :func:`step_overhead`.
    overhead_s: float = 0.0
    #: The prompt's prefill per generated token (the calibration run's), paid by plain decoding alike.
    prefill_s_per_token: float = 0.0
    #: Tokens verified per step (root included) and whether as a tree: what ``step_s`` is the profile's cost of.
    verified_tokens: int = 0
    tree: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plain_candidate(plain_step_s: float, prefill_s_per_token: float = 0.0) -> Candidate:
    """Plain decoding as a candidate: one token per plain step (plus the prefill per token), speedup 1 by
    definition."""
    return finish_candidate(Candidate(dict(PLAIN_SETTING), 0.0, 0.0, plain_step_s, verified_tokens=1),
                            plain_step_s, prefill_s_per_token=prefill_s_per_token)


def kind_of(head_type: str) -> str:
    """The tuned.json kind of a drafter type's search (``report.json``'s drafter type: a head family's, whose
    kind EAGLE-1/2 and EAGLE-3 share, or the draft model's); one error line for a family that is not tunable."""
    return search_for_drafter(head_type).kind


def finish_candidate(c: Candidate, plain_step_s: float, overhead_s: float | None = None,
                     prefill_s_per_token: float | None = None) -> Candidate:
    """Fill in a candidate's predicted tokens/s, ``1 / ((draft + step + overhead) / (1 + E[accepted]) + prefill per
    token)``, and its speedup over plain decoding (a plain step per token plus the same prefill per token), as an
    eval measures both (``overhead_s`` / ``prefill_s_per_token`` given: replace the candidate's)."""
    if overhead_s is not None:
        c.overhead_s = overhead_s
    if prefill_s_per_token is not None:
        c.prefill_s_per_token = prefill_s_per_token
    c.tokens_per_s = 1.0 / ((c.draft_s + c.step_s + c.overhead_s) / (1.0 + c.expected_accepted)
                            + c.prefill_s_per_token)
    c.speedup = c.tokens_per_s * (plain_step_s + c.prefill_s_per_token)
    return c


def _calibration_drift(measured: Mapping[str, Any], plain_step_s: float) -> float | None:
    """How much slower the calibration ran than the profile (> 1: slower): its interleaved baseline's seconds per
    token over the profile's plain step, or None when the numbers are missing or not finite."""
    base = measured.get("baseline_tokens_per_s")
    if not (_positive(base) and _positive(plain_step_s)):
        return None
    baseline_s = 1.0 / base
    prefill, tokens = measured.get("baseline_prefill_time_s"), measured.get("baseline_new_tokens")
    if _positive(prefill, zero=True) and _positive(tokens):
        baseline_s -= prefill / tokens  # the baseline's own steps only, as the profile's plain step
    return baseline_s / plain_step_s if baseline_s > 0 else None


def _positive(value: Any, zero: bool = False) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if zero else value > 0)


def prefill_per_token(measured: Mapping[str, Any], plain_step_s: float) -> float:
    """The calibration run's prompt prefill per generated token, at the profile's machine speed (0 when the report
    predates the measurement): plain and speculative decoding both pay it, so it narrows every speedup."""
    drift = _calibration_drift(measured, plain_step_s)
    prefill, tokens = measured.get("prefill_time_s"), measured.get("new_tokens")
    if drift is None or not _positive(prefill, zero=True) or not _positive(tokens):
        return 0.0
    return prefill / tokens / drift


def step_overhead(measured: Mapping[str, Any], predicted: Candidate, profile: CostProfile) -> float:
    """Seconds per step that a measured run paid beyond its prediction's draft + verify times (>= 0).

    The profile times drafting and verifying in isolation, with drafts that are all rejected; a real step also
    pays the drafter's catch-up on the accepted tokens and the KV rollback and hidden-state gather of the accepted
    path. ``measured`` is an eval's overall metrics at ``predicted``'s setting; every time in it is rescaled to the
    profile's machine speed by its own interleaved baseline, so load drift between profiling and calibrating
    cancels. Its step is ``(wall - prefill) / steps`` (the prefill is charged per token, see
    :func:`prefill_per_token`). What the setting's verification should have cost is the run's own measured
    verification time plus the profile's bookkeeping part of that step (:meth:`CostProfile.bookkeeping_cost`): so
    the profile's timing noise at this one token count (a few % of a step) is not charged to every candidate.
    Reports or profiles without those parts fall back to the profile's ``step_s``. Every candidate is then charged
    this residual per step: a constant per step, which favours settings that accept more tokens per step."""
    plain_step_s = profile.plain_step_s
    drift = _calibration_drift(measured, plain_step_s)
    steps, wall, prefill = (measured.get(k) for k in ("steps", "wall_time_s", "prefill_time_s"))
    if drift is None:
        return 0.0
    if _positive(steps) and _positive(wall) and _positive(prefill, zero=True):
        step = (wall - prefill) / steps / drift
    else:  # a report that predates the parts: tau / tokens_per_s (prefill included)
        tau, rate = measured.get("tau"), measured.get("tokens_per_s")
        if not (_positive(tau) and _positive(rate)):
            return 0.0
        step = tau / rate / drift
    verify = measured.get("verify_time_s")
    bookkeeping = (profile.bookkeeping_cost(predicted.verified_tokens, predicted.tree)
                   if predicted.verified_tokens else None)
    if _positive(verify) and _positive(steps) and bookkeeping is not None:
        expected = verify / steps / drift + bookkeeping
    else:
        expected = predicted.step_s
    return max(0.0, step - predicted.draft_s - expected)


def draft_model_candidates(profile: CostProfile, drafter: dict[str, Any], reach: Sequence[float]) -> list[Candidate]:
    """A draft model's chains of k tokens predicted from a longer chain's reach rates (greedy: exact), finished
    without calibrated charges (:class:`specgraft.distill.tune.DraftModelSearch`)."""
    predictions = DRAFT_MODEL_SEARCH.candidates(profile, drafter, {"reach": list(reach), "drafter": {"mode": "chain"}})
    return [finish_candidate(Candidate(**p), profile.plain_step_s) for p in predictions]


def rank_and_pick(candidates: list[Candidate]) -> list[Candidate]:
    """Candidates by predicted tokens/s, best first (ties: the smaller tree, then the shallower)."""
    if not candidates:
        raise SpecgraftError("no candidate setting could be predicted (the cost profile and the calibration share no "
                             "setting); re-run `specgraft profile` with this drafter")

    def size(c: Candidate) -> int:
        s = c.setting
        return int(s.get("tree_size") or s.get("total_tokens") or (s.get("depth") or s.get("k") or 0) + 1)

    return sorted(candidates, key=lambda c: (-round(c.tokens_per_s, 9), size(c), c.setting.get("depth", 0)))


# -- calibration ---------------------------------------------------------------------------------------------------
def calibration_numbers(report: dict[str, Any], where: str) -> dict[str, Any]:
    """reach rates and acceptance statistics of a calibration report (one error line when fields are missing)."""
    overall = report.get("overall") if isinstance(report, dict) else None
    if not overall:
        raise SpecgraftError(f"{where} has no 'overall' metrics; pass a report.json written by `specgraft eval`")
    missing = [k for k in CALIBRATION_FIELDS if overall.get(k) is None]
    if missing:
        raise SpecgraftError(f"the calibration report {where} lacks overall.{', overall.'.join(missing)}; re-run "
                             "`specgraft eval` with this version")
    steps = int(overall["steps"])
    if steps <= 0:
        raise SpecgraftError(f"the calibration report {where} verified no drafts (0 steps); calibrate on prompts "
                             "that generate tokens")
    return {"reach": reach_rates(overall["depth_accepted"], steps), "steps": steps,
            "statistics": report.get("acceptance_statistics"), "drafter": report.get("drafter") or {},
            "tokens_per_s": overall.get("tokens_per_s"), "baseline_tokens_per_s": overall.get("baseline_tokens_per_s"),
            "speedup": overall.get("speedup_ratio_of_totals"), "tau": overall.get("tau")}


def candidates_for(kind: str, profile: CostProfile, drafter_costs: dict[str, Any], calibration: dict[str, Any],
                   prior: Sequence[Sequence[float]] | None = None) -> list[Candidate]:
    """Every predicted candidate of a drafter kind, best first, each charged the calibration's
    ``step_overhead_s`` and ``prefill_s_per_token`` (see :func:`step_overhead`, :func:`prefill_per_token`; 0 when
    absent)."""
    overhead, prefill = _charges(calibration)
    return rank_and_pick([finish_candidate(c, profile.plain_step_s, overhead, prefill)
                          for c in _raw_candidates(kind, profile, drafter_costs, calibration, prior)])


def _charges(calibration: Mapping[str, Any]) -> tuple[float, float]:
    """The calibrated per-step overhead and prefill per token every prediction is charged."""
    return (float(calibration.get("step_overhead_s") or 0.0), float(calibration.get("prefill_s_per_token") or 0.0))


def _with_prior(calibration: dict[str, Any], prior: Sequence[Sequence[float]] | None) -> dict[str, Any]:
    """The calibration numbers a family's search reads, with the family's prior for cells never tried."""
    return {**calibration, "prior": prior} if prior is not None else calibration


def _raw_candidates(kind: str, profile: CostProfile, drafter_costs: dict[str, Any], calibration: dict[str, Any],
                    prior: Sequence[Sequence[float]] | None) -> list[Candidate]:
    predictions = tuning_search(kind).candidates(profile, drafter_costs, _with_prior(calibration, prior))
    return [Candidate(**p) for p in predictions]  # finished (speed, overhead) by candidates_for


def predict_setting(kind: str, setting: dict[str, Any], profile: CostProfile, drafter_costs: dict[str, Any],
                    calibration: dict[str, Any], prior: Sequence[Sequence[float]] | None = None) -> Candidate:
    """The prediction for one given setting (e.g. the default) with the same model as the candidates (charged the
    calibration's ``step_overhead_s`` too): the search's :meth:`~specgraft.heads.family.TuningSearch.predict`
    (Medusa settings need ``paths``, the tree; draft-model chains come from the reach rates)."""
    candidate = Candidate(**tuning_search(kind).predict(setting, profile, drafter_costs,
                                                        _with_prior(calibration, prior)))
    return finish_candidate(candidate, profile.plain_step_s, *_charges(calibration))


def same_setting(kind: str, a: dict[str, Any], b: dict[str, Any]) -> bool:
    if is_plain(a) or is_plain(b):
        return is_plain(a) and is_plain(b)
    return bool(tuning_search(kind).same_setting(a, b))


@dataclass
class TuneResult:
    kind: str
    chosen: Candidate
    default: Candidate | None
    candidates: list[Candidate]
    measured: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: The second opinion confirmed beside the predicted best (measured under ``measured["alternative"]``), or None.
    alternative: Candidate | None = None
    #: The calibration run's setting when this tune ran it (not given from outside) at a setting no confirming eval
    #: measured (DFlash's widest tree, a draft model's chain): measured like the confirming evals, on the same
    #: prompts in the same process (``measured["calibration"]``), so :func:`choose` weighs it too. None otherwise.
    calibrated: Candidate | None = None
    #: The eval folder whose report measured each entry of ``measured`` ("best", "alternative", "default",
    #: "calibration"): where the chosen setting's answers and report are (:meth:`report_dir`).
    report_dirs: dict[str, Path] = field(default_factory=dict)
    #: The ``measured`` key of the chosen setting (or of the fastest drafting one when plain decoding was chosen);
    #: None when unconfirmed.
    chosen_from: str | None = None

    def measured_options(self) -> dict[str, Candidate]:
        """The settings a ``measured`` key stands for: the predicted best and, when present, the second opinion,
        the default and the calibration's own setting."""
        options = {"best": self.candidates[0]}
        for key, candidate in (("alternative", self.alternative), ("default", self.default),
                               ("calibration", self.calibrated)):
            if candidate is not None:
                options[key] = candidate
        return options

    @property
    def fastest_drafting(self) -> tuple[Candidate, dict[str, Any] | None]:
        """The drafting setting :func:`choose` found fastest (by measurement when confirmed, else the predicted
        best) and its measurement: what plain decoding was preferred to, when it was."""
        if self.chosen_from is None:
            return self.candidates[0], None
        return self.measured_options()[self.chosen_from], self.measured[self.chosen_from]

    def report_dir(self, which: str = "tuned") -> Path | None:
        """The eval folder that measured the tuned setting (``which="tuned"``: the fastest drafting setting when
        plain decoding was chosen) or another ``measured`` key such as ``"default"``; None if none did."""
        key = self.chosen_from if which == "tuned" else which
        return self.report_dirs.get(key) if key is not None else None


def _speedup_of(measured: Mapping[str, Any] | None) -> float | None:
    value = (measured or {}).get("speedup_ratio_of_totals")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def check_min_speedup(min_speedup: float) -> None:
    """Refuse a ``--min-speedup`` that is not a positive finite number (one error line)."""
    if not (math.isfinite(min_speedup) and min_speedup > 0):
        raise SpecgraftError(f"--min-speedup must be a positive number, got {min_speedup}")


def choose(result: TuneResult, plain_step_s: float, min_speedup: float = DEFAULT_MIN_SPEEDUP) -> TuneResult:
    """Set ``result.chosen`` (and ``result.measured["tuned"]``, ``result.chosen_from``): the fastest of the
    predicted best, the second opinion, the default and a calibration run at another setting by their measured
    speedups (``result.measured["best"]`` / ``["alternative"]`` / ``["default"]`` / ``["calibration"]``), or,
    unconfirmed, the predicted best; plain decoding when that speedup is below ``min_speedup``.

    Plain decoding's "measurement" is plain decoding itself: speedup 1 and tau 1 by definition, at the best run's
    interleaved baseline speed."""
    check_min_speedup(min_speedup)
    best = result.candidates[0]
    measured_best = result.measured.get("best")
    if measured_best is None:  # unconfirmed: the prediction decides
        chosen, speed = best, best.speedup
        result.chosen_from = None
    else:
        scored = [(key, c, _speedup_of(result.measured.get(key))) for key, c in result.measured_options().items()]
        scored = [x for x in scored if x[2] is not None]
        if not scored:
            raise SpecgraftError("the confirming evals measured no speedup (no tokens generated?); calibrate on "
                                 "prompts that generate tokens")
        key, chosen, speed = max(scored, key=lambda x: x[2])  # ties: the predicted best (listed first)
        result.measured["tuned"] = dict(result.measured[key])
        result.chosen_from = key
    if speed < min_speedup:
        result.chosen = plain_candidate(plain_step_s, best.prefill_s_per_token)
        if measured_best is not None:
            rate = measured_best.get("baseline_tokens_per_s")
            result.measured["tuned"] = {"tau": 1.0, "tokens_per_s": rate, "baseline_tokens_per_s": rate,
                                        "speedup_ratio_of_totals": 1.0,
                                        "lossless_check": "plain decoding: nothing is drafted"}
    else:
        result.chosen = chosen
    return result


def tuned_record(result: TuneResult, profile: CostProfile, calibration_path: str) -> dict[str, Any]:
    record = {"version": TUNED_VERSION, "kind": result.kind, "setting": result.chosen.setting,
              "predicted": {"tokens_per_s": result.chosen.tokens_per_s, "speedup": result.chosen.speedup,
                            "tau": 1 + result.chosen.expected_accepted},
              "default": result.default.to_dict() if result.default is not None else None,
              "measured": result.measured, "device": profile.summary(), "calibration": calibration_path,
              "candidates": [c.to_dict() for c in result.candidates[:TOP_CANDIDATES]]}
    if result.alternative is not None:
        record["alternative"] = result.alternative.to_dict()
    if result.calibrated is not None:
        record["calibrated"] = result.calibrated.to_dict()
    if result.chosen_from is not None:
        record["measured_by"] = result.chosen_from  # which eval of ``measured`` the tuned setting's numbers are
    if is_plain(result.chosen.setting):
        # Why plain decoding: the fastest drafting setting and what it was predicted (and measured) to do.
        fastest, measured = result.fastest_drafting
        record["best_drafting"] = {**fastest.to_dict(), "measured": measured}
    return record


def second_opinion(candidates: Sequence[Candidate], measured_best: Mapping[str, Any] | None,
                   min_speedup: float = DEFAULT_MIN_SPEEDUP) -> Candidate | None:
    """The candidate to confirm as well when the predicted best's confirming eval (``measured_best``) fell more
    than :data:`SECOND_OPINION_SHORTFALL` short of its predicted speedup: the best-ranked candidate verified in
    the other shape (a chain when the best is a tree, and the reverse) that is still predicted at ``min_speedup``
    or more. None when the best delivered, was not measured, or no such candidate exists."""
    if not candidates:
        return None
    best = candidates[0]
    speed = _speedup_of(measured_best)
    if speed is None or speed >= best.speedup * (1 - SECOND_OPINION_SHORTFALL):
        return None
    return next((c for c in candidates[1:]
                 if c.tree != best.tree and not is_plain(c.setting) and c.speedup >= min_speedup), None)


# -- the command ---------------------------------------------------------------------------------------------------
def drafter_for(kind: str, head_or_draft: Any, setting: dict[str, Any]) -> Any:
    """A drafter at ``setting``, built by the kind's search (None for plain decoding)."""
    if is_plain(setting):
        return None
    return tuning_search(kind).drafter(head_or_draft, setting)


def setting_label(kind: str, setting: dict[str, Any]) -> str:
    if is_plain(setting):
        return "plain decoding (no drafting)"
    return str(tuning_search(kind).label(setting))


def tune(target: Any, kind: str, head_type: str, drafter_source: Any, source_dir: Path, prompts: Sequence[Any],
         out_dir: Path, *, profile: CostProfile, calibration: tuple[dict[str, Any], str] | None,
         settings: Any, confirm: bool = True, prior: Sequence[Sequence[float]] | None = None,
         progress: bool = True, calibration_is_default: bool = False,
         linear_kernel: str | None = None,
         min_speedup: float = DEFAULT_MIN_SPEEDUP) -> tuple[TuneResult, dict[str, Any]]:
    """Calibrate (unless given), predict, choose and confirm; returns the result and the tuned.json record.

    ``calibration_is_default``: the given calibration report was measured at the default setting on these
    prompts, so it also serves as the default's confirming measurement. ``linear_kernel``: the kernel the modules
    run (checked against the profile's). ``min_speedup``: the measured (with ``confirm``) or else predicted speedup
    over plain decoding a drafting setting needs to be chosen; below it the choice is plain decoding
    (:func:`choose`)."""

    if not prompts:
        raise SpecgraftError("tuning needs calibration prompts; pass --prompts FILE (the prompts you will serve)")
    warnings = check_profile(profile, target.identity.to_dict(), str(target.device), linear_kernel=linear_kernel,
                             attention_kernel=attention_kernel_of(target.model))
    for message in warnings:
        logger.warning("%s", message)
    search: TuningSearch = tuning_search(kind)
    # The untuned setting as the drafter drafts it (Medusa: the tree built from the head's stored accuracies).
    default_setting = search.default_setting(drafter_source)
    if calibration is None:
        # The search's one calibration run that predicts every candidate (DFlash: the widest tree; a draft model:
        # its longest chain; else the default setting).
        calib_setting = search.calibration_setting(drafter_source)
        logger.info("calibration eval of %s at %s", kind, search.calibration_label(calib_setting))
        report = run_eval(target, drafter_for(kind, drafter_source, calib_setting), prompts, out_dir / "calibration",
                          settings=settings, progress=progress,
                          drafter_info=drafter_info(kind, head_type, str(source_dir), calib_setting, "calibration"))
        calibration = (report, str(out_dir / "calibration" / "report.json"))
        # Heads calibrate at their default setting unless their family calibrates wider.
        calibration_is_default = same_setting(kind, calib_setting, default_setting)
        calibrated_at: dict[str, Any] | None = calib_setting
    else:
        # A given report: its setting is known to the model when it is the default's (else nothing is charged).
        calibrated_at = default_setting if calibration_is_default else None
    report, calibration_path = calibration
    numbers = calibration_numbers(report, calibration_path)
    costs = profile.drafter(_profile_label(profile, kind, source_dir))
    if calibrated_at is not None:
        try:
            at_calibration = predict_setting(kind, calibrated_at, profile, costs, numbers, prior)
        except SpecgraftError as exc:  # e.g. a profile that stops short of the calibration's tree
            logger.warning("no per-step overhead calibrated (the calibration setting is not predictable: %s)", exc)
        else:
            numbers["step_overhead_s"] = step_overhead(report["overall"], at_calibration, profile)
            logger.info("calibrated per-step overhead beyond the profile: %.3f ms", numbers["step_overhead_s"] * 1e3)
    numbers["prefill_s_per_token"] = prefill_per_token(report["overall"], profile.plain_step_s)
    candidates = candidates_for(kind, profile, costs, numbers, prior)
    try:
        default: Candidate | None = predict_setting(kind, default_setting, profile, costs, numbers, prior)
    except SpecgraftError as exc:  # e.g. a profile that stops short of the default's 60-64 tokens
        logger.warning("no prediction for the default setting: %s", exc)
        default = None
    result = TuneResult(kind, candidates[0], default, candidates, warnings=warnings)
    calibrated: Candidate | None = None
    if calibrated_at is not None and not calibration_is_default:
        try:  # predicted with the calibrated overhead, as the candidates are
            calibrated = predict_setting(kind, calibrated_at, profile, costs, numbers, prior)
        except SpecgraftError:
            calibrated = None

    def confirming_eval(setting: dict[str, Any], folder: str, source: str) -> dict[str, Any]:
        return _measured(run_eval(target, drafter_for(kind, drafter_source, setting), prompts, out_dir / folder,
                                  settings=settings, progress=progress,
                                  drafter_info=drafter_info(kind, head_type, str(source_dir), setting,
                                                            source))["overall"])

    if confirm:
        # The predicted best is measured even when it is predicted slower than plain decoding: the measurement,
        # not the model, decides whether drafting pays (the model is calibrated on one setting only).
        result.measured["best"] = confirming_eval(candidates[0].setting, "tuned", "tuned")
        result.report_dirs["best"] = out_dir / "tuned"
        alternative = second_opinion(candidates, result.measured["best"], min_speedup)
        if alternative is not None:
            logger.info("the predicted best measured %.2fx against %.2fx predicted: confirming %s too",
                        _speedup_of(result.measured["best"]), candidates[0].speedup,
                        setting_label(kind, alternative.setting))
            result.alternative = alternative
            result.measured["alternative"] = confirming_eval(alternative.setting, "alternative", "tuned")
            result.report_dirs["alternative"] = out_dir / "alternative"
        if calibration_is_default:
            # The calibration run IS the default setting, measured the same way (same prompts and process).
            result.measured["default"] = _measured(report["overall"])
            result.report_dirs["default"] = Path(calibration_path).parent
        elif default is not None and same_setting(kind, default.setting, candidates[0].setting):
            result.measured["default"] = dict(result.measured["best"])
            result.report_dirs["default"] = result.report_dirs["best"]
        else:
            result.measured["default"] = confirming_eval(default_setting, "default", "defaults")
            result.report_dirs["default"] = out_dir / "default"
        measured_settings = [c.setting for c in (candidates[0], result.alternative, default) if c is not None]
        if calibrated is not None and not any(same_setting(kind, calibrated.setting, m) for m in measured_settings):
            # Calibrated here at another setting (DFlash's widest tree, a draft model's chain): a measurement like
            # the others, so the fastest measured setting wins even where the model ranked it lower. (A setting
            # already confirmed keeps that one measurement: the larger of two noisy runs of one setting would
            # overstate it.)
            result.calibrated = calibrated
            result.measured["calibration"] = _measured(report["overall"])
            result.report_dirs["calibration"] = Path(calibration_path).parent
    choose(result, profile.plain_step_s, min_speedup)
    if is_plain(result.chosen.setting):
        logger.warning("no drafting setting of this %s drafter was %s at %.2fx plain decoding's speed or more on "
                       "this device: the tuned setting is plain decoding", kind,
                       "measured" if confirm else "predicted", min_speedup)
    return result, tuned_record(result, profile, calibration_path)


def _measured(overall: dict[str, Any]) -> dict[str, Any]:
    kept = {k: overall.get(k) for k in ("tau", "tokens_per_s", "baseline_tokens_per_s", "speedup_ratio_of_totals",
                                        "lossless_check")}
    # Which plain decoding the speedup is against, and stock plain decoding's speed (absent in older reports).
    kept.update({k: overall[k] for k in ("baseline_kernels", "plain_stock_tokens_per_s", "plain_kernel_tokens_per_s",
                                         "speedup_vs_stock_ratio_of_totals") if k in overall})
    return kept


def _profile_label(profile: CostProfile, kind: str, source_dir: Path) -> str:
    """The profile's drafter section for this head/draft: by path, else the only one of the same kind."""
    if str(source_dir) in profile.drafters:
        return str(source_dir)
    same = [label for label, s in profile.drafters.items() if str(s.get("kind")) == kind]
    if len(same) == 1:
        return same[0]
    raise SpecgraftError(f"the cost profile has no measurement of {source_dir} (it has: "
                         f"{', '.join(profile.drafters) or 'none'}); re-run `specgraft profile --head/--draft "
                         f"{source_dir}`")


def is_default_run(kind: str, report: dict[str, Any], source: Any = None) -> bool:
    """Whether an eval report was measured at the drafter's default setting (then it doubles as the default's
    confirming measurement); ``source``: the head, for a family's own search."""
    return bool(tuning_search(kind).is_default_run(report, source))


def default_kv_length(prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    mean = sum(prompt_lengths) / len(prompt_lengths) if prompt_lengths else 0
    return max(2, int(round(mean + max_new_tokens / 2)))
