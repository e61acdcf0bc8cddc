"""Draft distillation on the real (tiny) stories260K target: does training on the target's outputs beat training on
the data, and which loss / data source accepts best?

Every variant starts from the same student (layers 0 and 3 of the target's 5, weights copied) and gets the same
budget (steps x micro-batch x length) on the same TinyStories rows:

* ``data-CE``: the baseline, plain next-token cross-entropy on the raw text (no target involved in training);
* ``FKL`` / ``TVD``: distillation against the target's distribution on the same rows;
* ``... +on-policy``: plus GKD batches (probability ``--lmbda``) made of the student's own continuations, scored by
  the target.

Reported per variant: held-out alpha_exact (mean over positions of sum_x min(p, q), T=1) and top-1 agreement on the
eval split; tau (mean accepted length incl. the bonus token; field notes section 5) of the eval module's lossless
SpeculativeDecoder with a DraftModelDrafter (chain of ``--k`` tokens), greedy and sampled at T=1, on prompts cut
from held-out stories. For the best variant (greedy tau), the wall-clock speedup over plain decoding of the same
target on the same prompts (same decoder loop without a drafter, after warm-up, ``--repeats`` runs), as the mean of
per-prompt ratios and the ratio of totals.

    python benchmarks/bench_distill.py                         # default budget: about 10 minutes on 2 cores
    python benchmarks/bench_distill.py --steps 400 --result-name distill-stories260k-400
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch
from benchlib.results import add_result_arguments, write_result
from benchlib.stories import STORIES_DIR, TINYSTORIES, stories260k_target

from specgraft.config import (
    DataConfig,
    DistillConfig,
    DistillRecipe,
    ModelConfig,
    OutputConfig,
    TrackingConfig,
    TrainingConfig,
)
from specgraft.data import build_dataset
from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.drafters import DraftModelDrafter
from specgraft.decoding.metrics import speedup, summarize
from specgraft.distill.trainer import OBJECTIVE_DATA_CE, OBJECTIVE_DISTILL, DistillTrainer
from specgraft.target import load_target

#: name -> (objective, loss, on-policy)
VARIANTS = {
    "data-CE": (OBJECTIVE_DATA_CE, "fkl", False),
    "FKL": (OBJECTIVE_DISTILL, "fkl", False),
    "TVD": (OBJECTIVE_DISTILL, "tvd", False),
    "FKL+on-policy": (OBJECTIVE_DISTILL, "fkl", True),
    "TVD+on-policy": (OBJECTIVE_DISTILL, "tvd", True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=STORIES_DIR, help="folder with stories260K.bin, tok512.bin")
    p.add_argument("--data", type=Path, default=TINYSTORIES, help="TinyStories text")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per variant")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--max-length", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--keep-every-k", type=int, default=3, help="student = target layers 0, k, 2k, ...")
    p.add_argument("--lmbda", type=float, default=0.5, help="on-policy batch probability of the +on-policy variants")
    p.add_argument("--onpolicy-new-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts for tau and speedup")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="draft chain length for tau")
    p.add_argument("--speedup-k", type=int, nargs="+", default=[1, 2, 4], help="chain lengths timed for speedup")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the speedup measurement")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: tiny matrices gain nothing, and spinning threads thrash on a shared CPU)")
    p.add_argument("--seed", type=int, default=0)
    add_result_arguments(p, "distill-stories260k")
    return p.parse_args()


def recipe_for(args: argparse.Namespace, loss: str, onpolicy: bool, out: Path) -> DistillRecipe:
    return DistillRecipe(
        model=ModelConfig("stories260K"),
        data=DataConfig(str(args.data), format="text", max_length=args.max_length, packing=True),
        output=OutputConfig(str(out), overwrite=True),
        distill=DistillConfig(keep_every_k_layers=args.keep_every_k, loss=loss, lmbda=args.lmbda if onpolicy else 0.0,
                              onpolicy_max_new_tokens=args.onpolicy_new_tokens, alpha_eval_every=args.steps),
        training=TrainingConfig(seed=args.seed, max_steps=args.steps, micro_batch_size=args.batch,
                                learning_rate=args.lr, warmup_steps=max(1, args.steps // 20),
                                checkpoint_every=10 * args.steps, log_every=args.steps),
        tracking=TrackingConfig(backend="none"),
    )


def decode(target, student, prompts, args, temperature: float, k: int | None = None) -> list:
    drafter = DraftModelDrafter(student, k=k or args.k) if student is not None else None
    decoder = SpeculativeDecoder(target, drafter=drafter, temperature=temperature, ignore_eos=True, seed=args.seed)
    return [decoder.generate(p, args.new_tokens, seed=args.seed + i) for i, p in enumerate(prompts)]


def timed(target, student, prompts, args, k: int | None = None) -> tuple[list[tuple[int, float]], dict]:
    """Per-prompt (new tokens, best-of-repeats seconds) of greedy decoding after one warm-up pass, and the pooled
    statistics of the last repeat."""
    decode(target, student, prompts[:1], args, 0.0, k)
    best = [float("inf")] * len(prompts)
    tokens = [0] * len(prompts)
    for _ in range(args.repeats):
        results = decode(target, student, prompts, args, 0.0, k)
        for i, r in enumerate(results):
            best[i] = min(best[i], r.wall_time_s)
            tokens[i] = r.num_new_tokens
    return list(zip(tokens, best)), summarize(results)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target_dir = stories260k_target(tmp / "target", args.model_dir)
        target = load_target(target_dir)
        data_cfg = DataConfig(str(args.data), format="text", max_length=args.max_length, packing=True,
                              eval_fraction=0.02, seed=args.seed, cache_dir=str(tmp / "cache"))
        splits = build_dataset(data_cfg, target.tokenizer)
        train, held_out = splits["train"], splits["eval"]
        prompts = [held_out[i]["input_ids"][: args.prompt_tokens] for i in range(args.prompts)]
        print(f"stories260K target; {len(train)} training rows of {args.max_length} tokens, {len(held_out)} held out; "
              f"{args.steps} steps x {args.batch} rows per variant; k={args.k}, {args.new_tokens} new tokens x "
              f"{args.prompts} prompts")

        rows, students = [], {}
        for name in ["initial", *args.variants]:
            objective, loss, onpolicy = VARIANTS.get(name, (OBJECTIVE_DISTILL, "fkl", False))
            recipe = recipe_for(args, loss, onpolicy, tmp / "runs" / name)
            trainer = DistillTrainer(recipe, target=target, dataset=train, eval_dataset=held_out,
                                     show_progress=False, objective=objective)
            trainer.setup()
            t0 = time.perf_counter()
            if name != "initial":
                trainer.train()
            train_s = time.perf_counter() - t0
            held = trainer.evaluate_alpha()
            trainer.cleanup()
            student = trainer.student.eval()
            greedy = summarize(decode(target, student, prompts, args, 0.0))
            sampled = summarize(decode(target, student, prompts, args, 1.0))
            rows.append({"variant": name, "alpha_exact": held["alpha_exact"], "top1": held["top1"],
                         "tau_greedy": greedy["tau"], "tau_sampled": sampled["tau"],
                         "alpha_decoder_T1": sampled["alpha_exact"], "train_s": train_s})
            students[name] = student
            print(f"  {name:14s} alpha {held['alpha_exact']:.4f}  top1 {held['top1']:.4f}  tau greedy "
                  f"{greedy['tau']:.3f}  tau T=1 {sampled['tau']:.3f}  ({train_s:.0f}s training)", flush=True)

        trained = [r for r in rows if r["variant"] != "initial"]
        best = max(trained, key=lambda r: r["tau_greedy"])
        base, base_stats = timed(target, None, prompts, args)
        target_forward_s = base_stats["wall_time_s"] / base_stats["target_forwards"]
        plain_tps = sum(t for t, _ in base) / sum(s for _, s in base)
        timings = []
        for k in args.speedup_k:
            spec, stats = timed(target, students[best["variant"]], prompts, args, k)
            ratio = speedup(base, spec)
            # One draft forward per depth per step (the catch-up forward includes the root).
            draft_forward_s = stats["draft_time_s"] / max(stats["steps"] * k, 1)
            timings.append({"k": k, "tau": stats["tau"], **ratio,
                            "tokens_per_s": sum(t for t, _ in spec) / sum(s for _, s in spec),
                            "draft_to_target_cost": draft_forward_s / target_forward_s})

    print()
    print("| variant | held-out alpha_exact | top-1 agree | tau greedy | tau T=1 | train s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['alpha_exact']:.4f} | {r['top1']:.4f} | {r['tau_greedy']:.3f} | "
              f"{r['tau_sampled']:.3f} | {r['train_s']:.0f} |")
    print(f"\nwall-clock, greedy, best variant {best['variant']} vs plain decoding ({plain_tps:.1f} tok/s):")
    print("| k | tau | tok/s | speedup (mean of ratios) | speedup (ratio of totals) | draft/target forward cost |")
    print("|---|---|---|---|---|---|")
    for t in timings:
        print(f"| {t['k']} | {t['tau']:.3f} | {t['tokens_per_s']:.1f} | {t['mean_of_ratios']:.3f}x | "
              f"{t['ratio_of_totals']:.3f}x | {t['draft_to_target_cost']:.2f} |")
    print(f"total {time.perf_counter() - started:.0f}s")
    write_result(args.result_name, {"variants": rows, f"speedup of {best['variant']}": timings},
                 title=f"Draft distillation on stories260K: {len(args.variants)} losses and data sources at one "
                       "budget, held-out acceptance and wall-clock speedup",
                 dtype="float32", threads=args.threads, results_dir=args.results_dir,
                 details={"settings": {k: str(v) for k, v in vars(args).items()}, "best": best["variant"],
                          "plain_tokens_per_s": plain_tps})


if __name__ == "__main__":
    main()
