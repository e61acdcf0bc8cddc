"""Domain adaptation by warm start: a trained head's MT-bench tau per domain before and after a short adaptation to a
new domain's data (with a replay share of its original data), with identical eval settings.

Stages (each a specgraft command run from this checkout, skipped when its output exists, so a killed run continues;
their wall and CPU times go in the result):

1. ``specgraft eval`` of the base head on MT-bench (``--limit-per-domain``, ``--max-new-tokens``, fp32 unless
   ``--dtype``) -> ``WORK/eval-before``;
2. ``specgraft train RECIPE head.init_from=BASE`` on ``--adapt-data`` with ``data.replay_path=--replay-data`` /
   ``data.replay_share``, ``--steps`` steps at ``--learning-rate`` -> ``WORK/adapted``;
3. the same eval of the adapted head -> ``WORK/eval-after``.

Then a table per MT-bench domain: tau before, after, and the change; the result goes through ``benchlib`` to
``benchmarks/results/domain_adaptation.json`` (``--result-name``) with a plot beside it. tau is deterministic
(greedy decoding), so "within noise" is judged against how much tau varies between prompts of a domain: the table
gives each domain's per-turn spread (the standard error of its turns' tau, before adaptation).

The adaptation data for the SmolLM2 demonstration: the target's own answers to HumanEval prompts (coding, and not
MT-bench), made with ``--write-code-prompts`` and ``specgraft regenerate``:

    python benchmarks/bench_domain_adaptation.py --write-code-prompts data/code-prompts.jsonl --code-prompts 160
    specgraft regenerate --model runs/smollm2-135m-instruct --data data/code-prompts.jsonl --max-new-tokens 160 \\
        --batch-size 32 --threads 2 --dtype bfloat16 --out data/code-smollm2.jsonl
    python benchmarks/bench_domain_adaptation.py --base-head runs/eagle3-smollm2-135m-instruct/head \\
        --target runs/smollm2-135m-instruct --adapt-data data/code-smollm2.jsonl \\
        --replay-data data/sharegpt-smollm2.jsonl --steps 30 --learning-rate 3e-4 --work runs/adapt-code --threads 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, save_png, write_result
from benchlib.stages import StageLog, run_stage, specgraft

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
MT_BENCH = SHARED / "mt_bench" / "question.jsonl"
HUMANEVAL = SHARED / "humaneval" / "HumanEval.jsonl.gz"
RECIPE = ROOT / "recipes" / "eagle3" / "smollm2-135m-instruct.yaml"
CODE_REQUEST = "Complete this Python function:\n\n```python\n{prompt}```"


def code_conversations(humaneval: Path, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` HumanEval tasks as one-user-turn conversations (``messages`` rows) asking the model to
    complete the function: prompts for the target to answer (``specgraft regenerate``)."""
    opener = gzip.open if humaneval.suffix == ".gz" else open
    with opener(humaneval, "rt", encoding="utf-8") as fh:
        tasks = [json.loads(line) for line in fh if line.strip()]
    return [{"id": task["task_id"],
             "messages": [{"role": "user", "content": CODE_REQUEST.format(prompt=task["prompt"])}]}
            for task in tasks[:limit]]


