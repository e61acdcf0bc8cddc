"""Per-domain evaluation: run a drafter against plain decoding of the same target, write the report.

:func:`run_eval` decodes every prompt (every turn of multi-turn conversations, each continuing with the generated
answer) twice per repeat -- plain decoding (``drafter=None``, the baseline) then speculative decoding -- on the
same :class:`~specgraft.decoding.decoder.SpeculativeDecoder` code path, in the same process, after warm-up runs.
Interleaving baseline and speculative runs per prompt cancels slow machine drift; with several repeats each
prompt's time is the median (every repeat is seeded identically, so repeats redo exactly the same work).

Outputs in ``out_dir`` (each written atomically):

* ``report.json``: target identity, drafter, settings, ``overall`` and per-domain metrics (schema in
  :data:`METRIC_KEYS`; other code, e.g. the model card, reads these keys), plot and answer file names.
* ``report.md``: one table, a row per domain and the overall row.
* ``answers.jsonl``: one line per prompt and turn (id, domain, prompt text, answer text and ids, baseline ids and
  whether they are equal, per-prompt tau, tokens, times), so losslessness and quality can be checked afterwards.
* ``tau_by_domain.png``, ``acceptance_by_depth.png``, ``speedup_by_domain.png``.

The renderers of ``report.md`` and the plots live in :mod:`specgraft.evaluation.render` (their names are re-exported
here for existing imports).

Metrics (field notes section 5): tau pools verification steps (mean of accepted + 1); acceptance by depth pools
per-depth counts; alpha_exact pools the per-position acceptance probability over verified positions (``sum_x
min(p, q)`` for sampled drafts, ``p(token)`` for deterministic ones; see :mod:`specgraft.decoding.metrics`);
tokens/s is total new tokens over total seconds; speedup is the mean of per-prompt tokens/s ratios and the ratio of
total tokens/s. The lossless check (greedy only) compares each answer's ids with the baseline's, token for token.
Verification is always lossless: the engine has no lossy (typical) acceptance, so ``settings.lossy`` is False.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specgraft.decoding import metrics
from specgraft.decoding.acceptance import reach_rates
from specgraft.decoding.decoder import GenerationResult, SpeculativeDecoder
from specgraft.decoding.drafter import Drafter
from specgraft.errors import SpecgraftError
from specgraft.evaluation.prompts import Prompt, domains, has_chat_template, render_turn
from specgraft.evaluation.render import (  # noqa: F401 (PLOTS and the renderers are re-exported)
    ANSWERS_JSONL,
    OVERALL,
    PLOTS,
    render_markdown,
    write_plots,
)
from specgraft.evaluation.settings import EvalSettings  # noqa: F401 (re-exported)
from specgraft.kernels.exact_attention import kernel_setting, plain_decoding_differs, stock_kernels
from specgraft.kernels.rounding import equal_up_to_rounding, greedy_gap_ulps
from specgraft.utils.io import atomic_write_json, atomic_write_text

logger = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
#: The metric keys of ``overall`` and of every domain in report.json (readers rely on them).
METRIC_KEYS = ("tau", "acceptance_by_depth", "alpha_exact", "tokens_per_s", "baseline_tokens_per_s",
               "speedup_mean_of_ratios", "speedup_ratio_of_totals", "num_prompts", "lossless_check")




@dataclass
class TurnRecord:
    """One turn of one prompt: the speculative and the baseline generation (times are medians over repeats)."""

    prompt: Prompt
    turn: int
    prompt_text: str
    prompt_tokens: int
    spec: GenerationResult
    base: GenerationResult
    spec_times: list[float] = field(default_factory=list)
    base_times: list[float] = field(default_factory=list)
    #: Plain decoding under the eval's own kernels, when they are not the stock ones (None otherwise): the kernel's
    #: effect on plain decoding, reported beside the stock baseline (``base``).
    kernel_plain: GenerationResult | None = None
    kernel_plain_times: list[float] = field(default_factory=list)
    #: Greedy answers that differ: each answer's largest top-logit gap in ulps (:mod:`specgraft.kernels.rounding`).
    spec_gap_ulps: float | None = None
    base_gap_ulps: float | None = None

    @property
    def identical(self) -> bool:
        return self.spec.generated_ids == self.base.generated_ids

    @property
    def equal_up_to_rounding(self) -> bool:
        """Identical, or differing only where the target's top logits tie to within rounding (see
        :func:`specgraft.kernels.rounding.equal_up_to_rounding`)."""
        return self.identical or equal_up_to_rounding(self.spec_gap_ulps, self.base_gap_ulps)


# -- running --------------------------------------------------------------------------------------------------------
def _unwrap_target(target: Any, tokenizer: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, identity dict) of a Target or a bare PreTrainedModel."""
    from specgraft.target import Target

    if not isinstance(target, Target):
        target = Target(target, tokenizer)
    tok = tokenizer if tokenizer is not None else target.tokenizer
    return target.model, tok, target.identity.to_dict()


