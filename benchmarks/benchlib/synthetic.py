"""Synthetic head-training setups of the training benchmarks: random-weight Llama targets at two sizes, each head
family's config at the benchmarks' draft size, and random-token datasets (nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchSize:
    vocab: int
    hidden: int
    layers: int
    attention_heads: int
    kv_heads: int
    intermediate: int
    sequences: int
    seq_len: int


SIZES = {
    # The peers' harness target (../shared/peers/common/make_tiny.py): the same shapes, so a side-by-side ratio
    # compares the same work (its MLP width is 128; an earlier 172 made our target and draft layers 34% wider).
    "tiny": BenchSize(vocab=512, hidden=64, layers=2, attention_heads=4, kv_heads=2, intermediate=128,
                      sequences=4, seq_len=256),
    # SmolLM2-135M-Instruct's width, heads and vocabulary (its config.json), 4 of its 30 layers.
    "smollm2": BenchSize(vocab=49152, hidden=576, layers=4, attention_heads=9, kv_heads=3, intermediate=1536,
                         sequences=1, seq_len=2048),
}
HEADS, TTT_STEPS, DRAFT_LAYERS = 3, 3, 1


def build_target(size: BenchSize) -> Any:
    """A random-weight Llama ``Target`` of ``size`` (seeded: every run builds the same one)."""
    import torch

    from specgraft.target import Target
    from specgraft.testing import tiny_model

    torch.manual_seed(0)
    return Target(tiny_model("llama", vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                             num_attention_heads=size.attention_heads, num_key_value_heads=size.kv_heads,
                             intermediate_size=size.intermediate, max_position_embeddings=max(1024, size.seq_len)))


ALGORITHMS = ("medusa", "eagle", "eagle3", "dflash")


def head_config(algorithm: str, size: BenchSize) -> Any:
    """The head section of ``algorithm`` (one of :data:`ALGORITHMS`) at the benchmark's draft size."""
    from specgraft.heads.dflash.config import DFlashConfig
    from specgraft.heads.eagle.config import EagleConfig
    from specgraft.heads.eagle3.config import Eagle3Config
    from specgraft.heads.medusa.config import MedusaConfig

    if algorithm == "eagle3":
        return Eagle3Config(num_layers=DRAFT_LAYERS, ttt_steps=TTT_STEPS,
                            feature_layers=[0, size.layers // 2, size.layers])
    if algorithm == "eagle":  # EAGLE-1/2 as the EAGLE repo trains it: one pass (no HASS unrolling)
        return EagleConfig(num_layers=DRAFT_LAYERS)
    if algorithm == "medusa":
        return MedusaConfig(num_heads=HEADS, num_layers=DRAFT_LAYERS)
    if algorithm == "dflash":  # defaults: block 8, up to 512 anchors per sequence; ids 0-2 never occur in the data
        return DFlashConfig(num_layers=DRAFT_LAYERS, mask_token_id=0)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")


def make_dataset(size: BenchSize, num_sequences: int, seed: int = 0) -> Any:
    """``num_sequences`` rows of ``size.seq_len`` random tokens (ids from 3: 0-2 are special), every token trained."""
    import datasets
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, size.vocab, (num_sequences, size.seq_len), generator=gen)
    ones = [[1] * size.seq_len] * num_sequences
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": ones, "loss_mask": ones})
