"""Attention kernels against the user's own plain decoding: greedy identity and plain step time per kernel.

Two measurements, written through ``benchlib`` to ``benchmarks/results/kernels.json`` (``--result-name``,
``--results-dir``), each a figure table (the refusal and crash messages and the drafters that differed go in
``details``, keyed ``"<model> <dtype> <kernel>"``):

* ``identity``: for every target (stories260K, converted from ``../shared/data``, and each tiny test architecture),
  dtype (float32, bfloat16) and ``--attention-kernel`` (stock, gqa, exact; ``auto`` is one of stock/gqa), every
  built-in drafter (:func:`specgraft.testing.builtin_drafters`) decodes each prompt greedily and the tokens are
  compared with plain decoding under the STOCK kernels in the same dtype. A kernel that refuses the model is recorded
  with its one-line message. Plain decoding under the kernel itself is compared too.
* ``plain step``: plain decoding's time per token on stories260K under each kernel (and ``--smollm2 DIR``, a
  converted SmolLM2 folder, if given), the kernels interleaved in one process, median over repeats: the kernel's own
  effect on plain decoding, ``plain_kernel_ms`` against ``plain_stock_ms``.

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --tokens 500 --smollm2 /tmp/smollm2
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_kernels.py --results-dir /tmp --result-name before

``--before FILE`` embeds such a run of another version (its tables side by side as ``identity before`` and ``plain
step before``, its provenance under ``details.before``); ``--reuse FILE`` takes this version's tables from an
earlier run instead of measuring again (that run's provenance under ``details.reused``); ``--demo DIR`` adds the
speedups of a ``specgraft demo --out DIR`` run as the ``demo`` table (every report.json under it: the speedup
against the baseline the report names, against stock plain decoding, and both plain times), with the figures the
README reported in ``details.demo``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from benchlib.results import add_result_arguments, write_result
from benchlib.stories import stories260k_target

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.errors import SpecgraftError
from specgraft.kernels.exact_attention import apply_attention_kernel
from specgraft.target import load_target
from specgraft.testing import TINY_ARCHITECTURES, builtin_drafters, tiny_model

KERNELS = ("stock", "gqa", "exact")
DTYPES = ("float32", "bfloat16")
STORY_PROMPTS = ("", "Once upon a time, there was a little girl named Lily. She loved to")
#: The figure tables a run measures, and the names the tables of a ``--before`` run take beside them.
MEASURED_TABLES = ("identity", "plain step")
#: The result-file fields that say where a run was measured, kept in ``details`` when a run is reused or embedded.
PROVENANCE = ("command", "commit", "dirty", "date", "cpu", "cpu_count", "threads", "versions")


def row_key(row: Mapping[str, Any]) -> str:
    """The name of a (model, dtype, kernel) configuration in ``details``."""
    return f"{row['model']} {row['dtype']} {row['kernel']}"


def split_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Scalar figure rows (a refusal or crash becomes ``status``) and, per configuration, its messages and the
    drafters that differed, which do not fit a table cell."""
    figures, notes = [], {}
    for row in rows:
        note = {key: row[key] for key in ("refused", "crashed", "differing") if row.get(key)}
        status = "refused" if row.get("refused") else "crashed" if row.get("crashed") else "ran"
        figures.append({"model": row["model"], "dtype": row["dtype"], "kernel": row["kernel"], "status": status,
                        **{key: value for key, value in row.items()
                           if key not in ("model", "dtype", "kernel", "refused", "crashed", "differing")}})
        if note:
            notes[row_key(row)] = note
    return figures, notes


def provenance(result: Mapping[str, Any]) -> dict[str, Any]:
    """Where an earlier result file was measured (its own provenance fields)."""
    return {key: result[key] for key in PROVENANCE if key in result}


