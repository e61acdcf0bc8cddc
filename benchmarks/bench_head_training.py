"""Head-training throughput at the peers' reference configuration, with the ratio to the best peer.

Configuration (fixed, as in the brief): fp32 on CPU, tiny Llama target (vocab 512, hidden 64, 2 layers),
4 sequences x 256 tokens per optimizer step, 3 Medusa heads / 3 EAGLE-3 training-time-test steps, 1 draft layer.
It runs our real trainer (``HeadTrainer``: target forward, head loss, backward, clipping, AdamW, scheduler) and
reports target tokens per second after the first step. Peer numbers were measured on this kind of machine at the
same configuration (see the README's results section).

    python benchmarks/bench_head_training.py                 # all algorithms
    python benchmarks/bench_head_training.py --algorithms medusa --steps 60
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile

import datasets
import torch

from specgraft.config import DataConfig, HeadConfig, ModelConfig, OutputConfig, Recipe, TrackingConfig, TrainingConfig
from specgraft.target import Target
from specgraft.testing import tiny_model
from specgraft.train.trainer import HeadTrainer

#: Best published/measured peer throughput (target tokens/s) per (algorithm, feature mode), and who it is.
PEERS = {
    ("medusa", "online"): (38_000, "Model-Optimizer Medusa (35-38k)"),
    ("medusa", "offline"): (38_000, "Model-Optimizer Medusa, online (no offline peer)"),
    ("eagle", "online"): (12_900, "EAGLE repo EAGLE-1, cached (no online peer)"),
    ("eagle3", "online"): (9_000, "Model-Optimizer EAGLE-3 online (9.0k)"),
    ("eagle", "offline"): (12_900, "EAGLE repo EAGLE-1 cached (12.9k)"),
    ("eagle3", "offline"): (11_800, "SpecForge EAGLE-3 cached (11.8k)"),
}
REQUIRED_RATIO = 1.5

VOCAB, HIDDEN, LAYERS, SEQS, SEQ_LEN = 512, 64, 2, 4, 256


def make_dataset(num_sequences: int, seed: int = 0) -> datasets.Dataset:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (num_sequences, SEQ_LEN), generator=gen)
    ones = [[1] * SEQ_LEN] * num_sequences
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": ones, "loss_mask": ones})


def measure(algorithm: str, steps: int, features: str) -> dict:
    target = Target(tiny_model("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=172,
                               max_position_embeddings=1024))
    head = HeadConfig(type=algorithm, num_heads=3, num_layers=1, ttt_steps=3,
                      feature_layers=[0, 1, 2] if algorithm == "eagle3" else None)
    with tempfile.TemporaryDirectory() as out:
        recipe = Recipe(
            model=ModelConfig("tiny-llama-bench"), data=DataConfig("in-memory", max_length=SEQ_LEN),
            output=OutputConfig(out, overwrite=True), head=head,
            training=TrainingConfig(max_steps=steps, micro_batch_size=SEQS, checkpoint_every=10 * steps,
                                    log_every=10 * steps, features=features),
            tracking=TrackingConfig(backend="none"),
        )
        trainer = HeadTrainer(recipe, target=target, dataset=make_dataset(SEQS * steps), show_progress=False)
        trainer.setup()
        summary = trainer.train()
        trainer.cleanup()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["medusa", "eagle", "eagle3"])
    parser.add_argument("--features", nargs="+", default=["online"], choices=["online", "offline"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the machine has 2 cores).")
    parser.add_argument("--json", help="Also write the results to this JSON file.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    rows = []
    print(f"{'algorithm':<8} {'features':<8} {'ours tok/s':>11} {'peer tok/s':>11} {'ratio':>6} {'goal':>5}  "
          f"{'peak MiB':>8}  peer")
    for algorithm in args.algorithms:
        for features in args.features:
            summary = measure(algorithm, args.steps, features)
            peer, who = PEERS[(algorithm, features)]
            ours = summary["steady_tokens_per_s"]
            ratio = ours / peer
            rows.append({"algorithm": algorithm, "features": features, "tokens_per_s": ours, "peer": who,
                         "peer_tokens_per_s": peer, "ratio": ratio,
                         "peak_memory_mib": summary["peak_memory_bytes"] / 2**20})
            ok = "ok" if ratio >= REQUIRED_RATIO else "MISS"
            print(f"{algorithm:<8} {features:<8} {ours:>11,.0f} {peer:>11,} {ratio:>6.2f} {ok:>5}  "
                  f"{summary['peak_memory_bytes'] / 2**20:>8.0f}  {who}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
