"""Medusa vs EAGLE-1 vs EAGLE-3 heads on the real stories260K target: training cost and held-out decoding speed.

One run, in a scratch folder (``--work``, default ``<out stem>_work`` beside ``--out``):

1. Converts llama2.c stories260K to a transformers folder (``convert_llama2c``) and splits TinyStories: the held-out
   prompts are the first sentences of lines at the END of ``tinystories_train.txt`` (the construction of
   ``benchlib.stories``); the training text is the file up to the blank line before the first
   held-out line, so no held-out paragraph is trained on.
2. Trains Medusa (3 heads, 1 block), EAGLE-1 (1 layer) and EAGLE-3 (1 midlayer, 3 TTT steps) with the shipped
   ``recipes/*/stories260k.yaml`` through the real ``specgraft train`` command line, each in its own process (so
   ``peak_memory_bytes``, the process's max RSS on CPU, is per run), with the SAME optimizer steps and batch
   (``--steps`` x ``--micro-batch`` x the recipes' 256 tokens); online features, then EAGLE-3 and EAGLE-1 again with
   ``training.features=offline`` for offline throughput and cache bytes/token. Overridden: model.name_or_path,
   data.path, data.cache_dir, training.max_steps, training.micro_batch_size, training.features,
   training.checkpoint_every (= steps: one checkpoint, at the end), output.dir and output.overwrite; the loss curve
   is read back from each run's tensorboard events.
3. Evaluates each online head on the held-out prompts (greedy, tree and chain modes) with ``run_eval`` in this
   process: tau, acceptance by depth, wall-clock speedup over plain decoding (mean of ratios, ratio of totals),
   speedup/tau and the lossless check, all read from each ``report.json``.
4. Prints a decoding table and a training table and writes every number to ``--out`` (JSON). Exits 1 when any
   lossless check fails.

    python benchmarks/bench_heads_stories260k.py --out /tmp/heads260k.json
    python benchmarks/bench_heads_stories260k.py --out /tmp/heads260k.json --steps 100 --per-domain 2  # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, write_result
from benchlib.stages import eval_figures, fmt, lossless_label, scratch_folder, train_one
from benchlib.stories import evaluate_heads, prepare_stories260k

#: (run name, recipe, training.features). Online runs are evaluated; offline runs measure the cached-feature path.
RUNS = (
    ("medusa", "recipes/medusa/stories260k.yaml", "online"),
    ("eagle1", "recipes/eagle/stories260k.yaml", "online"),
    ("eagle3", "recipes/eagle3/stories260k.yaml", "online"),
    ("eagle3", "recipes/eagle3/stories260k.yaml", "offline"),
    ("eagle1", "recipes/eagle/stories260k.yaml", "offline"),
)
MODES = ("tree", "chain")
MIB = 2**20


def decoding_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| head | mode | tau | acceptance by depth | tok/s spec | tok/s plain | speedup (mean of ratios) | "
             "speedup (ratio of totals) | speedup/tau | lossless |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        o = r["overall"]
        depth = " ".join(f"{x:.2f}" for x in o.get("acceptance_by_depth") or [])
        lossless = lossless_label(o)
        lines.append(f"| {r['head']} | {r['mode']} | {fmt(o['tau'])} | {depth} | {fmt(o['tokens_per_s'], 0)} | "
                     f"{fmt(o['baseline_tokens_per_s'], 0)} | {fmt(o['speedup_mean_of_ratios'], 2, 'x')} | "
                     f"{fmt(o['speedup_ratio_of_totals'], 2, 'x')} | {fmt(o['speedup_over_tau'])} | {lossless} |")
    return "\n".join(lines)


def training_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| head | features | steps x seqs | target tok/s (steady) | peak RSS MiB | wall s | loss first -> last | "
             "medusa top-1 per head (held-out) | draft-vocab coverage | cache B/token (EAGLE-1 fp16) |",
             "|---|---|---:|---:|---:|---:|---|---|---:|---|"]
    for run in runs:
        s = run["summary"]
        first, last = run["loss_first"], run["loss_last"]
        loss = f"{first[1]:.3f} (s{first[0]}) -> {last[1]:.3f} (s{last[0]})" if first and last else "-"
        top1 = " ".join(f"{a:.3f}" for a in s.get("medusa_top1_accuracy", [])) or "-"
        if s.get("medusa_top1_accuracy"):
            top1 += f" ({s.get('accuracy_measured_on')})"
        cache = "-"
        if "feature_cache_bytes_per_token" in s:
            cache = f"{s['feature_cache_bytes_per_token']:.0f} ({s['eagle1_fp16_bytes_per_token']})"
        lines.append(f"| {run['head']} | {run['features']} | {s['steps']} x {run['micro_batch']} | "
                     f"{s['steady_tokens_per_s']:,.0f} | {s['peak_memory_bytes'] / MIB:.0f} | {run['wall_s']:.0f} | "
                     f"{loss} | {top1} | {fmt(s.get('draft_vocab_coverage'), 3)} | {cache} |")
    return "\n".join(lines)


def training_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One training run's figures as a result row."""
    s = run["summary"]
    row = {"head": run["head"], "features": run["features"], "steps": s["steps"], "micro_batch": run["micro_batch"],
           "target_tokens_per_s": s["steady_tokens_per_s"], "peak_rss_mib": round(s["peak_memory_bytes"] / MIB),
           "wall_s": round(run["wall_s"], 1)}
    if run["loss_first"] and run["loss_last"]:
        row["loss_first"], row["loss_last"] = run["loss_first"][1], run["loss_last"][1]
    if "feature_cache_bytes_per_token" in s:
        row["cache_bytes_per_token"] = s["feature_cache_bytes_per_token"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file with every number")
    parser.add_argument("--work", type=Path, help="scratch folder (default: <out without .json>_work)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of every training run")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences (of the recipes' 256 tokens) per step")
    parser.add_argument("--per-domain", type=int, default=6, help="held-out prompts per domain (3 domains)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the 2 cores are shared)")
    add_result_arguments(parser, "heads-stories260k")
    args = parser.parse_args()

    started = time.perf_counter()
    work = scratch_folder(args)
    model_dir, split = prepare_stories260k(work, args.per_domain)
    print(f"data: {split['train_lines']} training lines ({split['train_bytes']:,} B), {split['num_prompts']} held-out "
          f"prompts from the last {split['heldout_lines']} lines ({split['heldout_lines_also_in_train']}/"
          f"{split['heldout_nonblank_lines']} held-out lines also occur verbatim in training)", flush=True)

    runs = []
    for name, recipe, features in RUNS:
        run = train_one(name, recipe, features, model_dir, split, work, args)
        run["micro_batch"] = args.micro_batch
        runs.append(run)
        s = run["summary"]
        print(f"  train {name:<6} {features:<7} {s['steady_tokens_per_s']:>8,.0f} tok/s  "
              f"{s['peak_memory_bytes'] / MIB:>5.0f} MiB  {run['wall_s']:>5.0f} s  loss "
              f"{run['loss_first'][1] if run['loss_first'] else float('nan'):.3f} -> "
              f"{run['loss_last'][1] if run['loss_last'] else float('nan'):.3f}", flush=True)

    rows = evaluate_heads(model_dir, runs, split, work, args, MODES)
    plain = [r["overall"]["baseline_tokens_per_s"] for r in rows]
    all_lossless = all(r["overall"]["lossless_passed"] for r in rows)
    total = time.perf_counter() - started

    print(f"\n## Decoding: stories260K, {split['num_prompts']} held-out TinyStories prompts, greedy, "
          f"max_new_tokens {args.max_new_tokens}, median of {args.repeats} repeats, {args.threads} thread(s)\n")
    print(decoding_table(rows))
    print(f"\nplain decoding: {min(plain):.0f}-{max(plain):.0f} tok/s (mean {sum(plain) / len(plain):.0f}) over the "
          f"{len(rows)} evaluations")
    print(f"\n## Training: {args.steps} steps x {args.micro_batch} x 256 tokens per run, {args.threads} thread(s)\n")
    print(training_table(runs))
    print(f"\ntotal {total:.0f} s; lossless: {'all passed' if all_lossless else 'FAILED'}")

    result = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "target": str(model_dir), "data": split, "total_wall_s": total,
        "training": runs, "decoding": rows,
        "plain_tokens_per_s": {"min": min(plain), "max": max(plain), "mean": sum(plain) / len(plain)},
        "all_lossless": all_lossless,
        "tables": {"decoding": decoding_table(rows), "training": training_table(runs)},
    }
    from specgraft.utils.io import atomic_write_json

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    write_result(args.result_name, {
        "decoding": [{"head": r["head"], "mode": r["mode"], **eval_figures(r["overall"])} for r in rows],
        "training": [training_figures(run) for run in runs],
    }, title="Medusa, EAGLE-1 and EAGLE-3 trained at one budget on stories260K: training and held-out decoding",
        dtype="float32", threads=args.threads, results_dir=args.results_dir,
        details={"settings": result["settings"], "data": split, "full_record": str(args.out)})
    return 0 if all_lossless else 1


if __name__ == "__main__":
    sys.exit(main())
