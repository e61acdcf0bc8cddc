"""DFlash vs EAGLE-3 at an equal training budget on the real stories260K target: held-out tau, acceptance by
position, draft cost per step (in target-forward units), wall-clock speedup and the lossless check.

One run, in a scratch folder (``--work``, default ``<out stem>_work`` beside ``--out``):

1. Converts llama2.c stories260K and splits TinyStories as every stories260K benchmark does (``benchlib.stories``)
   (held-out prompts from the end of the file; the training text stops before them).
2. Trains EAGLE-3 (``recipes/eagle3/stories260k.yaml``) and DFlash (``recipes/dflash/stories260k.yaml``) through the
   real ``specgraft train`` command line, each in its own process, with the SAME data, optimizer steps and batch
   (``--steps`` x ``--micro-batch`` x the recipes' 256 tokens): an equal budget of target tokens.
3. Evaluates every setting in ``--settings`` on the held-out prompts with ``run_eval`` in this process, one after the
   other (plain decoding runs beside each, so every speedup is a side-by-side ratio): EAGLE-3 at its default tree
   and chain, DFlash chains of ``block_size - 1`` and shorter, and its per-slot top-k tree.
   With ``--tune`` instead: measures one cost profile of this machine for both heads (``specgraft profile``'s
   :func:`~specgraft.tuning.cost.measure_profile`), then runs ``specgraft tune``'s search and confirming evals
   (:func:`~specgraft.tuning.tune.tune`) for EAGLE-3 and for DFlash on the held-out prompts, one after the other in
   this process, writes each head's ``tuned.json`` and compares the tuned settings' speedups.
4. Prints one table and writes every number (and each answer, in each eval folder's answers.jsonl) under
   ``--out`` (JSON); exits 1 when a lossless check fails.

    python benchmarks/bench_dflash.py --out runs/bench-dflash.json
    python benchmarks/bench_dflash.py --out runs/bench-dflash-tuned.json --skip-training --tune
    python benchmarks/bench_dflash.py --out /tmp/dflash.json --steps 60 --per-domain 2   # smoke run
    python benchmarks/bench_dflash.py --out runs/b2.json --work runs/b2 --train dflash \
        --override dflash:head.max_anchors=256 --tune      # a DFlash variant against the EAGLE-3 head in --work
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, write_result
from benchlib.stages import eval_figures, fmt, lossless_label, parse_run_overrides, scratch_folder, train_one
from benchlib.stories import prepare_stories260k

#: (run name, recipe). Both train with online features.
RUNS = (("eagle3", "recipes/eagle3/stories260k.yaml"), ("dflash", "recipes/dflash/stories260k.yaml"))
#: Evaluated settings: (run name, the family's setting dict as `specgraft eval` flags would give it).
DEFAULT_SETTINGS = (
    ("eagle3", {"mode": "tree"}),
    ("eagle3", {"mode": "chain"}),
    ("dflash", {"mode": "chain"}),
    ("dflash", {"mode": "chain", "depth": 3}),
    ("dflash", {"mode": "tree", "top_k": 2}),
)


def evaluate(model_dir: Path, runs: dict[str, dict[str, Any]], settings: list[tuple[str, dict[str, Any]]],
             split: dict[str, Any], work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from specgraft.evaluation.prompts import load_prompts
    from specgraft.evaluation.report import EvalSettings, run_eval
    from specgraft.heads import load_head
    from specgraft.heads.registry import family_of
    from specgraft.target import load_target

    torch.set_num_threads(args.threads)
    prompts = load_prompts(split["prompts_file"])
    eval_settings = EvalSettings(max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup)
    rows = []
    for name, setting in settings:
        target = load_target(model_dir)  # a fresh target per setting: the decoder owns its caches
        head = load_head(target, runs[name]["head_dir"])
        head.eval()
        family = family_of(head)
        drafter = family.drafter(head, setting)
        label = f"{name} " + ",".join(f"{k}={v}" for k, v in setting.items())
        info = {"type": head.head_type, "path": runs[name]["head_dir"], **setting,
                **family.describe_drafter(drafter)}
        report = run_eval(target, drafter, prompts, work / "eval" / label.replace(" ", "_").replace(",", "_"),
                          settings=eval_settings, drafter_info=info, progress=False)
        overall = report["overall"]
        rows.append({"run": name, "setting": setting, "label": label, "drafter": report["drafter"],
                     "overall": overall})
        print(f"  eval {label:<32} tau {overall['tau']:.2f}  draft {overall['draft_cost_per_step']:.2f} + verify "
              f"{overall['verify_cost_per_step']:.2f} fwd/step  speedup {overall['speedup_ratio_of_totals']:.2f}x  "
              f"{overall['lossless_check']}", flush=True)
    return rows


def tune_both(model_dir: Path, runs: dict[str, dict[str, Any]], split: dict[str, Any], work: Path,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """One cost profile for both heads, then `specgraft tune` (search, confirming evals at the tuned and the default
    setting) for each; rows as :func:`evaluate` writes them, at the tuned and at the default setting."""
    import torch

    from specgraft.evaluation.prompts import load_prompts
    from specgraft.evaluation.report import EvalSettings
    from specgraft.pipeline.tune import load_head_source, measure_cost_profile, profile_kv_length, tune_drafter
    from specgraft.target import load_target
    from specgraft.tuning.tune import setting_label

    torch.set_num_threads(args.threads)
    prompts = load_prompts(split["prompts_file"])
    eval_settings = EvalSettings(max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup)
    target = load_target(model_dir)
    sources = {name: load_head_source(target, Path(runs[name]["head_dir"])) for name, _ in RUNS}
    kv_length = profile_kv_length(target, prompts, args.max_new_tokens)
    started = time.perf_counter()
    profile = measure_cost_profile(target, list(sources.values()), prompts, device="cpu", dtype="float32",
                                   threads=args.threads, max_new_tokens=args.max_new_tokens, kv_length=kv_length)
    profile.save(work / "tune" / "cost_profile.json")
    print(f"  profile at KV length {kv_length}: {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for name, source in sources.items():
        kind = str(source.kind)
        result = tune_drafter(source, prompts, work / "tune" / name, profile=profile, settings=eval_settings,
                              progress=False)
        for which, candidate in (("tuned", result.chosen), ("default", result.default)):
            # the eval that measured this setting (the tuned one may be the second opinion's or the calibration's)
            report_dir = result.report_dir(which)
            if candidate is None or report_dir is None:
                continue
            report = json.loads((report_dir / "report.json").read_text(encoding="utf-8"))
            overall = report["overall"]
            rows.append({"run": name, "setting": candidate.setting,
                         "label": f"{name} {which}: {setting_label(kind, candidate.setting)}", "which": which,
                         "predicted_speedup": candidate.speedup,
                         "drafter": report["drafter"], "overall": overall})
            print(f"  {name} {which:<7} {setting_label(kind, candidate.setting):<44} tau {overall['tau']:.2f}  "
                  f"draft {overall['draft_cost_per_step']:.2f} + verify {overall['verify_cost_per_step']:.2f} "
                  f"fwd/step  speedup {overall['speedup_ratio_of_totals']:.2f}x (predicted "
                  f"{candidate.speedup:.2f}x)  {overall['lossless_check']}", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| drafter | setting | tau | acceptance by depth | draft cost / step (target fwd) | verify cost / step | "
             "tok/s spec | tok/s plain | speedup (ratio of totals) | lossless |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        o = r["overall"]
        depth = " ".join(f"{x:.2f}" for x in o.get("acceptance_by_depth") or [])
        lossless = lossless_label(o)
        setting = ", ".join(f"{k} {v}" for k, v in r["setting"].items() if k != "paths")
        if r.get("which"):
            setting = f"{r['which']}: {setting}"
        lines.append(f"| {r['run']} | {setting} | {fmt(o['tau'])} | {depth} | {fmt(o['draft_cost_per_step'])} | "
                     f"{fmt(o['verify_cost_per_step'])} | {fmt(o['tokens_per_s'], 0)} | "
                     f"{fmt(o['baseline_tokens_per_s'], 0)} | {fmt(o['speedup_ratio_of_totals'], 2, 'x')} | "
                     f"{lossless} |")
    return "\n".join(lines)


def comparison(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's ratios: DFlash's best setting against EAGLE-3's best (with --tune: each at its tuned setting),
    on draft cost and on speedup."""
    def best(run: str) -> dict[str, Any]:
        own = [r for r in rows if r["run"] == run and r.get("which", "tuned") == "tuned"]
        return max(own, key=lambda r: r["overall"]["speedup_ratio_of_totals"])

    e, d = best("eagle3"), best("dflash")
    eo, do = e["overall"], d["overall"]
    return {"eagle3_best": e["label"], "dflash_best": d["label"],
            "draft_cost_ratio": do["draft_cost_per_step"] / eo["draft_cost_per_step"],
            "speedup_ratio": do["speedup_ratio_of_totals"] / eo["speedup_ratio_of_totals"],
            "tau_eagle3": eo["tau"], "tau_dflash": do["tau"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file with every number")
    parser.add_argument("--work", type=Path, help="scratch folder (default: <out without .json>_work)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of each training run (equal budget)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences (of the recipes' 256 tokens) per step")
    parser.add_argument("--per-domain", type=int, default=6, help="held-out prompts per domain (3 domains)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the 2 cores are shared)")
    parser.add_argument("--skip-training", action="store_true", help="evaluate the heads already in --work")
    parser.add_argument("--train", nargs="+", choices=[name for name, _ in RUNS], default=[name for name, _ in RUNS],
                        help="the runs to train (the others' heads are read from --work, trained earlier)")
    parser.add_argument("--override", nargs="*", default=[],
                        help="RUN:key=value recipe overrides of one run, e.g. dflash:head.max_anchors=256 (an equal "
                             "budget means the same data, steps and batch: leave those to --steps/--micro-batch)")
    parser.add_argument("--tune", action="store_true",
                        help="instead of the fixed settings: profile this machine and `specgraft tune` both heads, "
                             "then compare the tuned settings (writes tuned.json beside each head in --work)")
    add_result_arguments(parser, "dflash-vs-eagle3-stories260k")
    args = parser.parse_args()
    overrides = parse_run_overrides(args.override, [name for name, _ in RUNS])

    started = time.perf_counter()
    work = scratch_folder(args)
    model_dir, split = prepare_stories260k(work, args.per_domain)
    print(f"data: {split['train_lines']} training lines, {split['num_prompts']} held-out prompts", flush=True)

    runs: dict[str, dict[str, Any]] = {}
    for name, recipe in RUNS:
        if args.skip_training or name not in args.train:
            head_dir = work / "runs" / f"{name}-online" / "head"
            if not head_dir.is_dir():
                print(f"error: no trained {name} head in {head_dir}; train it here first (--train {name})",
                      file=sys.stderr)
                return 2
            runs[name] = {"head": name, "head_dir": str(head_dir)}
            continue
        run = train_one(name, recipe, "online", model_dir, split, work, args,
                        extra_overrides=tuple(overrides.get(name, ())))
        runs[name] = run
        s = run["summary"]
        print(f"  train {name:<6} {s['steps']} steps  {s['tokens_seen']:,} tokens  "
              f"{s['steady_tokens_per_s']:,.0f} tok/s  {run['wall_s']:.0f} s", flush=True)

    if args.tune:
        rows = tune_both(model_dir, runs, split, work, args)
    else:
        rows = evaluate(model_dir, runs, list(DEFAULT_SETTINGS), split, work, args)
    summary = comparison(rows)
    print()
    print(table(rows))
    print(f"\nDFlash best ({summary['dflash_best']}) vs EAGLE-3 best ({summary['eagle3_best']}): draft cost "
          f"{summary['draft_cost_ratio']:.2f}x EAGLE-3's, speedup {summary['speedup_ratio']:.2f}x EAGLE-3's; tau "
          f"{summary['tau_dflash']:.2f} vs {summary['tau_eagle3']:.2f}")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "split": split,
              "training": {n: {k: v for k, v in r.items() if k != "curves"} for n, r in runs.items()},
              "eval": rows, "comparison": summary, "wall_s": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({record['wall_s']:.0f} s)")
    figures = [{"drafter": r["run"], "which": r.get("which", "fixed"),
                "setting": ", ".join(f"{k} {v}" for k, v in r["setting"].items() if k != "paths"),
                **({"predicted_speedup": r["predicted_speedup"]} if "predicted_speedup" in r else {}),
                **eval_figures(r["overall"])} for r in rows]
    write_result(args.result_name, {"settings": figures, "comparison": [summary]},
                 title="DFlash vs EAGLE-3 at an equal training budget on stories260K"
                       + (", each at its tuned setting" if args.tune else ""),
                 dtype="float32", threads=args.threads, results_dir=args.results_dir,
                 details={"args": record["args"], "split": split, "full_record": str(args.out)})
    return 0 if all(r["overall"]["lossless_passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
