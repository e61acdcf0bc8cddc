"""Tune: measure the device's cost profile, then choose each drafter's fastest setting and confirm it
(:func:`specgraft.tuning.tune.tune`), writing ``tuned.json`` beside the head or draft model.

``specgraft tune`` tunes one drafter (profile measured now unless given); the demos and the benchmarks measure one
profile for all their drafters and tune each from its default eval. Both go through these functions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgraft.distill.tune import DRAFT_MODEL_KIND
from specgraft.errors import SpecgraftError
from specgraft.evaluation.loading import load_draft_model
from specgraft.evaluation.prompts import Prompt, render_turn
from specgraft.evaluation.report_reader import check_report_for_head, read_report
from specgraft.evaluation.settings import EvalSettings
from specgraft.heads.base import load_head_for_decoding, read_head_config
from specgraft.heads.registry import family_of, tuning_search
from specgraft.target import Target
from specgraft.tuning.cost import CostProfile, check_fits, check_measure_args, measure_profile
from specgraft.tuning.search import MAX_TREE_TOKENS
from specgraft.tuning.settings import DEFAULT_MIN_SPEEDUP, DEFAULT_REPEATS, DEFAULT_TOKEN_COUNTS
from specgraft.tuning.tune import (
    TUNED_NAME,
    TuneResult,
    calibration_numbers,
    default_kv_length,
    is_default_run,
    kind_of,
    tune,
)
from specgraft.utils.io import atomic_write_json

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class DrafterSource:
    """A drafter to tune: a loaded head or draft model, the folder it came from and what tuning needs of it."""

    folder: Path
    #: The head (a :class:`~specgraft.heads.base.DraftHead`) or the draft model.
    module: Any
    #: The head's family name (``head_config.json``'s ``head_type``), or
    #: :data:`~specgraft.distill.tune.DRAFT_MODEL_KIND`.
    head_type: str
    #: Its tuning kind (:func:`~specgraft.tuning.tune.kind_of`); None for a head family with no search.
    kind: str | None
    #: The target it decodes with (a Medusa-2 head's own, with its adapter merged).
    target: Target

    @property
    def is_head(self) -> bool:
        return self.head_type != DRAFT_MODEL_KIND

    def prior(self) -> Any:
        """The search's prior from the drafter itself (e.g. Medusa's measured per-head accuracies), or None."""
        return tuning_search(self.kind).prior(self.module) if self.kind is not None else None


def load_head_source(target: Target, head_dir: Path, *, require_search: bool = True) -> DrafterSource:
    """The head saved in ``head_dir``, loaded onto ``target`` for drafting (in the target's dtype).

    ``require_search``: refuse a family with no tuning search (one error line); else its ``kind`` is None."""
    head = load_head_for_decoding(target, head_dir)
    kind = kind_of(head.head_type) if require_search or family_of(head).tuning is not None else None
    return DrafterSource(Path(head_dir), head, head.head_type, kind, head.target)


def load_draft_source(target: Target, draft_dir: str | Path, *, dtype: str, device: str) -> DrafterSource:
    """The draft model in ``draft_dir`` (its vocabulary and tokenizer checked against ``target``'s)."""
    draft = load_draft_model(str(draft_dir), target, dtype, device)[0]
    return DrafterSource(Path(draft_dir), draft, DRAFT_MODEL_KIND, DRAFT_MODEL_KIND, target)


def read_calibration(report_path: Path, head_dir: Path | None, source_dir: Path) -> tuple[dict[str, Any], str]:
    """A calibration report of the drafter in ``source_dir`` (``head_dir``: when it is a head), checked for the
    fields tuning needs (one error line) and for being of this drafter (warnings): (report, its file)."""
    report, file = read_report(report_path, "pass the report.json of a `specgraft eval` run of this drafter")
    calibration_numbers(report, str(file))  # fail fast on missing fields
    measured_type = read_head_config(head_dir)["head_type"] if head_dir is not None else DRAFT_MODEL_KIND
    for message in check_report_for_head(report, file, measured_type, source_dir):
        logger.warning("%s", message)
    return report, str(file)


def profile_kv_length(target: Target, prompts: Sequence[Prompt], max_new_tokens: int) -> int:
    """The KV length a cost profile is measured at for these prompts: their mean length plus half of
    ``max_new_tokens`` (where decoding spends its time)."""
    lengths = [len(render_turn(target.tokenizer, p.turns, [])[1]) for p in prompts]
    return default_kv_length(lengths, max_new_tokens)


def measure_cost_profile(target: Target, sources: Sequence[DrafterSource], prompts: Sequence[Prompt], *,
                         device: str, dtype: str, threads: int, max_new_tokens: int, kv_length: int | None = None,
                         linear_kernel: str = "stock", token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
                         repeats: int = DEFAULT_REPEATS, draft_calls: int | None = None) -> CostProfile:
    """This device's cost profile of ``target`` and ``sources`` at ``kv_length`` (default:
    :func:`profile_kv_length`); ``linear_kernel``: the kernel the modules run (see
    :func:`~specgraft.tuning.cost.measure_profile`)."""
    check_measure_args(kv_length, repeats)
    if kv_length is None:
        kv_length = profile_kv_length(target, prompts, max_new_tokens)
    check_fits(target.model, kv_length, MAX_TREE_TOKENS)
    extra = {"draft_calls": draft_calls} if draft_calls is not None else {}
    return measure_profile(
        target, device=device, dtype=dtype, threads=threads, kv_length=kv_length, token_counts=token_counts,
        repeats=repeats, linear_kernel=linear_kernel,
        heads=[(str(s.folder), s.module, s.head_type) for s in sources if s.is_head],
        drafts=[(str(s.folder), s.module) for s in sources if not s.is_head], **extra)


def tune_drafter(source: DrafterSource, prompts: Sequence[Prompt], out_dir: Path, *, profile: CostProfile,
                 settings: EvalSettings, calibration: tuple[dict[str, Any], str] | None = None,
                 calibration_is_default: bool | None = None, confirm: bool = True,
                 min_speedup: float = DEFAULT_MIN_SPEEDUP, linear_kernel: str | None = None,
                 progress: bool = True) -> TuneResult:
    """Calibrate (unless ``calibration`` is given), predict every candidate setting on ``profile``, confirm the
    best (``confirm``) with evals into ``out_dir``, and write ``tuned.json`` into the source's folder.

    ``calibration_is_default``: the given calibration was measured at the default setting on these prompts (it
    then doubles as the default's confirming eval); None: read from the report."""
    if source.kind is None:
        raise SpecgraftError(f"{source.head_type} heads have no tunable drafting settings; evaluate them with "
                             "`specgraft eval` at their defaults or with setting flags")
    if calibration_is_default is None:
        calibration_is_default = calibration is not None and is_default_run(source.kind, calibration[0],
                                                                             source.module)
    result, record = tune(source.target, source.kind, source.head_type, source.module, source.folder, prompts,
                          out_dir, profile=profile, calibration=calibration, settings=settings, confirm=confirm,
                          prior=source.prior(), progress=progress, calibration_is_default=calibration_is_default,
                          linear_kernel=linear_kernel, min_speedup=min_speedup)
    atomic_write_json(source.folder / TUNED_NAME, record)
    return result
