"""Medusa vs EAGLE-1 vs EAGLE-3 heads on the real stories260K target: training cost and held-out decoding speed.

One run, in a scratch folder (``--work``, default ``<out stem>_work`` beside ``--out``):

1. Converts llama2.c stories260K to a transformers folder (``convert_llama2c``) and splits TinyStories: the held-out
   prompts are the first sentences of lines at the END of ``tinystories_train.txt`` (the construction of
   ``benchmarks/bench_eval_stories.py``); the training text is the file up to the blank line before the first
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
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from specgraft.utils.scripts import load_sibling

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECGRAFT_SHARED_DATA", ROOT.parent / "shared" / "data"))
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


def _bench_eval_stories() -> ModuleType:
    """The sibling benchmark (not a package) whose held-out prompt construction this one reuses."""
    return load_sibling(__file__, "bench_eval_stories")


def split_tinystories(src: Path, work: Path, per_domain: int) -> dict[str, Any]:
    """Write the held-out prompt file and the training text (the file before the held-out tail) into ``work``."""
    rows = _bench_eval_stories().held_out_prompts(src, per_domain)
    lines = src.read_text(encoding="utf-8").splitlines()
    nonblank = [i for i, line in enumerate(lines) if line.strip()]  # held_out_prompts indexes non-blank lines
    first_held = min(nonblank[int(r["id"].removeprefix("para"))] for r in rows)
    cut = first_held
    while cut > 0 and lines[cut - 1].strip():  # back to the blank line that opens the held-out paragraph
        cut -= 1
    train_lines, held_lines = lines[:cut], lines[cut:]
    train_txt = work / "tinystories_train_head.txt"
    train_txt.write_text("\n".join(train_lines) + "\n", encoding="utf-8")
    prompts = work / "tinystories_heldout_prompts.jsonl"
    prompts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    train_set = {" ".join(line.split()) for line in train_lines if line.strip()}
    held = [" ".join(line.split()) for line in held_lines if line.strip()]
    return {"train_text": str(train_txt), "prompts_file": str(prompts), "num_prompts": len(rows),
            "train_lines": len(train_lines), "heldout_lines": len(held_lines),
            "train_bytes": train_txt.stat().st_size,
            # TinyStories repeats stock lines ("The end."); full held-out lines found verbatim in the training text.
            "heldout_lines_also_in_train": sum(h in train_set for h in held), "heldout_nonblank_lines": len(held)}


def prepare_stories260k(args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]] | None:
    """The scratch folder (``--work``, default ``<out stem>_work``), stories260K converted into it and the
    TinyStories split (:func:`split_tinystories`); None (after an ``error:`` line) when ../shared/data is absent."""
    src = SHARED / "models" / "stories260K"
    text = SHARED / "tinystories" / "tinystories_train.txt"
    if not src.is_dir() or not text.is_file():
        print(f"error: {src} or {text} is absent; this benchmark needs ../shared/data", file=sys.stderr)
        return None
    work = args.work or args.out.parent / f"{args.out.stem}_work"
    work.mkdir(parents=True, exist_ok=True)

    from specgraft.llama2c import convert_llama2c

    model_dir = work / "stories260K"
    if not (model_dir / "config.json").is_file():
        convert_llama2c(src / "stories260K.bin", src / "tok512.bin", model_dir)
    return work, model_dir, split_tinystories(text, work, args.per_domain)


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


def train_one(name: str, recipe: str, features: str, model_dir: Path, split: dict[str, Any], work: Path,
              args: argparse.Namespace, extra_overrides: tuple[str, ...] = (), run_name: str | None = None
              ) -> dict[str, Any]:
    """``specgraft train RECIPE overrides`` in a child process (output in ``runs/<run_name or name-features>``);
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
    cmd = [sys.executable, "-m", "specgraft", "train", str(ROOT / recipe), *overrides, "--no-progress"]
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    log = out_dir.parent / f"{out_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as fh:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if rc != 0:
        tail = log.read_text(encoding="utf-8").splitlines()[-15:]
        raise RuntimeError(f"training {name} ({features}) failed with exit code {rc}:\n" + "\n".join(tail))
    summary = json.loads((out_dir / "train_summary.json").read_text(encoding="utf-8"))
    curves = read_loss_curve(out_dir)
    loss = curves.get("loss", [])
    return {"head": name, "features": features, "recipe": recipe, "command": " ".join(cmd[1:]),
            "head_dir": str(out_dir / "head"), "wall_s": wall, "summary": summary,
            "loss_first": loss[0] if loss else None, "loss_last": loss[-1] if loss else None,
            "loss_min": min(loss, key=lambda p: p[1]) if loss else None, "curves": curves}


