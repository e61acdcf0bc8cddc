"""Acceptance vs training budget: held-out greedy tau of every head family along one training run, per target.

For each registered head family (``specgraft.heads.registry.family_names()``, so a new family is measured as soon as
it ships a ``recipes/<family>/stories260k.yaml``) and each target:

* ``stories260k``: llama2.c stories260K converted to transformers, trained on the head of ``tinystories_train.txt``
  and evaluated on the first sentences of lines at its END (``benchlib.stories.prepare_stories260k``: no held-out
  paragraph is trained on);
* ``embedded``: the target shipped inside specgraft (``specgraft/defaults/model``), trained on its own corpus and
  evaluated on the demo's held-out prompts (``specgraft.demos.stories.write_demo_data`` without a target: the
  corpus's documents, not the demo's self-distilled text),

the shipped ``recipes/<family>/stories260k.yaml`` is trained ONCE through the real command line
(``specgraft train RECIPE model.name_or_path=... data.path=... training.max_steps=STEPS
training.checkpoint_every=EVAL_EVERY ...``), keeping every checkpoint. Each checkpoint becomes a head the way the
final one does, with the product's own resume: ``specgraft train RUN/recipe.yaml output.dir=D
training.max_steps=STEP --resume`` on a folder holding only that checkpoint loads it, trains nothing and writes
``D/head`` after the family's post-training measurement (Medusa's per-head accuracies, which its static tree is
built from); the last step is the run's own ``head/``. Every head is evaluated with ``run_eval`` at its family's
default drafting setting (what ``specgraft eval --head`` drafts), greedy, every answer checked against plain
decoding.

Writes ``--out`` (JSON: one row per (family, target, step) with tau and the lossless check, the stage timings with
CPU seconds, the settings and the command), a PNG beside it (tau vs training steps, one line per family, one panel
per target) and prints the table. Every stage is skipped when its output exists (training resumes from its newest
checkpoint), so a killed run continues where it stopped. Exits 1 when a lossless check fails or a
``--fail-below FAMILY[@TARGET]=TAU`` threshold is not met by the final step's tau; 2 on bad input.

    python benchmarks/bench_acceptance.py --out runs/acceptance/acceptance.json --threads 1
    python benchmarks/bench_acceptance.py --out /tmp/acc/acc.json --quick          # smoke run (a few minutes)
    python benchmarks/bench_acceptance.py --out runs/acc.json --families eagle3 medusa --fail-below eagle3=3.0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, save_png, write_result
from benchlib.stages import StageLog, run_stage, specgraft
from benchlib.stories import prepare_stories260k

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("stories260k", "embedded")
#: The recipe every family is trained with on both targets (its head section, optimiser and schedule).
RECIPE = "recipes/{family}/stories260k.yaml"
#: --quick: a wiring check (seconds of training per run), not a measurement.
QUICK = {"steps": 4, "eval_every": 2, "prompts": 1, "max_new_tokens": 16, "micro_batch": 2, "max_length": 64}


# -- pure logic (tested in tests/scripts/test_bench_acceptance.py) ------------------------------------------------


def eval_steps(steps: int, every: int) -> list[int]:
    """The optimizer steps whose checkpoint is evaluated: every ``every`` steps, and always the last."""
    if steps < 1 or every < 1:
        raise ValueError(f"--steps and --eval-every must be at least 1, got {steps} and {every}")
    points = list(range(every, steps + 1, every))
    return points if points and points[-1] == steps else [*points, steps]


def parse_thresholds(items: Iterable[str], families: Sequence[str], targets: Sequence[str]
                     ) -> dict[tuple[str, str | None], float]:
    """``FAMILY=TAU`` (every target) or ``FAMILY@TARGET=TAU`` -> {(family, target or None): tau}; ValueError names
    the bad item and the accepted spelling."""
    thresholds: dict[tuple[str, str | None], float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        family, _, target = key.partition("@")
        try:
            tau = float(value)
        except ValueError:
            tau = math.nan
        if not sep or not math.isfinite(tau):
            raise ValueError(f"--fail-below {item!r} is not FAMILY=TAU or FAMILY@TARGET=TAU (e.g. eagle3=3.0)")
        if family not in families:
            raise ValueError(f"--fail-below {item!r} names family {family!r}, which is not measured; use one of "
                             f"{', '.join(families)}")
        if target and target not in targets:
            raise ValueError(f"--fail-below {item!r} names target {target!r}, which is not measured; use one of "
                             f"{', '.join(targets)}")
        thresholds[(family, target or None)] = tau
    return thresholds


def final_rows(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], Mapping[str, Any]]:
    """(family, target) -> the row of its last evaluated step."""
    last: dict[tuple[str, str], Mapping[str, Any]] = {}
    for row in rows:
        key = (row["family"], row["target"])
        if key not in last or row["step"] > last[key]["step"]:
            last[key] = row
    return last


def regressions(rows: Iterable[Mapping[str, Any]], thresholds: Mapping[tuple[str, str | None], float]) -> list[str]:
    """One line per threshold the final step's tau misses (a target-specific threshold wins over FAMILY=TAU); a
    (family, target) the threshold covers but that has no row is a failure too (nothing measured is no pass)."""
    finals = final_rows(rows)
    measured_targets = sorted({target for _, target in finals})
    failures = []
    for (family, target), tau_min in sorted(thresholds.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        for each in [target] if target else measured_targets or ["(any)"]:
            if target is None and (family, each) in thresholds:
                continue  # FAMILY@TARGET overrides FAMILY for that target
            row = finals.get((family, each))
            if row is None:
                failures.append(f"{family} on {each}: no tau measured (threshold {tau_min:.2f})")
            elif not row["tau"] >= tau_min:
                failures.append(f"{family} on {each}: final tau {row['tau']:.2f} at step {row['step']} is below "
                                f"{tau_min:.2f}")
    return failures


def curve_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: one line per (target, family), one column per evaluated step; a failed lossless check is marked."""
    rows = list(rows)
    steps = sorted({r["step"] for r in rows})
    cells: dict[tuple[str, str], dict[int, str]] = {}
    for r in rows:
        mark = "" if r["lossless"] else " (NOT lossless)"
        cells.setdefault((r["target"], r["family"]), {})[r["step"]] = f"{r['tau']:.2f}{mark}"
    lines = ["| target | family | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|---|" + "---:|" * len(steps)]
    for (target, family), by_step in cells.items():
        lines.append(f"| {target} | {family} | " + " | ".join(by_step.get(s, "-") for s in steps) + " |")
    return "\n".join(lines)


