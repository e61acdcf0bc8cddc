"""Compressed offline feature caches on stories260K: bytes/token, reconstruction error and held-out tau.

For each ``training.feature_dtype`` in ``--dtypes`` (default: bfloat16, the uncompressed cache, and vq) and each
training seed in ``--seeds``, trains the shipped ``recipes/eagle3/stories260k.yaml`` (or ``--recipe``) with
``training.features=offline`` through the real ``specgraft train`` command line (``benchlib.stages``'
``train_one``: same data split, steps and batch for every run), then

* reads the cache's bytes/token (every byte of it: shards, row offsets, codec tables) against EAGLE-1's full fp16
  hidden state (2 h B/token),
* decodes every compressed cache and compares it with the uncompressed cache of the same seed (same rows): the
  relative error ||x' - x|| / ||x|| per stored layer, and how often the target's top-1 token recomputed from the
  decoded last layer equals the one from the uncompressed layer (the soft targets' argmax),
* evaluates each head on the held-out TinyStories prompts (``benchlib.stories``; greedy, tree mode)
  and records tau, tau per domain and the lossless check.

Exits 1 when a lossless check fails.

    python benchmarks/bench_feature_cache.py --out runs/bench-cache/stories260k.json
    python benchmarks/bench_feature_cache.py --out /tmp/c.json --steps 50 --per-domain 2 --seeds 0   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, write_result
from benchlib.stages import scratch_folder, train_one
from benchlib.stories import prepare_stories260k


def reconstruction(target: Any, reference_dir: Path, compressed_dir: Path) -> dict[str, Any]:
    """Relative error per layer and top-1 agreement of the last layer's logits, compressed vs reference cache."""
    import torch

    from specgraft.train.features import open_feature_cache

    ref = json.loads((reference_dir / "index.json").read_text())
    layers = tuple(ref["layers"])
    a = open_feature_cache(reference_dir, target, layers)
    b = open_feature_cache(compressed_dir, target, layers)
    err_sq = {i: 0.0 for i in layers}
    norm_sq = {i: 0.0 for i in layers}
    agree = total = 0
    for row in range(a.info.rows):
        x, y = a.decoded(row), b.decoded(row)
        for i in layers:
            xi, yi = x[i], y[i]
            err_sq[i] += float((xi - yi).pow(2).sum())
            norm_sq[i] += float(xi.pow(2).sum())
        last = max(layers)
        if last == target.num_layers:
            with torch.no_grad():
                top_x = target.logits_from_hidden(x[last]).argmax(-1)
                top_y = target.logits_from_hidden(y[last]).argmax(-1)
            agree += int((top_x == top_y).sum())
            total += top_x.numel()
    return {"relative_error_by_layer": {str(i): (err_sq[i] / norm_sq[i]) ** 0.5 for i in layers},
            "top1_agreement_last_layer": agree / total if total else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file with every number")
    parser.add_argument("--work", type=Path, help="scratch folder (default: <out without .json>_work)")
    parser.add_argument("--recipe", default="recipes/eagle3/stories260k.yaml")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "vq"],
                        help="training.feature_dtype of each run; the first is the reference cache")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="training.seed of each run")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of every training run")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences (of the recipes' 256 tokens) per step")
    parser.add_argument("--per-domain", type=int, default=6, help="held-out prompts per domain (3 domains)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the 2 cores are shared)")
    add_result_arguments(parser, "feature-cache-stories260k")
    args = parser.parse_args()

    import torch

    from specgraft.evaluation.prompts import load_prompts
    from specgraft.evaluation.report import EvalSettings, describe_drafter, run_eval
    from specgraft.heads import load_head
    from specgraft.heads.eagle.drafter import EagleDrafter
    from specgraft.target import load_target

    started = time.perf_counter()
    work = scratch_folder(args)
    model_dir, split = prepare_stories260k(work, args.per_domain)
    torch.set_num_threads(args.threads)
    target = load_target(model_dir)
    prompts = load_prompts(split["prompts_file"])
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, repeats=1, warmup=0)

    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for dtype in args.dtypes:
            name = f"{dtype}-seed{seed}"
            run = train_one("eagle3", args.recipe, "offline", model_dir, split, work, args,
                            extra_overrides=(f"training.feature_dtype={dtype}", f"training.seed={seed}"),
                            run_name=name)
            s = run.pop("summary")
            head = load_head(target, run["head_dir"])
            head.eval()
            drafter = EagleDrafter(head, mode="tree")
            report = run_eval(target, drafter, prompts, work / "eval" / name, settings=settings,
                              drafter_info={**describe_drafter(drafter), "path": run["head_dir"]}, progress=False)
            overall = report["overall"]
            row = {"dtype": dtype, "seed": seed, "command": run["command"], "wall_s": run["wall_s"],
                   "loss_last": run["loss_last"],
                   "cache": {k: s.get(k) for k in ("feature_cache_bytes", "feature_cache_bytes_per_token",
                                                   "feature_cache_payload_bytes_per_token", "feature_cache_dtype",
                                                   "eagle1_fp16_bytes_per_token")},
                   "tau": overall["tau"], "lossless": overall["lossless_passed"],
                   "lossless_check": overall["lossless_check"],
                   "tau_by_domain": {d: v.get("tau") for d, v in report["domains"].items()}}
            reference = next((r for r in runs if r["seed"] == seed and r["dtype"] == args.dtypes[0]), None)
            if reference is not None:
                row["reconstruction"] = reconstruction(target, Path(reference["cache_dir"]),
                                                       Path(run["head_dir"]).parent / "features")
            row["cache_dir"] = str(Path(run["head_dir"]).parent / "features")
            runs.append(row)
            c = row["cache"]
            print(f"  {name:<16} {c['feature_cache_bytes_per_token']:>7.2f} B/token "
                  f"({c['feature_cache_bytes_per_token'] / c['eagle1_fp16_bytes_per_token']:.3f}x EAGLE-1's "
                  f"{c['eagle1_fp16_bytes_per_token']}) tau {row['tau']:.3f} {row['lossless_check']} "
                  f"{json.dumps(row.get('reconstruction', {}))}", flush=True)

    by_dtype = {d: [r["tau"] for r in runs if r["dtype"] == d] for d in args.dtypes}
    summary = {d: {"tau_mean": statistics.fmean(t), "tau_by_seed": t,
                   "tau_seed_spread": max(t) - min(t)} for d, t in by_dtype.items()}
    print(json.dumps(summary, indent=1))
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "data": split, "runs": runs,
              "summary": summary, "all_lossless": all(r["lossless"] for r in runs),
              "total_wall_s": time.perf_counter() - started}
    from specgraft.utils.io import atomic_write_json

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    figures = []
    for r in runs:
        c, rec = r["cache"], r.get("reconstruction", {})
        errors = rec.get("relative_error_by_layer", {})
        figures.append({"feature_dtype": r["dtype"], "seed": r["seed"],
                        "cache_bytes_per_token": c["feature_cache_bytes_per_token"],
                        "eagle1_fp16_bytes_per_token": c["eagle1_fp16_bytes_per_token"],
                        "max_relative_error": max(errors.values()) if errors else None,
                        "top1_agreement_last_layer": rec.get("top1_agreement_last_layer"),
                        "tau": r["tau"], "lossless": r["lossless_check"]})
    write_result(args.result_name, figures,
                 title="Compressed offline feature caches for EAGLE-3 on stories260K: bytes/token, error, tau",
                 dtype="float32", threads=args.threads, results_dir=args.results_dir,
                 details={"summary": summary, "settings": result["settings"], "full_record": str(args.out)})
    return 0 if result["all_lossless"] else 1


if __name__ == "__main__":
    sys.exit(main())
