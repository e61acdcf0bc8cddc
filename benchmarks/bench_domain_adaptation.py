"""Domain adaptation by warm start: a trained head's MT-bench tau per domain before and after a short adaptation to a
new domain's data (with a replay share of its original data), with identical eval settings.

Stages (each a specgraft command run from this checkout, skipped when its output exists, so a killed run continues;
their wall and CPU times go in the result):

1. ``specgraft eval`` of the base head on MT-bench (``--limit-per-domain``, ``--max-new-tokens``, fp32 unless
   ``--dtype``) -> ``WORK/eval-before``;
2. ``specgraft train RECIPE head.init_from=BASE`` on ``--adapt-data`` with ``data.replay_path=--replay-data`` /
   ``data.replay_share``, ``--steps`` steps at ``--learning-rate`` -> ``WORK/adapted``;
3. the same eval of the adapted head -> ``WORK/eval-after``;
4. with ``--heldout-prompts`` (coding prompts of the adaptation data's kind that it does not contain, e.g. the
   HumanEval tasks after the ones regenerated, written by ``--write-heldout-code``): both heads evaluated on them
   too -> ``WORK/heldout-before``, ``WORK/heldout-after``.

Then a table per MT-bench domain (and the held-out coding set): tau before, after, and the change; the result goes
through ``benchlib`` to ``benchmarks/results/domain_adaptation.json`` (``--result-name``) with a plot beside it.
Decoding is greedy and lossless, so both heads answer every turn with the same tokens: a change is judged by the
paired per-turn differences (``change_stderr``, the standard error of the after-minus-before tau of each turn; beyond
noise past twice that). ``turn_tau_stderr`` is how much tau varies between a domain's turns, for scale.

The adaptation data for the SmolLM2 demonstration: the target's own answers to HumanEval prompts (coding, and not
MT-bench), made with ``--write-code-prompts`` and ``specgraft regenerate``:

    python benchmarks/bench_domain_adaptation.py --write-code-prompts data/code-prompts.jsonl --code-prompts 120 \\
        --write-heldout-code data/code-heldout.jsonl --heldout-code 24
    specgraft regenerate --model runs/smollm2-135m-instruct --data data/code-prompts.jsonl --max-new-tokens 160 \\
        --batch-size 32 --threads 2 --dtype bfloat16 --out data/code-smollm2.jsonl
    python benchmarks/bench_domain_adaptation.py --base-head runs/eagle3-smollm2-135m-instruct/head \\
        --target runs/smollm2-135m-instruct --adapt-data data/code-smollm2.jsonl \\
        --replay-data data/sharegpt-smollm2.jsonl --heldout-prompts data/code-heldout.jsonl --steps 30 \\
        --learning-rate 1e-4 --replay-share 0.5 --warmup-steps 5 --work runs/adapt-code --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, save_png, write_result
from benchlib.stages import StageLog, answered_turns, run_stage, specgraft

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
MT_BENCH = SHARED / "mt_bench" / "question.jsonl"
HUMANEVAL = SHARED / "humaneval" / "HumanEval.jsonl.gz"
RECIPE = ROOT / "recipes" / "eagle3" / "smollm2-135m-instruct.yaml"
CODE_REQUEST = "Complete this Python function:\n\n```python\n{prompt}```"


def humaneval_tasks(humaneval: Path) -> list[dict[str, Any]]:
    from specgraft.evaluation.prompts import read_jsonl

    return [record for _, record in read_jsonl(humaneval)]


def code_conversations(humaneval: Path, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` HumanEval tasks as one-user-turn conversations (``messages`` rows) asking the model to
    complete the function: prompts for the target to answer (``specgraft regenerate``)."""
    return [{"id": task["task_id"],
             "messages": [{"role": "user", "content": CODE_REQUEST.format(prompt=task["prompt"])}]}
            for task in humaneval_tasks(humaneval)[:limit]]


def heldout_code_questions(humaneval: Path, start: int, count: int) -> list[dict[str, Any]]:
    """HumanEval tasks ``start .. start+count-1`` (none of the adaptation data's first ``start``), asked the same way,
    as FastChat questions of domain ``humaneval``: the coding domain measured on the adaptation's own kind of text."""
    return [{"question_id": task["task_id"], "category": "humaneval",
             "turns": [CODE_REQUEST.format(prompt=task["prompt"])]}
            for task in humaneval_tasks(humaneval)[start:start + count]]