def plot_curves(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """tau vs training steps, one panel per target, one line per family (a failed lossless check: a red x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(1, len(targets), figsize=(5.5 * len(targets), 4.2), squeeze=False)
    for ax, target in zip(axes[0], targets):
        mine = [r for r in rows if r["target"] == target]
        for family in dict.fromkeys(r["family"] for r in mine):
            points = sorted((r["step"], r["tau"], r["lossless"]) for r in mine if r["family"] == family)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=family)
            bad = [p for p in points if not p[2]]
            if bad:
                ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", color="red", s=80, zorder=3)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(sorted({r["step"] for r in mine}))
        ax.set_title(target)
        ax.set_xlabel("training steps")
        ax.set_ylabel("held-out greedy tau (tokens per target forward)")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, path)


# -- targets ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TargetData:
    """A target with its training text and held-out prompts."""

    name: str
    model_dir: Path
    train_file: Path
    prompts_file: Path
    num_prompts: int
    about: str


def prepare_target(name: str, work: Path, args: argparse.Namespace) -> TargetData:
    """The target's model folder, training data and held-out prompt file (written under ``work/<name>``)."""
    folder = work / name
    if name == "stories260k":
        model_dir, split = prepare_stories260k(folder, args.prompts)
        return TargetData(name, model_dir, Path(split["train_text"]), Path(split["prompts_file"]),
                          split["num_prompts"], f"{split['num_prompts']} held-out TinyStories prompts "
                          f"(the last {split['heldout_lines']} lines of tinystories_train.txt, not trained on)")
    from specgraft.defaults.target import default_target_path
    from specgraft.demos.stories import FULL, write_demo_data

    budget = dataclasses.replace(FULL, prompts_per_domain=args.prompts)
    train_file, prompts_file = write_demo_data(folder / "data", budget)
    num = len(prompts_file.read_text(encoding="utf-8").splitlines())
    return TargetData(name, default_target_path(), train_file, prompts_file, num,
                      f"{num} demo prompts (the corpus's disjoint prompt stream), {budget.docs_per_domain} training "
                      "documents per domain")


# -- stages -------------------------------------------------------------------------------------------------------


def train_family(family: str, target: TargetData, work: Path, args: argparse.Namespace,
                 stages: dict[str, Any]) -> Path:
    """Train ``family``'s recipe on ``target`` once, keeping a checkpoint every --eval-every steps; the run folder.
    Skipped when the run finished with --steps; resumed from its newest checkpoint when it was interrupted."""
    run_dir = work / "runs" / target.name / family
    summary = run_dir / "train_summary.json"
    if summary.is_file():
        done = json.loads(summary.read_text(encoding="utf-8"))["steps"]
        if done != args.steps:
            raise SystemExit(f"error: {run_dir} was trained for {done} steps, not --steps {args.steps}; pass "
                             f"--steps {done}, or another --work (a curve is one run's checkpoints)")
        return run_dir
    points = eval_steps(args.steps, args.eval_every)
    overrides = [f"model.name_or_path={target.model_dir}", f"data.path={target.train_file}",
                 f"data.cache_dir={work / 'cache'}", f"training.max_steps={args.steps}",
                 f"training.checkpoint_every={args.eval_every}", f"training.keep_checkpoints={len(points)}",
                 f"output.dir={run_dir}", "output.overwrite=true"]
    if args.micro_batch:
        overrides.append(f"training.micro_batch_size={args.micro_batch}")
    if args.max_length:
        overrides.append(f"data.max_length={args.max_length}")
    if args.quick:
        overrides.append("training.warmup_steps=1")
    resume = ["--resume"] if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()) else []
    cmd = specgraft("train", str(ROOT / RECIPE.format(family=family)), *overrides, *resume, "--no-progress",
                    "--threads", str(args.threads))
    log = work / "logs" / f"train-{target.name}-{family}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    stages[f"train/{target.name}/{family}"] = {**run_stage(f"train {family} on {target.name}", cmd, log),
                                               "command": " ".join(cmd[1:])}
    return run_dir