def load_result(path: Path) -> dict[str, Any]:
    """An earlier run of this script (a kernels result file); ValueError naming the problem otherwise."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as JSON ({exc})") from None
    figures = result.get("figures") if isinstance(result, dict) else None
    if not isinstance(figures, Mapping) or not set(MEASURED_TABLES) <= set(figures):
        raise ValueError(f"{path} is not a result of this script (no {' and '.join(MEASURED_TABLES)} figure "
                         "tables); pass a file that bench_kernels.py wrote")
    return result


def with_kernel(model: Any, kernel: str) -> tuple[Any | None, str | None]:
    """A copy of ``model`` switched to ``kernel``, or (None, the refusal)."""
    switched = copy.deepcopy(model)
    try:
        apply_attention_kernel(kernel, switched)
    except SpecgraftError as refusal:
        return None, str(refusal)
    return switched, None


def identity(name: str, model: Any, prompts: list[list[int]], tokens: int, dtypes: tuple[str, ...] = DTYPES,
             kernels: tuple[str, ...] = KERNELS) -> list[dict[str, Any]]:
    """One row per dtype x kernel: how many (drafter, prompt) greedy runs equal stock plain decoding (``refused``,
    ``crashed`` and ``differing`` hold the messages and the drafters that differed, see :func:`split_rows`)."""
    rows = []
    for dtype in dtypes:
        base = copy.deepcopy(model).to(getattr(torch, dtype))
        reference = [SpeculativeDecoder(base, ignore_eos=True).generate(p, tokens).generated_ids for p in prompts]
        for kernel in kernels:
            start = time.perf_counter()
            switched, refusal = with_kernel(base, kernel)
            row: dict[str, Any] = {"model": name, "dtype": dtype, "kernel": kernel, "tokens": tokens,
                                   "prompts": len(prompts), "refused": refusal}
            if switched is not None:
                try:
                    plain = [SpeculativeDecoder(switched, ignore_eos=True).generate(p, tokens).generated_ids
                             for p in prompts]
                except (RuntimeError, ValueError) as crash:  # a kernel that accepted a model it cannot run
                    row.update(crashed=str(crash).splitlines()[0], seconds=round(time.perf_counter() - start, 1))
                    print(f"identity {name} {dtype} {kernel}: crashed ({row['crashed'][:80]})", flush=True)
                    rows.append(row)
                    continue
                row["plain_identical"] = sum(a == b for a, b in zip(plain, reference))
                runs = identical = 0
                differing: list[str] = []
                for drafter_name, factory in builtin_drafters(switched).items():
                    for prompt, ref in zip(prompts, reference):
                        out = SpeculativeDecoder(switched, drafter=factory(), ignore_eos=True).generate(prompt, tokens)
                        runs += 1
                        same = out.generated_ids == ref
                        identical += same
                        if not same:
                            first = next(i for i, (a, b) in enumerate(zip(out.generated_ids, ref)) if a != b)
                            differing.append(f"{drafter_name}@{first}")
                row.update(runs=runs, identical=identical, differing=differing)
            row["seconds"] = round(time.perf_counter() - start, 1)
            print(f"identity {name} {dtype} {kernel}: " + (f"refused ({refusal[:80]}...)" if refusal else
                  f"{row['identical']}/{row['runs']} spec, plain {row['plain_identical']}/{len(prompts)}"),
                  flush=True)
            rows.append(row)
    return rows


def plain_step(name: str, model: Any, prompt: list[int], tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Plain decoding's seconds per token under each kernel, per dtype, interleaved; median over ``repeats``."""
    rows = []
    for dtype in DTYPES:
        base = model.to(getattr(torch, dtype))
        kernels: dict[str, Any] = {}
        refused: dict[str, str] = {}
        for kernel in KERNELS:
            switched, refusal = with_kernel(base, kernel)
            if switched is None:
                refused[kernel] = refusal
            else:
                kernels[kernel] = SpeculativeDecoder(switched, ignore_eos=True)
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for repeat in range(repeats + 1):  # the first round warms up
            for kernel, decoder in kernels.items():
                out = decoder.generate(prompt, tokens)
                if repeat:
                    times[kernel].append((out.wall_time_s - out.prefill_time_s) / len(out.generated_ids))
        stock = statistics.median(times["stock"])
        for kernel in KERNELS:
            row: dict[str, Any] = {"model": name, "dtype": dtype, "kernel": kernel, "tokens": tokens,
                                   "repeats": repeats, "refused": refused.get(kernel)}
            if kernel in times:
                mine = statistics.median(times[kernel])
                row.update(plain_kernel_ms=mine * 1e3, plain_stock_ms=stock * 1e3, kernel_over_stock=mine / stock)
                print(f"plain step {name} {dtype} {kernel}: {mine * 1e3:.3f} ms/token (stock {stock * 1e3:.3f}, "
                      f"{mine / stock:.2f}x)", flush=True)
            rows.append(row)
    return rows


