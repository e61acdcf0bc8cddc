"""Head-training throughput and peak memory of our trainer; the ratio to a peer only from a figure measured with it.

Two configurations, random weights (nothing is downloaded), fp32 on CPU:

* ``tiny`` (the peers' reference configuration): Llama target vocab 512, hidden 64, MLP 128, 2 layers, 4 heads /
  2 KV heads; 4 sequences x 256 tokens per optimizer step.
* ``smollm2``: a target of SmolLM2-135M-Instruct's width and vocabulary (hidden 576, 9 heads / 3 KV heads,
  intermediate 1536, vocab 49152) with only 4 layers; 1 sequence x 2048 tokens per step; the EAGLE-3 draft
  vocabulary is the default min(32000, V). Here FLOPs and the vocabulary-sized logits dominate, not Python.

Both: 3 Medusa heads / 3 EAGLE-3 training-time-test steps / DFlash blocks of 8 (up to 512 anchors per sequence),
1 draft layer. It runs our real trainer (``HeadTrainer``:
target forward, head loss, backward, clipping, AdamW, scheduler) and reports target tokens per second after the
first step and the peak RSS; with several configurations each (algorithm, features) runs in a fresh subprocess, so
the peak RSS is that configuration's (a single one runs in this process).

``--loss-memory`` instead measures the head loss alone (``training_loss`` forward + backward on one batch, target
features computed beforehand): its time and its peak RSS above the RSS just before it (Linux: the peak is reset
through /proc/self/clear_refs); for EAGLE-3 also its vocabulary part alone (draft lm_head, target distribution
and soft cross-entropy, with the draft layers' TTT outputs computed beforehand).

The benchmark embeds no peer figure. To compare with a peer, run the peer side by side (alternating rounds, same
machine, same configuration: the harness in ../shared/peers, see its README) and pass its tokens/s from that
session with ``--peer NAME=TOKENS_PER_S``; the ratio printed is ours / the peer's.

    python benchmarks/bench_head_training.py --features online offline --threads 2
    python benchmarks/bench_head_training.py --algorithms medusa --peer Model-Optimizer=45000
    python benchmarks/bench_head_training.py --size smollm2 --algorithms eagle3 --steps 3 --loss-memory
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from benchlib.results import add_result_arguments, write_result
from benchlib.synthetic import ALGORITHMS, SIZES, BenchSize, build_target, head_config, make_dataset


def measure_training(algorithm: str, features: str, size: BenchSize, steps: int, compile_layers: bool = False) -> dict:
    from specgraft.config import DataConfig, ModelConfig, OutputConfig, Recipe, TrackingConfig, TrainingConfig
    from specgraft.train.trainer import HeadTrainer

    target = build_target(size)
    with tempfile.TemporaryDirectory() as out:
        recipe = Recipe(
            model=ModelConfig("bench-target"), data=DataConfig("in-memory", max_length=size.seq_len),
            output=OutputConfig(out, overwrite=True), head=head_config(algorithm, size),
            training=TrainingConfig(max_steps=steps, micro_batch_size=size.sequences, checkpoint_every=10 * steps,
                                    log_every=10 * steps, features=features, compile=compile_layers),
            tracking=TrackingConfig(backend="none"),
        )
        trainer = HeadTrainer(recipe, target=target, dataset=make_dataset(size, size.sequences * steps),
                              show_progress=False)
        trainer.setup()
        summary = trainer.train()
        trainer.cleanup()
    return {"tokens_per_s": summary["steady_tokens_per_s"], "peak_rss_mib": summary["peak_memory_bytes"] / 2**20}


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1))


def measure_loss(algorithm: str, size: BenchSize) -> dict:
    """The head loss alone on one batch: seconds and peak RSS above the RSS before it (forward + backward)."""
    from specgraft.heads import head_class

    target = build_target(size)
    cls = head_class(algorithm)
    head = cls.build(target, head_config(algorithm, size).resolve(target)).train()
    ids = torch.randint(3, size.vocab, (size.sequences, size.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        out = target(ids, batch["attention_mask"], layers=head.required_layers(), logits=cls.needs_target_logits)
    result = {}
    for part in ("head", "vocab"):
        if part == "vocab":
            if not hasattr(head, "ttt_outputs"):
                break
            # The vocabulary part alone: the draft's TTT outputs are computed beforehand (leaves with gradients).
            outputs = [o.detach().requires_grad_() for o in head.ttt_outputs(batch, out)]
            head.ttt_outputs = lambda *_args, given=outputs, **_kwargs: given
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        head.training_loss(batch, out).loss.backward()
        result[f"{part}_seconds"] = time.perf_counter() - start
        result[f"{part}_peak_mib"] = (_status_kib("VmHWM") - before) / 1024
        head.zero_grad(set_to_none=True)
    return result


def run_child(args: argparse.Namespace, algorithm: str, features: str) -> dict:
    """One configuration in a fresh interpreter (its own peak RSS), same PYTHONPATH."""
    cmd = [sys.executable, __file__, "--child", algorithm, features, "--size", args.size, "--steps", str(args.steps),
           "--threads", str(args.threads)] + (["--loss-memory"] if args.loss_memory else []) + \
        (["--compile"] if args.compile else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"error: the {algorithm}/{features} run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_peer(text: str) -> tuple[str, float]:
    name, sep, value = text.rpartition("=")
    try:
        tokens_per_s = float(value)
    except ValueError:
        tokens_per_s = -1.0
    if not sep or not name or tokens_per_s <= 0:
        raise argparse.ArgumentTypeError(f"--peer wants NAME=TOKENS_PER_S with a positive number, got {text!r}")
    return name, tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--features", nargs="+", default=["online"], choices=["online", "offline"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the machine has 2 cores).")
    parser.add_argument("--compile", action="store_true",
                        help="training.compile: torch.compile the head's draft layers (the first steps compile; "
                             "tokens/s is measured after the first step, so give enough --steps).")
    parser.add_argument("--loss-memory", action="store_true",
                        help="Measure the head loss alone (time, peak RSS) instead of whole training steps.")
    parser.add_argument("--peer", action="append", type=parse_peer, default=[], metavar="NAME=TOKENS_PER_S",
                        help="A peer's tokens/s measured side by side in this session (only with one algorithm and "
                             "one features mode); prints our ratio to it.")
    parser.add_argument("--child", nargs=2, metavar=("ALGORITHM", "FEATURES"), help=argparse.SUPPRESS)
    add_result_arguments(parser, "", default_help="head-training-SIZE, with --loss-memory head-loss-memory-SIZE")
    args = parser.parse_args()
    if args.peer and len(args.algorithms) * len(args.features) != 1:
        parser.error("--peer compares with one configuration: give one --algorithms and one --features")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(args.threads)
    size = SIZES[args.size]

    if args.child:
        algorithm, features = args.child
        result = measure_loss(algorithm, size) if args.loss_memory else \
            measure_training(algorithm, features, size, args.steps, args.compile)
        print(json.dumps(result))
        return

    print(f"size {args.size} {asdict(size)}, {args.threads} thread(s), torch {torch.__version__}"
          + (", training.compile" if args.compile else ""))
    rows = []
    configurations = [(a, f) for a in args.algorithms for f in (["online"] if args.loss_memory else args.features)]
    for algorithm, features in configurations:
        if len(configurations) == 1:
            # In this process (its peak RSS is this configuration's); the side-by-side harness times the optimizer
            # steps of the process it starts.
            measured = measure_loss(algorithm, size) if args.loss_memory else \
                measure_training(algorithm, features, size, args.steps, args.compile)
        else:
            measured = run_child(args, algorithm, features)
        row = {"size": args.size, "algorithm": algorithm, "features": features, "compile": args.compile, **measured}
        if args.loss_memory:
            line = f"{algorithm:<8} head loss fwd+bwd {row['head_seconds']:6.2f} s  " \
                   f"peak +{row['head_peak_mib']:6.0f} MiB"
            if "vocab_seconds" in row:
                line += f"   vocabulary part (TTT outputs given) {row['vocab_seconds']:6.2f} s  " \
                        f"peak +{row['vocab_peak_mib']:6.0f} MiB"
            print(line, flush=True)
        else:
            line = f"{algorithm:<8} {features:<8} {row['tokens_per_s']:>11,.0f} tok/s  peak RSS " \
                   f"{row['peak_rss_mib']:>7.0f} MiB"
            for name, peer_tokens_per_s in args.peer:
                row.setdefault("peers", {})[name] = {"tokens_per_s": peer_tokens_per_s,
                                                     "ratio": row["tokens_per_s"] / peer_tokens_per_s}
                line += f"  {row['tokens_per_s'] / peer_tokens_per_s:.2f}x {name} ({peer_tokens_per_s:,.0f})"
            print(line, flush=True)
        rows.append(row)
    what = "head loss alone (forward + backward, one batch)" if args.loss_memory else "head training throughput"
    default_name = f"head-loss-memory-{args.size}" if args.loss_memory else f"head-training-{args.size}"
    figures = [{k: v for k, v in row.items() if k != "peers"}
               | {f"ratio_to_{name}": peer["ratio"] for name, peer in row.get("peers", {}).items()} for row in rows]
    write_result(args.result_name or default_name, figures,
                 title=f"{what}, {args.size} target ({args.steps} steps, random weights)", dtype="float32",
                 threads=args.threads, results_dir=args.results_dir,
                 details={"size": asdict(size), "peers_measured_side_by_side": dict(args.peer)})


if __name__ == "__main__":
    main()
