"""``specgraft demo`` as a benchmark: run the demo (or read a finished one) and record each drafter's default and
tuned setting with its tau, measured and predicted speedup and lossless check, and the demo's wall time, as
``benchmarks/results/<--result-name>.json``.

The demo's own flags follow ``--``; ``--out`` is the demo's output folder (``--record-only``: read a demo that
already ran there, e.g. one a user ran by hand, instead of running it)::

    python benchmarks/bench_demo.py --out runs/demo-smollm2 --result-name demo-smollm2 -- \\
        --target smollm2 --prompts ../shared/data/mt_bench/question.jsonl --threads 2
    python benchmarks/bench_demo.py --out runs/demo-smollm2 --result-name demo-smollm2 --record-only -- \\
        --target smollm2 --prompts ../shared/data/mt_bench/question.jsonl --threads 2

The speedups are the demo's own (plain and speculative decoding interleaved per prompt in one process).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, write_result
from benchlib.stages import specgraft

SUMMARY = "summary.json"


def drafter_rows(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per drafter of a demo's ``summary.json``: its default run (the ``overall`` row) and its tuned
    setting (``tuning``, with the tuned run's own report for its tau and lossless check)."""
    rows = []
    tuning = summary.get("tuning") or {}
    for row in summary["rows"]:
        if row["domain"] != "overall":
            continue
        name = row["drafter"]
        tuned = tuning.get(name) or {}
        report = Path(tuned["report_dir"]) / "report.json" if tuned.get("report_dir") else None
        tuned_overall = (json.loads(report.read_text(encoding="utf-8"))["overall"]
                         if report is not None and report.is_file() else {})
        rows.append({"drafter": name, "default_setting": tuned.get("default"), "default_tau": row.get("tau"),
                     "default_speedup": row.get("speedup_ratio_of_totals"),
                     "tuned_setting": tuned.get("setting"), "tuned_tau": tuned_overall.get("tau"),
                     "tuned_speedup": tuned.get("measured"), "tuned_predicted": tuned.get("predicted"),
                     "lossless": tuned_overall.get("lossless_check") or row.get("lossless")})
    return rows


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    demo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="The demo's output folder.")
    parser.add_argument("--record-only", action="store_true",
                        help="Read the demo that already ran into --out instead of running it.")
    add_result_arguments(parser, "demo")
    args = parser.parse_args(own)
    if "--out" in demo_args or any(a.startswith("--out=") for a in demo_args):
        parser.error("give the demo's output folder as this script's --out, not after --")
    return args, demo_args


def main(argv: Sequence[str] | None = None) -> int:
    args, demo_args = parse_args(argv)
    command = specgraft("demo", *demo_args, "--out", str(args.out))
    wall = None
    if not args.record_only:
        started = time.perf_counter()
        code = subprocess.run(command, check=False).returncode
        wall = time.perf_counter() - started
        if code != 0:
            print(f"error: the demo exited with status {code}; its output is in {args.out}", file=sys.stderr)
            return 2
    summary_path = args.out / SUMMARY
    if not summary_path.is_file():
        print(f"error: {summary_path} is absent: the demo did not finish there; run it without --record-only",
              file=sys.stderr)
        return 2
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    rows = drafter_rows(summary)
    threads = int(demo_args[demo_args.index("--threads") + 1]) if "--threads" in demo_args else 1
    path = write_result(args.result_name, rows, dtype="float32", threads=threads,
                        title=f"`specgraft demo {' '.join(demo_args)}`: each drafter at its default and tuned "
                              "setting, speedup over plain greedy decoding measured in the same process",
                        details={"demo_command": " ".join(["specgraft", "demo", *demo_args]),
                                 "demo_minutes": round(summary["elapsed_s"] / 60, 1),
                                 "wall_minutes_here": round(wall / 60, 1) if wall is not None else None,
                                 "per_domain_default": [r for r in summary["rows"] if r["domain"] != "overall"]},
                        results_dir=args.results_dir)
    print(f"demo: {summary['elapsed_s'] / 60:.1f} min; result: {path}")
    for row in rows:
        print(f"  {row['drafter']:<16} default {row['default_speedup'] or 0:.2f}x (tau {row['default_tau'] or 0:.2f})"
              f"  tuned {row['tuned_setting']}: {row['tuned_speedup'] or 0:.2f}x (tau {row['tuned_tau'] or 0:.2f}, "
              f"predicted {row['tuned_predicted'] or 0:.2f}x)  {row['lossless']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