def describe_drafter(drafter: Drafter | None) -> dict[str, Any]:
    """A best-effort ``{"type", "path", "mode", ...}`` for a drafter built in Python (the CLI passes its own)."""
    if drafter is None:
        return {"type": "none", "path": None, "mode": "none"}
    info: dict[str, Any] = {"type": type(drafter).__name__, "path": None}
    mode = getattr(drafter, "mode", None)
    if mode is None:
        mode = "tree" if getattr(drafter, "tree_topk", None) else "chain"
    info["mode"] = mode
    for attr in ("k", "depth", "top_k", "total_tokens", "tree_topk"):
        value = getattr(drafter, attr, None)
        if isinstance(value, (int, tuple, list)) and value not in ((), []):
            info[attr] = list(value) if isinstance(value, tuple) else value
    return info


def _context_limit(model: Any) -> int | None:
    from specgraft.decoding.kv import text_config

    return getattr(text_config(model), "max_position_embeddings", None)


def _timed_runs(runs: Sequence[tuple[SpeculativeDecoder, Any]], ids: list[int], settings: EvalSettings,
                seed: int) -> list[tuple[GenerationResult, list[float]]]:
    """Run each ``(decoder, context factory)`` in turn, ``repeats`` times interleaved; return each one's first result
    with median times, and its times."""
    results: list[list[GenerationResult]] = [[] for _ in runs]
    for _ in range(settings.repeats):
        for out, (decoder, scope) in zip(results, runs):
            with scope():
                out.append(decoder.generate(ids, settings.max_new_tokens, seed=seed))
    timed = []
    for out in results:
        first = out[0]
        times = [r.wall_time_s for r in out]
        first.wall_time_s = statistics.median(times)
        for part in ("draft_time_s", "prefill_time_s", "verify_time_s"):
            setattr(first, part, statistics.median(getattr(r, part) for r in out))
        timed.append((first, times))
    return timed


