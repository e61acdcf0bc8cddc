"""Running specgraft commands as a benchmark's stages: timed child processes (wall and CPU seconds, peak RSS), a
stage log that survives a resumed run, ``specgraft train`` launched on the stories260K split, per-run recipe
overrides, the trainer's logged curves, and report figures formatted for tables."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def specgraft(*args: str) -> list[str]:
    """The command line of ``specgraft ARGS`` run from this checkout."""
    return [sys.executable, "-m", "specgraft", *args]


def scratch_folder(args: argparse.Namespace) -> Path:
    """``--work``, or ``<--out stem>_work`` beside ``--out``."""
    return args.work or args.out.parent / f"{args.out.stem}_work"


def run_stage(name: str, cmd: list[str], log: Path) -> dict[str, Any]:
    """Run one command from the repository root, its output to ``log``; returns wall time, the child's CPU time
    (user + system: what a loaded shared machine does not inflate) and its peak RSS (MiB). Exits naming the log
    when the command fails."""
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"error: stage {name} failed with exit status {code}; see {log} (rerun to continue)")
    return {"seconds": round(seconds, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


class StageLog(dict):
    """Stage timings kept in ``WORK/stages.json`` across runs (a resumed benchmark still reports every stage)."""

    def __init__(self, path: Path) -> None:
        super().__init__(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {})
        self.path = path

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=2), encoding="utf-8")
        tmp.replace(self.path)


def parse_run_overrides(items: Iterable[str], runs: Iterable[str], flag: str = "--override") -> dict[str, list[str]]:
    """``["eagle3:training.max_steps=100"]`` -> ``{"eagle3": ["training.max_steps=100"]}``: recipe overrides per
    named run of a benchmark. Exits with one ``error:`` line (status 2) naming the flag for a malformed item or an
    unknown run."""
    names = tuple(runs)
    out: dict[str, list[str]] = {}
    for item in items:
        run, sep, override = item.partition(":")
        if not sep or run not in names or "=" not in override:
            print(f"error: {flag} {item!r} must be RUN:key=value with RUN one of {', '.join(names)}", file=sys.stderr)
            raise SystemExit(2)
        out.setdefault(run, []).append(override)
    return out


def read_loss_curve(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars the trainer logged to tensorboard (loss, per-head top-1, lr, ...), tag -> [(step, value)]."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    curves: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(run_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            curves.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(set(points)) for tag, points in curves.items()}


def train_one(name: str, recipe: str, features: str, model_dir: Path, split: Mapping[str, Any], work: Path,
              args: argparse.Namespace, extra_overrides: tuple[str, ...] = (), run_name: str | None = None
              ) -> dict[str, Any]:
    """``specgraft train RECIPE overrides`` on the stories260K split in a child process (``args.steps`` steps of
    ``args.micro_batch`` rows on ``args.threads`` threads; output in ``work/runs/<run_name or name-features>``);
    returns train_summary.json plus run facts."""
    out_dir = work / "runs" / (run_name or f"{name}-{features}")
    overrides = [
        f"model.name_or_path={model_dir}",
        f"data.path={split['train_text']}",
        f"data.cache_dir={work / 'cache'}",
        f"training.max_steps={args.steps}",
        f"training.micro_batch_size={args.micro_batch}",
        f"training.checkpoint_every={args.steps}",
        f"training.features={features}",
        f"output.dir={out_dir}",
        "output.overwrite=true",
        *extra_overrides,
    ]
    cmd = specgraft("train", str(ROOT / recipe), *overrides, "--no-progress")
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    log = out_dir.parent / f"{out_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if rc != 0:
        tail = log.read_text(encoding="utf-8").splitlines()[-15:]
        raise RuntimeError(f"training {name} ({features}) failed with exit code {rc}:\n" + "\n".join(tail))
    summary = json.loads((out_dir / "train_summary.json").read_text(encoding="utf-8"))
    curves = read_loss_curve(out_dir)
    loss = curves.get("loss", [])
    return {"head": name, "features": features, "recipe": recipe, "command": " ".join(cmd[1:]),
            "head_dir": str(out_dir / "head"), "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "summary": summary,
            "loss_first": loss[0] if loss else None, "loss_last": loss[-1] if loss else None,
            "loss_min": min(loss, key=lambda p: p[1]) if loss else None, "curves": curves}


def fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    """A table cell: ``value`` to ``digits`` decimals, "-" when absent or not finite."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def lossless_label(overall: Mapping[str, Any]) -> str:
    """``passed 13/13`` / ``FAILED 12/13`` / ``not checked 0/0`` from a report's overall section."""
    passed = overall.get("lossless_passed")
    verdict = "not checked" if passed is None else "passed" if passed else "FAILED"
    return f"{verdict} {overall.get('lossless_identical')}/{overall.get('lossless_checked')}"


def answered_turns(report_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The answers file of a ``specgraft eval`` report folder, one record per answered prompt turn keyed by
    (prompt id, turn); empty when the folder has none."""
    from specgraft.evaluation.prompts import read_jsonl
    from specgraft.evaluation.render import ANSWERS_JSONL

    answers = Path(report_dir) / ANSWERS_JSONL
    if not answers.is_file():
        return {}
    return {(str(r.get("prompt_id")), int(r.get("turn", 0))): r for _, r in read_jsonl(answers)}


def eval_figures(overall: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of a ``report.json`` overall section as one flat result row (scalars only)."""
    keys = ("tau", "tokens_per_s", "baseline_tokens_per_s", "speedup_mean_of_ratios", "speedup_ratio_of_totals",
            "speedup_over_tau", "draft_cost_per_step", "verify_cost_per_step")
    row = {key: overall[key] for key in keys if overall.get(key) is not None}
    depth = overall.get("acceptance_by_depth") or []
    row["acceptance_by_depth"] = " / ".join(f"{a:.2f}" for a in depth)
    row["lossless"] = lossless_label(overall)
    return row
