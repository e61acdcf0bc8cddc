"""Where one head-training step's time goes, per algorithm and feature mode, at a bench_head_training size.

The step is the trainer's own (``HeadTrainer.setup()`` builds the step module, AdamW and the data loader), taken
apart with wall-clock timers: data loading (next batch, collate, cached features), target forward (no grad),
the draft layers' forward (EAGLE: ``features_forward`` / EAGLE-3: ``ttt_outputs``; Medusa's residual blocks are in
the loss), the loss (vocabulary projection + cross-entropy, metrics), backward, optimizer (clip + AdamW + scheduler +
zero_grad), and the two per-micro-step host reads the trainer does (``torch.isfinite(loss)``, the token count).
Medians over the steps after the first.

    python benchmarks/profile_head_step.py --algorithms medusa eagle eagle3 --features online offline --steps 12
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from benchlib.results import add_result_arguments, write_result
from benchlib.synthetic import ALGORITHMS, SIZES, build_target, head_config, make_dataset

PHASES = ("data", "target forward", "draft layers forward", "loss", "backward", "optimizer", "host reads")


def profile(algorithm: str, features: str, size_name: str, steps: int) -> dict[str, float]:
    from specgraft.config import DataConfig, ModelConfig, OutputConfig, Recipe, TrackingConfig, TrainingConfig
    from specgraft.target import TargetOutput
    from specgraft.train.trainer import HeadTrainer

    size = SIZES[size_name]
    target = build_target(size)
    times: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as out:
        recipe = Recipe(
            model=ModelConfig("bench-target"), data=DataConfig("in-memory", max_length=size.seq_len),
            output=OutputConfig(out, overwrite=True), head=head_config(algorithm, size),
            training=TrainingConfig(max_steps=steps, micro_batch_size=size.sequences, features=features),
            tracking=TrackingConfig(backend="none"),
        )
        trainer = HeadTrainer(recipe, target=target, dataset=make_dataset(size, size.sequences * steps),
                              show_progress=False)
        trainer.setup()
        step_module, head = trainer.unwrapped(), trainer.unwrapped_head()
        draft_name = "ttt_outputs" if hasattr(head, "ttt_outputs") else "features_forward"
        draft_seconds = [0.0]
        if hasattr(head, draft_name):
            original = getattr(head, draft_name)

            def timed_draft(*args, **kwargs):
                start = time.perf_counter()
                result = original(*args, **kwargs)
                draft_seconds[0] += time.perf_counter() - start
                return result

            setattr(head, draft_name, timed_draft)
        loader = iter(trainer.loader)
        for step in range(steps):
            head.metrics_enabled = False  # as on the trainer's steps that are not logged
            draft_seconds[0] = 0.0
            t0 = time.perf_counter()
            batch = next(loader)
            t1 = time.perf_counter()
            with torch.no_grad():
                if "features" in batch:
                    cached = batch["features"]
                    logits = target.logits_from_hidden(cached[target.num_layers]) if step_module.need_logits \
                        else None
                    target_out = TargetOutput(logits=logits, hidden_states={i: cached[i] for i in step_module.layers})
                else:
                    target_out = target(batch["input_ids"], batch["attention_mask"], layers=step_module.layers,
                                        logits=step_module.need_logits)
            t2 = time.perf_counter()
            loss = head.training_loss(batch, target_out).loss
            t3 = time.perf_counter()
            loss.backward()
            t4 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(head.parameters(), recipe.training.max_grad_norm)
            trainer.optimizer.step()
            trainer.scheduler.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            t5 = time.perf_counter()
            bool(torch.isfinite(loss.detach()))
            int(batch["attention_mask"].sum())
            t6 = time.perf_counter()
            if step == 0:
                continue  # warm-up
            for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, draft_seconds[0], t3 - t2 - draft_seconds[0],
                                              t4 - t3, t5 - t4, t6 - t5)):
                times[name].append(seconds)
        trainer.cleanup()
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--features", nargs="+", default=["online"], choices=["online", "offline"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    add_result_arguments(parser, "", default_help="head-step-profile-SIZE")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(args.threads)
    print(f"size {args.size}, {args.threads} thread(s); median ms per step (share of the step)")
    print(f"{'algorithm/features':<18} " + " ".join(f"{p:>22}" for p in PHASES))
    figures = []
    for algorithm in args.algorithms:
        for features in args.features:
            split = profile(algorithm, features, args.size, args.steps)
            total = sum(split.values())
            cells = " ".join(f"{1e3 * split[p]:>13.2f} ({100 * split[p] / total:4.1f}%)" for p in PHASES)
            print(f"{algorithm + '/' + features:<18} {cells}   total {1e3 * total:.1f} ms", flush=True)
            figures.append({"algorithm": algorithm, "features": features, "total_ms": 1e3 * total,
                            **{f"{p.replace(' ', '_')}_ms": 1e3 * split[p] for p in PHASES}})
    write_result(args.result_name or f"head-step-profile-{args.size}", figures,
                 title=f"Where one head-training step's time goes, {args.size} target (median ms over "
                       f"{args.steps - 1} steps)", dtype="float32", threads=args.threads, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