def run_eval(
    target: Any,
    drafter: Drafter | None,
    prompts: Sequence[Prompt],
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    settings: EvalSettings | None = None,
    drafter_info: dict[str, Any] | None = None,
    progress: bool = True,
    **setting_overrides: Any,
) -> dict[str, Any]:
    """Evaluate ``drafter`` on ``target`` over ``prompts``; write the report files to ``out_dir``; return the report.

    Args:
        target: a :class:`~specgraft.target.Target` or a transformers causal LM (then pass ``tokenizer``).
        drafter: the drafter to measure (built for this target); None measures plain decoding against itself (a
            tuned setting of plain decoding).
        prompts: from :func:`specgraft.evaluation.prompts.load_prompts`.
        out_dir: folder for report.json, report.md, answers.jsonl and the plots (created if needed).
        tokenizer: the target's tokenizer (default: the Target's).
        settings: decoding/measurement settings; keyword overrides (``max_new_tokens=...``) build one.
        drafter_info: what report.json records under ``drafter`` (default: :func:`describe_drafter`).
        progress: show a tqdm progress bar on stderr.
    """
    settings = settings or EvalSettings()
    if setting_overrides:
        unknown = sorted(set(setting_overrides) - set(EvalSettings.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown eval settings {unknown}")
        settings = EvalSettings(**{**asdict(settings), **setting_overrides})
    settings.validate()
    prompts = list(prompts)
    if not prompts:
        raise SpecgraftError("no prompts to evaluate; pass a prompt file with at least one prompt")
    model, tok, identity = _unwrap_target(target, tokenizer)
    if tok is None:
        raise SpecgraftError("evaluation needs the target's tokenizer (prompts are text); load the target with it")
    context = _context_limit(model)
    first_turns = [render_turn(tok, p.turns, []) for p in prompts]
    if context is not None:
        for p, (_, ids) in zip(prompts, first_turns):
            if len(ids) >= context:
                raise SpecgraftError(f"prompt {p.id} (domain {p.domain}) has {len(ids)} tokens, at or over the "
                                     f"target's context of {context} tokens, leaving no room to generate; shorten "
                                     "it or remove it from the prompt file")
    common = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                  ignore_eos=settings.ignore_eos, seed=settings.seed)
    # The baseline is the user's own plain decoding: the stock kernels (transformers' attention, nn.Linear) in the
    # same dtype, whatever kernels the speculative run uses. Plain decoding under those kernels is timed beside it
    # when they change its one-token steps, and the faster of the two plain settings is the one speedups are
    # measured against.
    setting = kernel_setting(model)
    with stock_kernels(model):
        base = SpeculativeDecoder(model, tok, drafter=None, **common)
    runs: list[tuple[SpeculativeDecoder, Any]] = [(base, functools.partial(stock_kernels, model))]
    if plain_decoding_differs(model):
        runs.append((SpeculativeDecoder(model, tok, drafter=None, **common), contextlib.nullcontext))
    spec = SpeculativeDecoder(model, tok, drafter=drafter, **common)
    runs.append((spec, contextlib.nullcontext))

    warm_ids = first_turns[0][1]
    for _ in range(settings.warmup):
        for decoder, scope in runs:
            with scope():
                decoder.generate(warm_ids, settings.max_new_tokens, seed=settings.seed)
    recorder = getattr(drafter, "acceptance", None)
    if recorder is not None:
        recorder.reset()  # count the measured turns only, not the warm-up

    from tqdm.auto import tqdm

    records: list[TurnRecord] = []
    skipped: list[dict[str, Any]] = []
    generation = 0
    started = time.perf_counter()
    with tqdm(total=sum(len(p.turns) for p in prompts), desc="eval", unit="turn", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for p, first in zip(prompts, first_turns):
            answers: list[str] = []
            for turn in range(len(p.turns)):
                text, ids = first if turn == 0 else render_turn(tok, p.turns, answers)
                if context is not None and len(ids) >= context:
                    left = len(p.turns) - turn
                    logger.warning("prompt %s: turn %d with the earlier answers has %d tokens, over the context "
                                   "of %d; skipping its last %d turn(s)", p.id, turn, len(ids), context, left)
                    skipped.append({"prompt_id": p.id, "domain": p.domain, "from_turn": turn, "tokens": len(ids)})
                    bar.update(left)
                    break
                timed = _timed_runs(runs, ids, settings, settings.seed + generation)
                (b, base_times), (s, spec_times) = timed[0], timed[-1]
                generation += 1
                answers.append(s.text or "")
                record = TurnRecord(prompt=p, turn=turn, prompt_text=text, prompt_tokens=len(ids), spec=s, base=b,
                                    spec_times=spec_times, base_times=base_times)
                if len(timed) == 3:
                    record.kernel_plain, record.kernel_plain_times = timed[1]
                if settings.greedy and not record.identical:
                    # Why they differ: a rounding tie (bf16) or a bug; one teacher-forced forward per answer.
                    record.spec_gap_ulps = greedy_gap_ulps(model, ids, s.generated_ids)
                    record.base_gap_ulps = greedy_gap_ulps(model, ids, b.generated_ids)
                records.append(record)
                bar.set_postfix(domain=p.domain[:16], tau=f"{s.tau:.2f}")
                bar.update(1)
    logger.info("decoded %d turns of %d prompts in %.1f s", len(records), len(prompts),
                time.perf_counter() - started)

    report = build_report(records, settings, identity, drafter_info or describe_drafter(drafter),
                          domain_order=domains(prompts), kernels=setting)
    report["prompt_format"] = "chat_template" if has_chat_template(tok) else "raw_text"
    if recorder is not None:
        # Per-(depth, rank) and, for static trees, per-node acceptance (eval.acceptance): what `specgraft tune`
        # predicts other tree shapes from. Pooled over every timed turn (repeats redo identical work).
        report["acceptance_statistics"] = recorder.to_dict()
    report["skipped_turns"] = skipped
    write_outputs(report, records, out_dir)
    return report


# -- aggregation ----------------------------------------------------------------------------------------------------
def _finite(value: Any) -> Any:
    """JSON-safe: nan/inf -> None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _safe_speedup(base: list[tuple[int, float]], spec: list[tuple[int, float]]) -> dict[str, float]:
    pairs = [(b, s) for b, s in zip(base, spec) if b[0] > 0 and s[0] > 0 and b[1] > 0 and s[1] > 0]
    if not pairs:
        return {"mean_of_ratios": float("nan"), "ratio_of_totals": float("nan")}
    return metrics.speedup([b for b, _ in pairs], [s for _, s in pairs])


def lossless_summary(records: Sequence[TurnRecord], greedy: bool) -> dict[str, Any]:
    """Per-prompt lossless check: ``lossless_check`` (a sentence), ``lossless_passed``, counts."""
    if not greedy:
        return {"lossless_check": "not checkable per prompt (sampling: outputs are random draws; the distribution "
                                  "test is in the test-suite)",
                "lossless_passed": None, "lossless_identical": None, "lossless_checked": 0}
    per_prompt: dict[tuple[str, str], bool] = {}
    rounding: dict[tuple[str, str], bool] = {}
    for r in records:
        key = (r.prompt.source, r.prompt.id)
        per_prompt[key] = per_prompt.get(key, True) and r.identical
        rounding[key] = rounding.get(key, True) and r.equal_up_to_rounding
    checked = len(per_prompt)
    identical = sum(per_prompt.values())
    failed = sorted(pid for (_, pid), ok in per_prompt.items() if not ok)
    listed = f"{', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}"
    gaps = [r.spec_gap_ulps for r in records if r.spec_gap_ulps is not None]
    base_gaps = [r.base_gap_ulps for r in records if r.base_gap_ulps is not None]
    up_to_rounding = all(rounding.values())
    if identical == checked:
        text = f"passed ({identical}/{checked} prompts token-identical to plain greedy decoding)"
    elif up_to_rounding:
        text = (f"passed up to rounding ({identical}/{checked} prompts token-identical; {checked - identical} "
                f"differ only at rounding ties of the target's top logits: every emitted token is at most "
                f"{max(gaps):g} ulps below the top logit, plain decoding's own answers {max(base_gaps):g}: "
                f"{listed})")
    else:
        text = f"FAILED ({checked - identical}/{checked} prompts differ from plain greedy decoding: {listed})"
    out = {"lossless_check": text, "lossless_passed": identical == checked, "lossless_identical": identical,
           "lossless_checked": checked, "lossless_up_to_rounding": up_to_rounding}
    if gaps:
        out["max_logit_gap_ulps"] = max(gaps)
        out["baseline_max_logit_gap_ulps"] = max(base_gaps) if base_gaps else None
    return out


def summarize_records(records: Sequence[TurnRecord], greedy: bool, kernels: str = "stock") -> dict[str, Any]:
    """The metrics of a group of turns (a domain or all): the :data:`METRIC_KEYS` plus supporting counts.

    ``draft_cost_per_step`` and ``verify_cost_per_step`` are the measured per-step times of drafting and of the
    rest of a step (the verification forward and bookkeeping), in units of one baseline decoding step (baseline
    seconds per token); ``specgraft simulate --report`` uses them as the measured cost model.
    """
    spec = metrics.summarize([r.spec for r in records])
    stock = metrics.summarize([r.base for r in records])
    per_prompt: dict[tuple[str, str], list[TurnRecord]] = {}
    for r in records:
        per_prompt.setdefault((r.prompt.source, r.prompt.id), []).append(r)

    def pairs(results: Any) -> list[tuple[int, float]]:
        return [(sum(results(r).num_new_tokens for r in rs), sum(results(r).wall_time_s for r in rs))
                for rs in per_prompt.values()]

    spec_pairs = pairs(lambda r: r.spec)
    stock_speed = _safe_speedup(pairs(lambda r: r.base), spec_pairs)
    kernel_plain = (metrics.summarize([r.kernel_plain for r in records])
                    if records and all(r.kernel_plain is not None for r in records) else None)
    # The baseline: stock plain decoding, unless plain decoding under the eval's kernels measured faster (then
    # that one, named in baseline_kernels): a speedup is never taken against the slower plain setting.
    faster_kernel = kernel_plain is not None and kernel_plain["wall_time_s"] < stock["wall_time_s"]
    base = kernel_plain if faster_kernel else stock
    speed = _safe_speedup(pairs(lambda r: r.kernel_plain), spec_pairs) if faster_kernel else stock_speed
    base_step = base["wall_time_s"] / base["new_tokens"] if base["new_tokens"] else float("nan")
    steps = spec["steps"]
    draft_cost = spec["draft_time_s"] / steps / base_step if steps and base_step > 0 else float("nan")
    verify_cost = ((spec["wall_time_s"] - spec["draft_time_s"]) / steps / base_step
                   if steps and base_step > 0 else float("nan"))
    out: dict[str, Any] = {
        "tau": spec["tau"],
        "acceptance_by_depth": spec["acceptance_by_depth"],
        # P(the accepted path reaches depth d) = depth_accepted[d] / steps; tau = 1 + sum (eval.acceptance).
        "reach_by_depth": reach_rates(spec["depth_accepted"], steps) if steps else [],
        "alpha_exact": spec["alpha_exact"],
        "tokens_per_s": spec["tokens_per_s"],
        "baseline_tokens_per_s": base["tokens_per_s"],
        "speedup_mean_of_ratios": speed["mean_of_ratios"],
        "speedup_ratio_of_totals": speed["ratio_of_totals"],
        "num_prompts": len(per_prompt),
    }
    out.update(lossless_summary(records, greedy))
    out.update({
        "num_turns": len(records),
        "speedup_over_tau": speed["ratio_of_totals"] / spec["tau"] if steps else float("nan"),
        "new_tokens": spec["new_tokens"],
        "baseline_new_tokens": base["new_tokens"],
        "wall_time_s": spec["wall_time_s"],
        "baseline_wall_time_s": base["wall_time_s"],
        "baseline_prefill_time_s": base["prefill_time_s"],
        "steps": steps,
        "depth_attempted": spec["depth_attempted"],
        "depth_accepted": spec["depth_accepted"],
        "target_forwards": spec["target_forwards"],
        "baseline_target_forwards": base["target_forwards"],
        "draft_time_s": spec["draft_time_s"],
        "prefill_time_s": spec["prefill_time_s"],
        "verify_time_s": spec["verify_time_s"],
        "draft_cost_per_step": draft_cost,
        "verify_cost_per_step": verify_cost,
        # The plain-decoding settings, named: stock (the user's own) always, the eval's kernels when they differ.
        "baseline_kernels": kernels if faster_kernel else "stock",
        "plain_stock_s": stock["wall_time_s"],
        "plain_stock_tokens_per_s": stock["tokens_per_s"],
        "speedup_vs_stock_ratio_of_totals": stock_speed["ratio_of_totals"],
        "speedup_vs_stock_mean_of_ratios": stock_speed["mean_of_ratios"],
        "plain_kernel_s": kernel_plain["wall_time_s"] if kernel_plain else None,
        "plain_kernel_tokens_per_s": kernel_plain["tokens_per_s"] if kernel_plain else None,
        "plain_kernel_over_stock": (kernel_plain["wall_time_s"] / stock["wall_time_s"]
                                    if kernel_plain and stock["wall_time_s"] else None),
    })
    return out


def build_report(records: Sequence[TurnRecord], settings: EvalSettings, target: dict[str, Any],
                 drafter: dict[str, Any], domain_order: Sequence[str] | None = None,
                 kernels: str = "stock") -> dict[str, Any]:
    """The report.json object (NaN written as null). ``kernels``: the kernel setting the speculative run used
    (:func:`specgraft.kernels.exact_attention.kernel_setting`)."""
    order = list(domain_order) if domain_order else list(dict.fromkeys(r.prompt.domain for r in records))
    groups = {d: [r for r in records if r.prompt.domain == d] for d in order}
    report = {
        "target": target,
        "drafter": {"type": drafter.get("type"), "path": drafter.get("path"), "mode": drafter.get("mode"),
                    **{k: v for k, v in drafter.items() if k not in ("type", "path", "mode")}},
        "settings": settings.to_dict(),
        "overall": summarize_records(records, settings.greedy, kernels) if records else {},
        "domains": {d: summarize_records(rs, settings.greedy, kernels) for d, rs in groups.items() if rs},
        "plots": dict(PLOTS),
        "answers": ANSWERS_JSONL,
        "measurement": {
            "baseline": "plain autoregressive decoding (the same decoder without a drafter) with the stock kernels "
                        "(the model's own attention, nn.Linear) in the same dtype, same prompts and max_new_tokens; "
                        "where plain decoding under the eval's kernels measured faster, that one "
                        "(overall.baseline_kernels says which)",
            "baseline_stock_kernels": True,
            "kernels": kernels,
            "plain_settings": ["stock"] + ([kernels] if kernels != "stock" else []),
            "order": "plain (stock kernels), plain (the eval's kernels, when not stock), then speculative, "
                     "interleaved per turn, after warm-up",
            "warmup_runs": settings.warmup,
            "repeats": settings.repeats,
            "time": "median over repeats",
            "verification": "lossless (greedy match or exact rejection sampling)",
        },
    }
    return _finite(report)


# -- writing --------------------------------------------------------------------------------------------------------
def answer_lines(records: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    """The answers.jsonl objects, one per prompt and turn."""
    lines = []
    for r in records:
        lines.append(_finite({
            "prompt_id": r.prompt.id,
            "domain": r.prompt.domain,
            "turn": r.turn,
            "source": r.prompt.source,
            "prompt": r.prompt_text,
            "prompt_tokens": r.prompt_tokens,
            "answer": r.spec.text,
            "answer_ids": r.spec.generated_ids,
            "baseline_answer": r.base.text,
            "baseline_ids": r.base.generated_ids,
            "baseline_equal": r.identical,
            "logit_gap_ulps": r.spec_gap_ulps,
            "baseline_logit_gap_ulps": r.base_gap_ulps,
            "tau": r.spec.tau,
            "steps": r.spec.num_steps,
            "accepted_lengths": r.spec.accepted_lengths,
            "new_tokens": r.spec.num_new_tokens,
            "baseline_new_tokens": r.base.num_new_tokens,
            "time_s": r.spec.wall_time_s,
            "baseline_time_s": r.base.wall_time_s,
            "plain_kernel_time_s": r.kernel_plain.wall_time_s if r.kernel_plain is not None else None,
            "times_s": r.spec_times,
            "baseline_times_s": r.base_times,
            "tokens_per_s": r.spec.tokens_per_second,
            "baseline_tokens_per_s": r.base.tokens_per_second,
            "stop_reason": r.spec.stop_reason,
            "baseline_stop_reason": r.base.stop_reason,
        }))
    return lines


def write_outputs(report: dict[str, Any], records: Sequence[TurnRecord], out_dir: str | Path) -> Path:
    """Write answers.jsonl, the plots, report.md and report.json (last, so a report always has its files)."""
    import json

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SpecgraftError(f"output path {out} is a file; pass a folder to --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / ANSWERS_JSONL,
                      "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in answer_lines(records)))
    write_plots(report, out)
    atomic_write_text(out / REPORT_MD, render_markdown(report))
    atomic_write_json(out / REPORT_JSON, report)
    return out