def head_at(run_dir: Path, step: int, steps: int, work: Path, args: argparse.Namespace,
            stages: dict[str, Any]) -> Path:
    """The head of checkpoint ``step`` of ``run_dir``, finished as the final head is (``specgraft train --resume``
    on a folder holding only that checkpoint: nothing is trained, the family's post-training measurement runs and
    ``head/`` is written); the run's own ``head/`` for the last step."""
    if step == steps:
        return run_dir / "head"
    from specgraft.train.checkpoint import CHECKPOINTS_DIR, checkpoint_name

    dest = work / "heads" / run_dir.relative_to(work / "runs") / checkpoint_name(step)
    if (dest / "head" / "head_config.json").is_file():
        return dest / "head"
    source = run_dir / CHECKPOINTS_DIR / checkpoint_name(step)
    if not source.is_dir():
        raise SystemExit(f"error: {source} is missing (the run kept other checkpoints); delete {run_dir} and rerun, "
                         "or pass the --eval-every it was trained with")
    shutil.rmtree(dest, ignore_errors=True)  # a partial attempt
    shutil.copytree(source, dest / CHECKPOINTS_DIR / source.name)
    cmd = specgraft("train", str(run_dir / "recipe.yaml"), f"output.dir={dest}", f"training.max_steps={step}",
                    "tracking.backend=none", "--resume", "--no-progress", "--threads", str(args.threads))
    log = work / "logs" / f"head-{'-'.join(dest.relative_to(work / 'heads').parts)}.log"
    stages[f"head/{dest.relative_to(work / 'heads')}"] = run_stage(f"head at step {step}", cmd, log)
    shutil.rmtree(dest / CHECKPOINTS_DIR)  # the copy served its purpose; the head is what is evaluated
    return dest / "head"


def evaluate(family: str, target: TargetData, step: int, head_dir: Path, work: Path,
             args: argparse.Namespace) -> dict[str, Any]:
    """run_eval of the head at its family's default setting (skipped when its report exists); the curve's row."""
    out = work / "eval" / target.name / family / f"step-{step}"
    if not (out / "report.json").is_file():
        import torch

        from specgraft.evaluation.prompts import load_prompts
        from specgraft.evaluation.report import EvalSettings, run_eval
        from specgraft.heads.base import load_head
        from specgraft.heads.registry import family_of
        from specgraft.target import load_target

        torch.set_num_threads(args.threads)
        head = load_head(load_target(target.model_dir), head_dir)  # a fresh target: the decoder owns its caches
        entry = family_of(head)
        setting = entry.setting_from_flags()  # the family's defaults, as `specgraft eval --head` drafts
        settings = EvalSettings(max_new_tokens=args.max_new_tokens, repeats=1, warmup=0)
        start = time.process_time()
        run_eval(head.target, entry.drafter(head, setting), load_prompts([target.prompts_file]), out,
                 settings=settings, progress=False,
                 drafter_info={"type": family, "path": str(head_dir), "mode": setting.get("mode"),
                               "setting_source": "defaults", "step": step})
        print(f"  eval {family} on {target.name} at step {step}: {time.process_time() - start:.0f} CPU s",
              flush=True)
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    overall = report["overall"]
    return {"family": family, "target": target.name, "step": step, "tau": overall["tau"],
            "lossless": bool(overall["lossless_passed"]), "lossless_check": overall["lossless_check"],
            "acceptance_by_depth": overall.get("acceptance_by_depth"), "mode": report["drafter"].get("mode"),
            "head": str(head_dir), "report": str(out / "report.json")}