def write_jsonl(rows: Sequence[Mapping[str, Any]], out: Path) -> None:
    from specgraft.utils.io import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def eval_command(head: Path, target: Path, out: Path, args: argparse.Namespace,
                 prompts: Path | None = None) -> list[str]:
    """The one eval both heads get (only the head and the output folder differ), on MT-bench or on ``prompts`` (every
    prompt of that file). tau is what is compared: the stock kernels spare the eval its second plain-decoding run
    (the one under faster kernels, for the speedup)."""
    limit = ["--limit-per-domain", str(args.limit_per_domain)] if prompts is None else []
    return specgraft("eval", "--target", str(target), "--head", str(head), "--prompts", str(prompts or args.questions),
                     *limit, "--max-new-tokens", str(args.max_new_tokens),
                     "--dtype", args.dtype, "--attention-kernel", "stock", "--linear-kernel", "stock",
                     *(["--mode", "chain", "--k", str(args.chain)] if args.chain else []),
                     "--threads", str(args.threads), "--no-progress", "--out", str(out))


def adapt_command(args: argparse.Namespace, out: Path) -> list[str]:
    overrides = [f"model.name_or_path={args.target}", f"model.dtype={args.dtype}", f"head.init_from={args.base_head}",
                 f"data.path={args.adapt_data}", f"data.replay_path={args.replay_data}",
                 f"data.replay_share={args.replay_share}", f"training.max_steps={args.steps}",
                 f"training.learning_rate={args.learning_rate}", f"training.warmup_steps={args.warmup_steps}",
                 f"training.checkpoint_every={args.steps}", f"output.dir={out}", "tracking.backend=none",
                 *args.override]
    return specgraft("train", str(args.recipe), *overrides, "--threads", str(args.threads), "--no-progress")


def answered_taus(report_dir: Path) -> dict[tuple[str, str, int], float]:
    """tau of every answered turn, keyed by (domain, prompt id, turn), from the eval's answers file."""
    return {(str(row.get("domain", "?")), prompt_id, turn): float(row["tau"])
            for (prompt_id, turn), row in answered_turns(report_dir).items() if row.get("tau") is not None}


def turn_taus(report_dir: Path) -> dict[str, list[float]]:
    """tau of every answered turn per domain, from the eval's answers file (accepted drafts per target forward)."""
    out: dict[str, list[float]] = {}
    for (domain, _, _), tau in answered_taus(report_dir).items():
        out.setdefault(domain, []).append(tau)
    return out


def paired_changes(before_dir: Path, after_dir: Path) -> dict[str, list[float]]:
    """Per domain, the after-minus-before tau of every turn both evals answered (the same tokens: decoding is lossless
    and greedy), so a domain's change is judged against the spread of its own turns' changes."""
    before, after = answered_taus(before_dir), answered_taus(after_dir)
    out: dict[str, list[float]] = {}
    for key in sorted(before.keys() & after.keys()):
        out.setdefault(key[0], []).append(after[key] - before[key])
    return out