#: The demo's speedups as the README reported them (one run, before the stock-baseline rule).
README_DEMO_SPEEDUPS = {"medusa": 2.12, "dflash": 1.37, "eagle3": 1.20, "distilled draft": 1.08}


def demo_speedups(folder: Path) -> list[dict[str, Any]]:
    """The overall speedups of every eval report under a ``specgraft demo`` output folder."""
    rows = []
    for path in sorted(folder.rglob("report.json")):
        report = json.loads(path.read_text(encoding="utf-8"))
        overall = report.get("overall") or {}
        rows.append({"report": str(path.relative_to(folder)), "drafter": (report.get("drafter") or {}).get("type"),
                     "mode": (report.get("drafter") or {}).get("mode"),
                     "kernels": (report.get("measurement") or {}).get("kernels"),
                     **{k: overall.get(k) for k in ("tau", "speedup_ratio_of_totals", "baseline_kernels",
                                                    "speedup_vs_stock_ratio_of_totals", "plain_stock_s",
                                                    "plain_kernel_s", "plain_kernel_over_stock", "lossless_check")}})
    return rows


def machine_details() -> dict[str, Any]:
    """What the result file's provenance does not hold: which specgraft ran (``PYTHONPATH`` runs of another
    version) and whether the CPU has native bfloat16 (which the bfloat16 rows depend on)."""
    import specgraft

    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text(encoding="utf-8", errors="replace") if cpuinfo.is_file() else ""
    return {"specgraft_path": str(Path(specgraft.__file__).parent), "avx512_bf16": "avx512_bf16" in flags}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400, help="greedy tokens per stories260K identity run")
    parser.add_argument("--tiny-tokens", type=int, default=120, help="greedy tokens per tiny-architecture run")
    parser.add_argument("--step-tokens", type=int, default=300, help="tokens per timed plain decode")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smollm2", type=Path, help="a converted SmolLM2 folder to time plain steps on as well")
    parser.add_argument("--skip-identity", action="store_true")
    parser.add_argument("--skip-step", action="store_true", help="do not time plain steps")
    parser.add_argument("--dtypes", nargs="*", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--kernels", nargs="*", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--story-prompts", type=int, default=len(STORY_PROMPTS), help="stories260K prompts to use")
    parser.add_argument("--models", nargs="*", help="identity on these only (stories260K, tiny-llama, ...)")
    parser.add_argument("--before", type=Path, help="a run of this script on another version, embedded as 'before'")
    parser.add_argument("--reuse", type=Path, help="take identity and plain step from this earlier run")
    parser.add_argument("--demo", type=Path, help="a `specgraft demo --out DIR` folder whose speedups to add")
    add_result_arguments(parser, "kernels")
    args = parser.parse_args(argv)
    try:
        before = load_result(args.before) if args.before is not None else None
        reused = load_result(args.reuse) if args.reuse is not None else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if reused is not None:
        figures = {table: reused["figures"][table] for table in MEASURED_TABLES}
        details = {key: value for key, value in (reused.get("details") or {}).items()
                   if key not in ("before", "demo", "reused")}
        details["reused"] = provenance(reused)
        return finish(figures, details, args, before, threads=reused.get("threads"),
                      dtype=reused.get("dtype") or ", ".join(args.dtypes))
    torch.set_num_threads(args.threads)
    identity_rows: list[dict[str, Any]] = []
    step_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_target(stories260k_target(Path(tmp) / "s260k"), dtype="float32")
        stories, tokenizer = loaded.model, loaded.tokenizer
    prompts = [[1] + tokenizer.encode(text, add_special_tokens=False) for text in STORY_PROMPTS]
    if not args.skip_identity:
        if not args.models or "stories260K" in args.models:
            identity_rows += identity("stories260K", stories, prompts[: args.story_prompts], args.tokens,
                                      tuple(args.dtypes), tuple(args.kernels))
        for arch in TINY_ARCHITECTURES:
            if not args.models or f"tiny-{arch}" in args.models:
                tiny = tiny_model(arch, max_position_embeddings=512)
                identity_rows += identity(f"tiny-{arch}", tiny, [[5, 9, 17, 33]], args.tiny_tokens,
                                          tuple(args.dtypes), tuple(args.kernels))
    if not args.skip_step:
        step_rows += plain_step("stories260K", stories, prompts[1], args.step_tokens, args.repeats)
    if args.smollm2 is not None:
        smol_target = load_target(args.smollm2, dtype="float32")
        smol, smol_tok = smol_target.model, smol_target.tokenizer
        ids = smol_tok.encode("Write a short story about a robot who learns to paint.")
        step_rows += plain_step("SmolLM2-135M", smol, ids, min(args.step_tokens, 128), args.repeats)
    figures: dict[str, list[dict[str, Any]]] = {}
    details: dict[str, Any] = {"machine": machine_details()}
    for table, rows in zip(MEASURED_TABLES, (identity_rows, step_rows)):
        figures[table], details[table] = split_rows(rows)
    return finish(figures, details, args, before, threads=args.threads, dtype=", ".join(args.dtypes))