def eval_command(head: Path, target: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The one eval both heads get (only the head and the output folder differ). tau is what is compared: the stock
    kernels spare the eval its second plain-decoding run (the one under faster kernels, for the speedup)."""
    return specgraft("eval", "--target", str(target), "--head", str(head), "--prompts", str(args.questions),
                     "--limit-per-domain", str(args.limit_per_domain), "--max-new-tokens", str(args.max_new_tokens),
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


def turn_taus(report_dir: Path) -> dict[str, list[float]]:
    """tau of every answered turn per domain, from the eval's answers file (accepted drafts per target forward)."""
    answers = report_dir / "answers.jsonl"
    out: dict[str, list[float]] = {}
    if not answers.is_file():
        return out
    for line in answers.read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else None
        if row and row.get("tau") is not None:
            out.setdefault(row.get("domain", "?"), []).append(float(row["tau"]))
    return out


def standard_error(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def domain_table(before: Mapping[str, Any], after: Mapping[str, Any],
                 spread: Mapping[str, Sequence[float]]) -> list[dict[str, Any]]:
    """One row per domain of both reports (and ``overall``): tau before, after, the change, and the before-run's
    standard error of the per-turn tau (how much the domain's prompts differ: the noise a change is judged by)."""
    rows = []
    for domain in [*before["domains"], "overall"]:
        b = before["overall"] if domain == "overall" else before["domains"].get(domain)
        a = after["overall"] if domain == "overall" else after["domains"].get(domain)
        if not b or not a or b.get("tau") is None or a.get("tau") is None:
            continue
        turns = [t for d, ts in spread.items() for t in ts] if domain == "overall" else spread.get(domain, [])
        error = standard_error(turns)
        change = a["tau"] - b["tau"]
        rows.append({"domain": domain, "tau_before": round(b["tau"], 3), "tau_after": round(a["tau"], 3),
                     "change": round(change, 3), "relative_change": round(change / b["tau"], 3),
                     "turn_tau_stderr": round(error, 3) if error is not None else None,
                     "beyond_noise": abs(change) > 2 * error if error is not None else None,
                     "speedup_before": b.get("speedup_ratio_of_totals"),
                     "speedup_after": a.get("speedup_ratio_of_totals"),
                     "lossless_after": a.get("lossless_passed")})
    return rows


def plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """tau per domain before and after adaptation, with the before-run's per-turn standard error as error bars."""
    import matplotlib
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    palette = matplotlib.colormaps["tab10"]
    xs = range(len(rows))
    errors = [r["turn_tau_stderr"] or 0 for r in rows]
    ax.bar([x - 0.2 for x in xs], [r["tau_before"] for r in rows], 0.4, yerr=errors, capsize=3,
           label="before", color=palette(0))
    ax.bar([x + 0.2 for x in xs], [r["tau_after"] for r in rows], 0.4, label="after", color=palette(1))
    ax.set_xticks(list(xs), [r["domain"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    return save_png(fig, path, dpi=100)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-code-prompts", type=Path, metavar="OUT",
                        help="Only write HumanEval coding prompts (for specgraft regenerate) to OUT and exit.")
    parser.add_argument("--code-prompts", type=int, default=160, help="HumanEval tasks to write (of 164).")
    parser.add_argument("--humaneval", type=Path, default=HUMANEVAL)
    parser.add_argument("--base-head", type=Path, help="The trained head to adapt (its head/ folder).")
    parser.add_argument("--target", type=Path, help="Its target (transformers folder).")
    parser.add_argument("--adapt-data", type=Path, help="The new domain's training rows.")
    parser.add_argument("--replay-data", type=Path, help="The head's original training rows (replayed).")
    parser.add_argument("--replay-share", type=float, default=0.3)
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="The recipe the base head was trained with.")
    parser.add_argument("--steps", type=int, default=30, help="Adaptation steps (a tenth of the recipe's 300).")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=3)
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
    if args.write_code_prompts is not None:
        if not args.humaneval.is_file():
            print(f"error: {args.humaneval} is absent; pass --humaneval with HumanEval.jsonl(.gz)", file=sys.stderr)
            return 2
        rows = code_conversations(args.humaneval, args.code_prompts)
        args.write_code_prompts.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.write_code_prompts.with_name(f".{args.write_code_prompts.name}.tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(args.write_code_prompts)
        print(f"{len(rows)} coding prompts -> {args.write_code_prompts}")
        return 0
    needed = {"--base-head": args.base_head, "--target": args.target, "--adapt-data": args.adapt_data,
              "--replay-data": args.replay_data, "--work": args.work}
    absent = [flag for flag, value in needed.items() if value is None]
    missing = [f"{flag} {value}" for flag, value in needed.items()
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

    before = json.loads((before_dir / "report.json").read_text(encoding="utf-8"))
    after = json.loads((after_dir / "report.json").read_text(encoding="utf-8"))
    summary_path = adapted_dir / "train_summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    rows = domain_table(before, after, turn_taus(before_dir))
    budget = {"steps": args.steps, "learning_rate": args.learning_rate, "replay_share": args.replay_share,
              "adapt_data": str(args.adapt_data), "replay_data": str(args.replay_data),
              "base_head": str(args.base_head), "recipe": str(args.recipe),
              **{key: summary[key] for key in ("tokens", "target_tokens", "train_seconds", "wall_seconds",
                                               "tokens_per_s") if key in summary}}
    title = ("Domain adaptation by warm start: MT-bench tau per domain before and after "
             f"{args.steps} steps on coding data with {args.replay_share:.0%} replay")
    path = write_result(args.result_name, {"domains": rows}, title=title, dtype=args.dtype, threads=args.threads,
                        details={"budget": budget, "stages": dict(stages), "train_summary": summary,
                                 "eval": {"questions": str(args.questions), "limit_per_domain": args.limit_per_domain,
                                          "max_new_tokens": args.max_new_tokens}},
                        results_dir=args.results_dir)
    print(f"plot: {plot(rows, path.with_suffix('.png'), title)}")
    print(f"{'domain':<12} {'before':>7} {'after':>7} {'change':>7} {'stderr':>7}  beyond noise")
    for row in rows:
        stderr = f"{row['turn_tau_stderr']:.3f}" if row["turn_tau_stderr"] is not None else "-"
        print(f"{row['domain']:<12} {row['tau_before']:>7.3f} {row['tau_after']:>7.3f} {row['change']:>+7.3f} "
              f"{stderr:>7}  {row['beyond_noise']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
