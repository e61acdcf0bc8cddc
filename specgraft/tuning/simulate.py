"""Predict tau and speedup for another setting from closed forms.

``specgraft simulate (--alpha A | --acceptance-profile a1,a2,... | --report report.json) [--draft-length g |
--tree-size n] [--cost-ratio c] ...`` prints the expected tokens per target forward (tau) and the speedup over plain
decoding, with the closed forms of field notes section 4:

* chain of g drafts, each accepted with probability alpha (independently):
  ``tau = (1 - alpha^(g+1)) / (1 - alpha)``;
* a measured per-depth acceptance profile r_1..r_D (conditional: P(depth d accepted | depth d-1 was), what
  ``specgraft eval`` reports as ``acceptance_by_depth``, for chains and trees alike): ``tau = 1 + sum_d prod_{j<=d}
  r_j``; a chain of ``--draft-length g`` uses the first g rates;
* a tree from one alpha and ``--branching b_1,..,b_D`` siblings per depth: ``r_d = 1 - (1 - alpha)^b_d`` (siblings
  assumed independent, which overestimates: real siblings are correlated -- prefer a measured profile);
* ``speedup = tau / (F * c + v)`` where ``c`` (``--cost-ratio``) is one draft forward's cost over one target
  decoding step, ``F`` (``--draft-forwards``) the draft forwards per step (default: the draft depth; 1 for Medusa,
  whose heads run once per step), and ``v`` the verification forward's cost over one decoding step.

Assumptions. ``v = 1`` by default: verifying a chain or a tree of n tokens costs about one target forward when the
target is memory-bound (a large model on a GPU at batch size 1). On a CPU, or for large trees, a forward of n tokens
costs more: pass ``--verify-cost-ratio v`` directly, or ``--verify-cost-per-token s`` for ``v = 1 + s (n - 1)`` with
``n`` = ``--tree-size`` (or g + 1 for a chain). The costs of sampling, tree construction and cache bookkeeping are
folded into ``c`` and ``v``. A different tree size changes the per-depth acceptance itself; the profile is taken as
measured, so measure the tree you intend to serve.

``--report report.json`` takes the measured profile (``overall`` or ``--domain``) and, unless ``--cost-ratio`` is
given, the run's measured per-step costs (``draft_cost_per_step``, ``verify_cost_per_step``): that reproduces the
measured run, and changing ``--cost-ratio`` (e.g. about 0.01-0.05 for a small draft head on a 70B target on a GPU)
predicts another setting.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specgraft.decoding import metrics
from specgraft.decoding.acceptance import reach_rates
from specgraft.errors import SpecgraftError
from specgraft.evaluation.report_reader import read_report
from specgraft.heads.registry import search_for_drafter
from specgraft.tuning.cost import CostProfile, check_profile
from specgraft.tuning.tune import _profile_label, finish_candidate, kind_of, predict_setting
from specgraft.utils.numbers import is_number

MODES = ("chain", "tree")


@dataclass
class Prediction:
    """A closed-form prediction.

    Attributes:
        tau: expected tokens per target forward (accepted drafts + the bonus token).
        speedup: predicted wall-clock speedup over plain decoding.
        mode: ``chain`` or ``tree``.
        depth: draft depth used.
        acceptance_by_depth: the per-depth rates the prediction used (reach rates when predicted from a report,
            conditional rates otherwise).
        draft_cost: drafting cost per step, in target decoding steps (``F * c``).
        verify_cost: verification cost per step, in target decoding steps.
        source: where the acceptance came from.
        assumptions: one line each.
    """

    tau: float
    speedup: float
    mode: str
    depth: int
    acceptance_by_depth: list[float]
    draft_cost: float
    verify_cost: float
    source: str
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Largest draft length / tree size / draft forwards predicted (engines draft a few to a few hundred tokens).
MAX_DRAFT_SIZE = 4096


def _first_rates(rates: list[float], draft_length: int | None, what: str) -> list[float]:
    """The first ``draft_length`` rates (all when None); refuses a draft deeper than the measured depths."""
    if draft_length is None:
        return rates
    if draft_length > len(rates):
        raise SpecgraftError(f"draft length {draft_length} needs {draft_length} {what} has {len(rates)}; measure "
                             "deeper drafts or shorten --draft-length")
    return rates[:draft_length]


def _check_rate(value: float, what: str) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise SpecgraftError(f"{what} must be in [0, 1], got {value}")
    return value


def predict(
    *,
    alpha: float | None = None,
    profile: Sequence[float] | None = None,
    reach: Sequence[float] | None = None,
    draft_length: int | None = None,
    tree_size: int | None = None,
    branching: Sequence[int] | None = None,
    cost_ratio: float | None = None,
    draft_forwards: int | None = None,
    verify_cost: float | None = None,
    verify_cost_per_token: float | None = None,
    draft_cost: float | None = None,
    mode: str | None = None,
    source: str = "",
) -> Prediction:
    """Predict tau and speedup (see the module docstring for the formulas and assumptions).

    Args:
        alpha: per-draft acceptance probability (e.g. a measured alpha_exact).
        profile: measured per-depth conditional acceptance rates (exact for chains only).
        reach: measured per-depth reach rates (P(the accepted path reaches depth d)); exact for trees too.
        draft_length: chain length g (default: the profile's length; required with alpha for chains).
        tree_size: tokens verified per step including the root (tree mode; enters only the verify cost).
        branching: siblings per depth for a tree predicted from alpha.
        cost_ratio: one draft forward's cost over one target decoding step (c).
        draft_forwards: draft forwards per step (F; default: the depth).
        verify_cost: the verification forward's cost in decoding steps (v; default 1, or from the per-token slope).
        verify_cost_per_token: s in ``v = 1 + s (n - 1)``.
        draft_cost: drafting cost per step in decoding steps, instead of ``F * c`` (a measured value).
        mode: ``chain`` or ``tree`` (default: tree when tree_size or branching is given).
    """
    if sum(x is not None for x in (alpha, profile, reach)) != 1:
        raise SpecgraftError("give exactly one of --alpha and --acceptance-profile (or --report)")
    mode = mode or ("tree" if tree_size is not None or branching else "chain")
    if mode not in MODES:
        raise SpecgraftError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    for name, value, low in (("draft length", draft_length, 1), ("tree size", tree_size, 2),
                             ("draft forwards", draft_forwards, 0)):
        if value is not None and (int(value) != value or value < low):
            raise SpecgraftError(f"{name} must be an integer >= {low}, got {value}")
        if value is not None and value > MAX_DRAFT_SIZE:  # checked before a per-depth list of that size is built
            raise SpecgraftError(f"{name} must be at most {MAX_DRAFT_SIZE}, got {value}")
    if branching and len(branching) > MAX_DRAFT_SIZE:
        raise SpecgraftError(f"--branching has {len(branching)} depths; at most {MAX_DRAFT_SIZE}")
    if mode == "chain" and branching:
        raise SpecgraftError("--branching describes a tree; drop it for a chain or drop --draft-length")
    assumptions: list[str] = []

    if reach is not None:
        rates = [_check_rate(r, "reach rates") for r in reach]
        if not rates:
            raise SpecgraftError("the reach profile is empty; the report verified no drafts")
        if any(b > a + 1e-12 for a, b in zip(rates, rates[1:])):
            raise SpecgraftError(f"reach rates must not increase with depth, got {rates}; pass depth_accepted/steps")
        rates = _first_rates(rates, draft_length, "reach rates but the report")
        source = source or "measured reach rates"
        assumptions.append("reach rates as measured (P(accepted path reaches depth d)); a shorter draft truncates "
                           "the accepted path")
    elif profile is not None:
        rates = [_check_rate(r, "acceptance rates") for r in profile]
        if not rates:
            raise SpecgraftError("the acceptance profile is empty; give one rate per draft depth, e.g. 0.8,0.7,0.6")
        rates = _first_rates(rates, draft_length, "per-depth rates but the profile")
        source = source or "per-depth acceptance profile"
        assumptions.append("per-depth acceptance as measured (conditional on reaching the depth)")
    else:
        a = _check_rate(alpha, "alpha")
        if mode == "tree":
            if not branching:
                raise SpecgraftError("a tree prediction from a single alpha needs --branching b1,b2,... (siblings per "
                                     "depth), or a measured --acceptance-profile of the tree")
            if any(int(b) != b or b < 1 for b in branching):
                raise SpecgraftError(f"branching values must be integers >= 1, got {list(branching)}")
            if draft_length is not None and draft_length != len(branching):
                raise SpecgraftError(f"--branching has {len(branching)} depths but --draft-length is {draft_length}")
            rates = metrics.tree_depth_acceptance([a] * len(branching), branching)
            assumptions.append("siblings accepted independently with probability alpha (optimistic: real siblings "
                               "are correlated)")
        else:
            if draft_length is None:
                raise SpecgraftError("a chain prediction from alpha needs --draft-length g")
            rates = [a] * int(draft_length)
            assumptions.append("each draft accepted independently with probability alpha")
        source = source or f"alpha {a:g}"
    depth = len(rates)
    if reach is not None:
        tau = 1.0 + sum(rates)
    elif profile is None and mode == "chain":
        tau = metrics.expected_tokens_chain(float(alpha), depth)
    else:
        tau = metrics.expected_tokens_from_depth_acceptance(rates)

    if draft_cost is None:
        if cost_ratio is None:
            raise SpecgraftError("give --cost-ratio c (one draft forward's cost over one target decoding step), or a "
                                 "--report with measured costs")
        if not cost_ratio >= 0:
            raise SpecgraftError(f"--cost-ratio must be >= 0, got {cost_ratio}")
        forwards = depth if draft_forwards is None else int(draft_forwards)
        draft_cost = forwards * float(cost_ratio)
        assumptions.append(f"drafting costs {forwards} draft forward(s) of {float(cost_ratio):g} target steps each")
    elif not draft_cost >= 0:
        raise SpecgraftError(f"draft cost per step must be >= 0, got {draft_cost}")
    if verify_cost is None:
        if verify_cost_per_token is not None:
            if not verify_cost_per_token >= 0:
                raise SpecgraftError(f"--verify-cost-per-token must be >= 0, got {verify_cost_per_token}")
            n = tree_size if tree_size is not None else (depth + 1 if mode == "chain" else None)
            if n is None:
                raise SpecgraftError("--verify-cost-per-token for a tree needs --tree-size (tokens per verification)")
            verify_cost = 1.0 + float(verify_cost_per_token) * (n - 1)
            assumptions.append(f"verifying {n} tokens costs 1 + {verify_cost_per_token:g} x {n - 1} decoding steps")
        else:
            verify_cost = 1.0
            assumptions.append("verification costs one target forward (memory-bound target)")
    elif not verify_cost > 0:
        raise SpecgraftError(f"verification cost must be > 0, got {verify_cost}")
    speedup = tau / (draft_cost + verify_cost)
    return Prediction(tau=tau, speedup=speedup, mode=mode, depth=depth, acceptance_by_depth=list(rates),
                      draft_cost=float(draft_cost), verify_cost=float(verify_cost), source=source,
                      assumptions=assumptions)


def read_report_profile(path: str | Path, domain: str | None = None) -> dict[str, Any]:
    """The measured numbers of an eval report: ``profile``, ``alpha``, ``mode``, ``depth``, ``draft_cost``,
    ``verify_cost``, ``tau``, ``speedup`` (of ``overall``, or of ``domain``)."""
    report, file = read_report(path)  # sections typed, numbers finite and >= 0, rates <= 1
    if domain is None:
        values = report["overall"]
    else:
        known = report.get("domains") or {}
        if domain not in known:
            raise SpecgraftError(f"domain {domain!r} is not in {file} (domains: {', '.join(known) or 'none'})")
        values = known[domain] or {}
    raw = values.get("acceptance_by_depth")
    drafter = report.get("drafter") or {}
    for key in ("alpha_exact", "draft_cost_per_step", "verify_cost_per_step", "tau", "speedup_ratio_of_totals"):
        if values.get(key) is not None and not is_number(values[key]):
            raise SpecgraftError(f"{file}: {key} is {values[key]!r}, not a number; pass the report.json that "
                                 "`specgraft eval` wrote")
    profile: list[float] = []
    for r in raw or []:  # a null rate means no step reached that depth: the profile ends there
        if r is None:
            break
        profile.append(float(r))
    drafter = report.get("drafter") or {}
    reach = values.get("reach_by_depth")
    if not reach and values.get("depth_accepted") is not None and values.get("steps"):
        reach = reach_rates(values["depth_accepted"], int(values["steps"]))
    return {"profile": profile, "reach": list(reach) if reach else None, "drafter": drafter,
            "statistics": report.get("acceptance_statistics"), "target": report.get("target"),
            "alpha": values.get("alpha_exact"), "mode": drafter.get("mode"),
            "depth": len(profile), "draft_cost": values.get("draft_cost_per_step"),
            "verify_cost": values.get("verify_cost_per_step"), "tau": values.get("tau"),
            "speedup": values.get("speedup_ratio_of_totals"), "tree_size": drafter.get("tree_size")}


def predict_on_profile(report_path: Path, domain: str | None, profile_path: Path,
                       draft_length: int | None) -> dict[str, Any]:
    """Predict the report's setting (or a chain truncated to ``draft_length``) on a cost profile's device."""
    measured = read_report_profile(report_path, domain)
    profile = CostProfile.load(profile_path)
    drafter = measured["drafter"]
    head_type = str(drafter.get("type"))
    try:
        kind = kind_of(head_type)
    except SpecgraftError:
        raise SpecgraftError(f"--cost-profile predicts head and draft-model drafters, not {head_type!r}") from None
    mode = drafter.get("mode") or "chain"
    depth = int(draft_length or drafter.get("k") or drafter.get("depth") or len(measured["reach"] or []))
    setting = search_for_drafter(head_type).setting_from_report(drafter, measured.get("statistics"), depth, mode)
    for message in check_profile(profile, measured.get("target"), None):
        print(f"warning: {message}", file=sys.stderr)
    calibration = {"reach": measured["reach"] or [], "statistics": measured.get("statistics"),
                   "drafter": drafter}
    costs = profile.drafter(_profile_label(profile, kind, Path(str(drafter.get("path")))))
    # Costs from the profile; the acceptance of the report's own setting (or of it cut to `depth`) is exactly its
    # reach rates, so the rank model is not needed here.
    c = predict_setting(kind, setting, profile, costs, calibration)
    if measured["reach"]:
        c.expected_accepted = float(sum(measured["reach"][:depth]))
        c = finish_candidate(c, profile.plain_step_s)
    return {"setting": c.setting, "tau": 1 + c.expected_accepted, "tokens_per_s": c.tokens_per_s,
            "speedup": c.speedup, "draft_s": c.draft_s, "step_s": c.step_s, "device": profile.summary(),
            "measured": {"tau": measured["tau"], "speedup": measured["speedup"]}}