def standard_error(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def domain_values(by_domain: Mapping[str, Sequence[float]], domain: str) -> list[float]:
    """The values of ``domain`` (of every domain for ``overall``)."""
    return [v for vs in by_domain.values() for v in vs] if domain == "overall" else list(by_domain.get(domain, []))


def domain_table(before: Mapping[str, Any], after: Mapping[str, Any], spread: Mapping[str, Sequence[float]],
                 changes: Mapping[str, Sequence[float]] | None = None) -> list[dict[str, Any]]:
    """One row per domain of both reports (and ``overall``): tau before, after, the change, the before-run's standard
    error of the per-turn tau (how much the domain's prompts differ) and, given ``changes`` (:func:`paired_changes`),
    the standard error of the per-turn change, the noise a change is judged by (else the per-turn spread is)."""
    rows = []
    for domain in [*before["domains"], "overall"]:
        b = before["overall"] if domain == "overall" else before["domains"].get(domain)
        a = after["overall"] if domain == "overall" else after["domains"].get(domain)
        if not b or not a or b.get("tau") is None or a.get("tau") is None:
            continue
        error = standard_error(domain_values(spread, domain))
        change_error = standard_error(domain_values(changes, domain)) if changes is not None else None
        noise = change_error if changes is not None else error
        change = a["tau"] - b["tau"]
        rows.append({"domain": domain, "tau_before": round(b["tau"], 3), "tau_after": round(a["tau"], 3),
                     "change": round(change, 3), "relative_change": round(change / b["tau"], 3),
                     "turn_tau_stderr": round(error, 3) if error is not None else None,
                     "change_stderr": round(change_error, 3) if change_error is not None else None,
                     "beyond_noise": abs(change) > 2 * noise if noise is not None else None,
                     "speedup_before": b.get("speedup_ratio_of_totals"),
                     "speedup_after": a.get("speedup_ratio_of_totals"),
                     "lossless_after": a.get("lossless_passed")})
    return rows


def plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """The change of tau per domain with whiskers of twice its noise (the paired per-turn change's standard error,
    else the before-run's per-turn spread): a bar whose whisker crosses zero is within noise."""
    import textwrap

    import matplotlib
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    palette = matplotlib.colormaps["tab10"]
    xs = list(range(len(rows)))
    noise = [2 * (r.get("change_stderr") or r["turn_tau_stderr"] or 0) for r in rows]
    colors = [palette(3) if r.get("beyond_noise") and r["change"] < 0 else
              palette(2) if r.get("beyond_noise") else palette(7) for r in rows]
    ax.bar(xs, [r["change"] for r in rows], 0.6, yerr=noise, capsize=3, color=colors)
    ax.axhline(0, color="black", linewidth=0.8)
    labels = [f"{r['domain']}\n{r['tau_before']:.2f}->{r['tau_after']:.2f}" for r in rows]
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tau after - tau before (whiskers: 2 x noise)")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=9)
    return save_png(fig, path, dpi=100)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-code-prompts", type=Path, metavar="OUT",
                        help="Only write HumanEval coding prompts (for specgraft regenerate) to OUT and exit.")
    parser.add_argument("--code-prompts", type=int, default=120, help="HumanEval tasks to write (of 164).")
    parser.add_argument("--write-heldout-code", type=Path, metavar="OUT",
                        help="Only write the --heldout-code HumanEval tasks after the first --code-prompts, as "
                             "FastChat questions for --heldout-prompts, to OUT and exit (may go with "
                             "--write-code-prompts).")
    parser.add_argument("--heldout-code", type=int, default=24, help="Held-out HumanEval tasks to write.")
    parser.add_argument("--heldout-prompts", type=Path,
                        help="Coding prompts kept out of --adapt-data, evaluated before and after as well.")
    parser.add_argument("--humaneval", type=Path, default=HUMANEVAL)
    parser.add_argument("--base-head", type=Path, help="The trained head to adapt (its head/ folder).")
    parser.add_argument("--target", type=Path, help="Its target (transformers folder).")
    parser.add_argument("--adapt-data", type=Path, help="The new domain's training rows.")
    parser.add_argument("--replay-data", type=Path, help="The head's original training rows (replayed).")
    parser.add_argument("--replay-share", type=float, default=0.5)
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="The recipe the base head was trained with.")
    parser.add_argument("--steps", type=int, default=30, help="Adaptation steps (a tenth of the recipe's 300).")
    parser.add_argument("--learning-rate", type=float, default=1e-4,
                        help="A tenth of the recipe's (higher: more of the new domain, more forgetting).")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="More recipe overrides for the adaptation run (repeatable).")
    parser.add_argument("--questions", type=Path, default=MT_BENCH)
    parser.add_argument("--limit-per-domain", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--chain", type=int, default=0,
                        help="Evaluate a chain of this many drafts (default 0: the head's default tree, which costs "
                             "far more per step on a CPU).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, help="Folder of the stages' outputs (resumable).")
    add_result_arguments(parser, "domain_adaptation")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_code_prompts is not None or args.write_heldout_code is not None:
        if not args.humaneval.is_file():
            print(f"error: {args.humaneval} is absent; pass --humaneval with HumanEval.jsonl(.gz)", file=sys.stderr)
            return 2
        if args.write_code_prompts is not None:
            rows = code_conversations(args.humaneval, args.code_prompts)
            write_jsonl(rows, args.write_code_prompts)
            print(f"{len(rows)} coding prompts -> {args.write_code_prompts}")
        if args.write_heldout_code is not None:
            rows = heldout_code_questions(args.humaneval, args.code_prompts, args.heldout_code)
            if not rows:
                print(f"error: {args.humaneval} has no task after the first {args.code_prompts}; lower "
                      "--code-prompts", file=sys.stderr)
                return 2
            write_jsonl(rows, args.write_heldout_code)
            print(f"{len(rows)} held-out coding questions -> {args.write_heldout_code}")
        return 0
    needed = {"--base-head": args.base_head, "--target": args.target, "--adapt-data": args.adapt_data,
              "--replay-data": args.replay_data, "--work": args.work}
    absent = [flag for flag, value in needed.items() if value is None]
    missing = [f"{flag} {value}" for flag, value in {**needed, "--heldout-prompts": args.heldout_prompts}.items()
               if value is not None and flag != "--work" and not value.exists()]
    if absent or missing or not args.questions.is_file():
        problem = (f"{', '.join(absent)} required" if absent else f"not found: {'; '.join(missing)}" if missing
                   else f"{args.questions} is absent; pass --questions with an MT-bench question.jsonl")
        print(f"error: {problem}", file=sys.stderr)
        return 2

    work: Path = args.work
    stages = StageLog(work / "stages.json")
    logs = work / "logs"
    before_dir, adapted_dir, after_dir = work / "eval-before", work / "adapted", work / "eval-after"
    if not (before_dir / "report.json").is_file():
        stages["eval_before"] = run_stage("eval_before", eval_command(args.base_head, args.target, before_dir, args),
                                          logs / "eval-before.log")
    if not (adapted_dir / "head" / "head_config.json").is_file():
        stages["adapt"] = run_stage("adapt", adapt_command(args, adapted_dir), logs / "adapt.log")
    if not (after_dir / "report.json").is_file():
        stages["eval_after"] = run_stage("eval_after", eval_command(adapted_dir / "head", args.target, after_dir, args),
                                         logs / "eval-after.log")
    heldout_dirs = (work / "heldout-before", work / "heldout-after")
    if args.heldout_prompts is not None:
        for stage, head, out in (("heldout_before", args.base_head, heldout_dirs[0]),
                                 ("heldout_after", adapted_dir / "head", heldout_dirs[1])):
            if not (out / "report.json").is_file():
                stages[stage] = run_stage(stage, eval_command(head, args.target, out, args, args.heldout_prompts),
                                          logs / f"{out.name}.log")

    before = json.loads((before_dir / "report.json").read_text(encoding="utf-8"))
    after = json.loads((after_dir / "report.json").read_text(encoding="utf-8"))
    summary_path = adapted_dir / "train_summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    rows = domain_table(before, after, turn_taus(before_dir), paired_changes(before_dir, after_dir))
    if args.heldout_prompts is not None:
        held = [json.loads((d / "report.json").read_text(encoding="utf-8")) for d in heldout_dirs]
        rows += [{**row, "domain": f"{row['domain']} (held out)"}
                 for row in domain_table(*held, turn_taus(heldout_dirs[0]), paired_changes(*heldout_dirs))
                 if row["domain"] != "overall"]
    budget = {"steps": args.steps, "learning_rate": args.learning_rate, "replay_share": args.replay_share,
              "adapt_data": str(args.adapt_data), "replay_data": str(args.replay_data),
              "base_head": str(args.base_head), "recipe": str(args.recipe),
              **{key: summary[key] for key in ("tokens", "target_tokens", "train_seconds", "wall_seconds",
                                               "tokens_per_s") if key in summary}}
    heldout = " and on held-out coding prompts" if args.heldout_prompts else ""
    title = (f"Domain adaptation by warm start: tau per MT-bench domain{heldout} "
             f"before and after {args.steps} steps on coding data at learning rate {args.learning_rate:g} with "
             f"{args.replay_share:.0%} replay")
    path = write_result(args.result_name, {"domains": rows}, title=title, dtype=args.dtype, threads=args.threads,
                        details={"budget": budget, "stages": dict(stages), "train_summary": summary,
                                 "eval": {"questions": str(args.questions), "limit_per_domain": args.limit_per_domain,
                                          "heldout_prompts": str(args.heldout_prompts or "") or None,
                                          "max_new_tokens": args.max_new_tokens}},
                        results_dir=args.results_dir)
    print(f"plot: {plot(rows, path.with_suffix('.png'), title)}")
    print(f"{'domain':<22} {'before':>7} {'after':>7} {'change':>7} {'+-':>6}  beyond noise")
    for row in rows:
        stderr = f"{row['change_stderr']:.3f}" if row["change_stderr"] is not None else "-"
        print(f"{row['domain']:<22} {row['tau_before']:>7.3f} {row['tau_after']:>7.3f} {row['change']:>+7.3f} "
              f"{stderr:>6}  {row['beyond_noise']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