# -- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from specgraft.heads.registry import family_names

    families = family_names()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file (the PNG is written beside it)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: <out without .json>_work)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every training run")
    parser.add_argument("--eval-every", type=int, default=100,
                        help="evaluate a checkpoint every N steps (and the last)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per domain (3 TinyStories domains, "
                        "4 embedded-target domains)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--families", nargs="+", choices=families, default=list(families),
                        help="head families (default: every registered one)")
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default: the recipe's)")
    parser.add_argument("--max-length", type=int, help="tokens per packed sequence (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the tiny targets gain nothing more)")
    parser.add_argument("--fail-below", nargs="*", default=[], metavar="FAMILY[@TARGET]=TAU",
                        help="exit 1 when a family's final-step tau is below TAU (on every target, or on TARGET)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    add_result_arguments(parser, "acceptance-vs-steps", default_help="acceptance-vs-steps, with --quick "
                         "acceptance-vs-steps-quick")
    args = parser.parse_args(argv)
    if args.quick and args.result_name == "acceptance-vs-steps":
        args.result_name = "acceptance-vs-steps-quick"
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for name in ("steps", "eval_every", "prompts", "max_new_tokens", "threads", "micro_batch", "max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    missing = [f for f in args.families if not (ROOT / RECIPE.format(family=f)).is_file()]
    if missing:
        parser.error(f"no stories260K recipe for {', '.join(missing)} ({RECIPE.format(family=missing[0])}); add one "
                     "or leave the family out with --families")
    try:
        args.thresholds = parse_thresholds(args.fail_below, args.families, args.targets)
    except ValueError as exc:
        parser.error(str(exc))
    args.work = args.work or args.out.parent / f"{args.out.stem}_work"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update({"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})  # the child processes too
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    stages = StageLog(work / "stages.json")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    about: dict[str, str] = {}
    for target_name in args.targets:
        target = prepare_target(target_name, work, args)
        about[target_name] = target.about
        print(f"[{target_name}] {target.model_dir}: {target.about}", flush=True)
        for family in args.families:
            run_dir = train_family(family, target, work, args, stages)
            for step in eval_steps(args.steps, args.eval_every):
                head_dir = head_at(run_dir, step, args.steps, work, args, stages)
                row = evaluate(family, target, step, head_dir, work, args)
                rows.append(row)
                print(f"  {family:<7} {target_name:<11} step {step:>5}  tau {row['tau']:.2f}  "
                      f"{row['lossless_check']}", flush=True)

    table = curve_table(rows)
    title = (f"held-out greedy tau vs training steps (recipes/<family>/stories260k.yaml, "
             f"{args.micro_batch or 'recipe'} seqs/step)")
    plot = plot_curves(rows, args.out.with_suffix(".png"), title)
    failures = regressions(rows, args.thresholds)
    not_lossless = [f"{r['family']} on {r['target']} at step {r['step']}: {r['lossless_check']}"
                    for r in rows if not r["lossless"]]
    train_cpu = {k: v.get("cpu_s") for k, v in stages.items() if k.startswith("train/")}
    print(f"\n## Acceptance vs training budget: greedy tau on held-out prompts, max_new_tokens "
          f"{args.max_new_tokens}, {args.threads} thread(s)\n")
    print(table)
    print("\n" + "\n".join(f"- {name}: {text}" for name, text in about.items()))
    print("training CPU s (user+sys): " + ", ".join(f"{k.removeprefix('train/')} {v}" for k, v in train_cpu.items()))
    print(f"plot: {plot}")
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if k != "thresholds"},
              "targets": about, "rows": rows, "table": table, "plot": str(plot), "stages": dict(stages),
              "wall_s": round(time.perf_counter() - started, 1), "regressions": failures,
              "not_lossless": not_lossless}
    from specgraft.utils.io import atomic_write_json

    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    figures = [{key: row[key] for key in ("family", "target", "step", "mode", "tau")}
               | {"acceptance_by_depth": " / ".join(f"{a:.2f}" for a in row["acceptance_by_depth"] or []),
                  "lossless": row["lossless_check"]} for row in rows]
    write_result(args.result_name, figures, title=title, dtype="float32", threads=args.threads,
                 results_dir=args.results_dir,
                 details={"targets": about, "train_cpu_s": train_cpu, "regressions": failures,
                          "full_record": str(args.out)})
    for line in not_lossless:
        print(f"FAILED lossless: {line}", file=sys.stderr)
    for line in failures:
        print(f"REGRESSION: {line}", file=sys.stderr)
    return 1 if failures or not_lossless else 0


if __name__ == "__main__":
    sys.exit(main())