def evaluate(model_dir: Path, runs: list[dict[str, Any]], split: dict[str, Any], work: Path,
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """run_eval of every online head in tree and chain mode; the report.json facts per (head, mode)."""
    import torch

    from specgraft.eval.prompts import load_prompts
    from specgraft.eval.report import EvalSettings, describe_drafter, run_eval
    from specgraft.heads import load_head
    from specgraft.heads.registry import family_of
    from specgraft.target import load_target

    torch.set_num_threads(args.threads)
    target = load_target(model_dir)
    prompts = load_prompts(split["prompts_file"])
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup)
    rows = []
    for run in runs:
        if run["features"] != "online":
            continue
        head = load_head(target, run["head_dir"])
        head.eval()
        for mode in MODES:
            drafter = family_of(head).drafter(head, {"mode": mode})  # any family, through the registry
            info = {**describe_drafter(drafter), "type": run["head"], "path": run["head_dir"]}
            start = time.perf_counter()
            report = run_eval(target, drafter, prompts, work / "eval" / f"{run['head']}-{mode}", settings=settings,
                              drafter_info=info, progress=False)
            overall = report["overall"]
            rows.append({"head": run["head"], "mode": mode, "drafter": report["drafter"],
                         "eval_wall_s": time.perf_counter() - start, "overall": overall,
                         "domains": {d: {k: v.get(k) for k in ("tau", "speedup_ratio_of_totals", "lossless_passed")}
                                     for d, v in report["domains"].items()}})
            print(f"  eval {run['head']:<6} {mode:<5} tau {overall['tau']:.2f}  speedup "
                  f"{overall['speedup_ratio_of_totals']:.2f}x  {overall['lossless_check']}", flush=True)
    return rows


def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def decoding_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| head | mode | tau | acceptance by depth | tok/s spec | tok/s plain | speedup (mean of ratios) | "
             "speedup (ratio of totals) | speedup/tau | lossless |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        o = r["overall"]
        depth = " ".join(f"{x:.2f}" for x in o.get("acceptance_by_depth") or [])
        lossless = f"{'passed' if o['lossless_passed'] else 'FAILED'} {o['lossless_identical']}/{o['lossless_checked']}"
        lines.append(f"| {r['head']} | {r['mode']} | {_f(o['tau'])} | {depth} | {_f(o['tokens_per_s'], 0)} | "
                     f"{_f(o['baseline_tokens_per_s'], 0)} | {_f(o['speedup_mean_of_ratios'], 2, 'x')} | "
                     f"{_f(o['speedup_ratio_of_totals'], 2, 'x')} | {_f(o['speedup_over_tau'])} | {lossless} |")
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
                     f"{loss} | {top1} | {_f(s.get('draft_vocab_coverage'), 3)} | {cache} |")
    return "\n".join(lines)


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
    args = parser.parse_args()

    started = time.perf_counter()
    prepared = prepare_stories260k(args)
    if prepared is None:
        return 2
    work, model_dir, split = prepared
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

    rows = evaluate(model_dir, runs, split, work, args)
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
    return 0 if all_lossless else 1


if __name__ == "__main__":
    sys.exit(main())