def finish(figures: dict[str, list[dict[str, Any]]], details: dict[str, Any], args: argparse.Namespace,
           before: Mapping[str, Any] | None, *, threads: int | None, dtype: str) -> int:
    """Add the comparisons asked for, write the result file, print the side-by-side tables."""
    if before is not None:
        for table in MEASURED_TABLES:
            figures[f"{table} before"] = before["figures"][table]
        details["before"] = {**provenance(before), **(before.get("details") or {})}
        old = {row_key(row): row for row in before["figures"]["identity"]}
        print("| model | dtype | kernel | before: identical / runs (plain) | after |")
        for row in figures["identity"]:
            print(f"| {row['model']} | {row['dtype']} | {row['kernel']} | {_cell(old.get(row_key(row), {}))} "
                  f"| {_cell(row)} |")
    if args.demo is not None:
        figures["demo"] = demo_speedups(args.demo)
        details["demo"] = {"folder": str(args.demo), "readme_speedups": README_DEMO_SPEEDUPS}
        for row in figures["demo"]:
            print(f"demo {row['report']}: {row['speedup_ratio_of_totals']}x against {row['baseline_kernels']} "
                  f"plain decoding ({row['speedup_vs_stock_ratio_of_totals']}x against stock)")
    write_result(args.result_name, figures, title="Attention kernels: greedy identity with plain decoding per "
                 "model x dtype x kernel, and plain decoding's step time per kernel", dtype=dtype, threads=threads,
                 details=details, results_dir=args.results_dir)
    return 0


def _cell(row: Mapping[str, Any]) -> str:
    if not row:
        return "-"
    if row.get("status") != "ran":
        return str(row.get("status"))
    return f"{row['identical']}/{row['runs']} ({row['plain_identical']}/{row['prompts']})"


if __name__ == "__main__":
    raise SystemExit(main())
