"""What the llama.cpp oracle tests share: the prompt length, the chain lengths, and the step-by-step comparison of
llama.cpp's acceptance with specgraft's (schedules aligned as test_eagle3_in_engine.py's docstring explains)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specgraft.export.llamacpp_engine import LlamaServer

NEW_TOKENS = 48
CHAINS = (1, 2, 3, 4)
#: Steps allowed to differ per chain length (near-ties between ggml's and torch's float sums).
MAX_DIFFERING_STEPS = 2


@dataclass
class Comparison:
    chain: int
    steps: int
    """Steps compared (llama.cpp drafted the full chain)."""
    differing_steps: int
    engine_accepted: int
    specgraft_accepted: int

    @property
    def agrees(self) -> bool:
        return self.differing_steps <= MAX_DIFFERING_STEPS


def compare(chain: int, engine: list, ours: list) -> Comparison:
    """Per-step acceptance of llama.cpp vs specgraft over the steps where llama.cpp drafted the full chain."""
    steps = differing = engine_total = ours_total = 0
    for run, result in zip(engine, ours):
        full = [accepted for accepted, drafted in run.steps if drafted == chain]
        # Full drafts come first; after the first shortened draft the two schedules part ways.
        first_short = next((i for i, (_, d) in enumerate(run.steps) if d != chain), len(run.steps))
        full = full[:first_short]
        mine = list(result.accepted_lengths[:len(full)])
        steps += len(full)
        differing += sum(a != b for a, b in zip(full, mine)) + abs(len(full) - len(mine))
        engine_total += sum(full)
        ours_total += sum(mine)
    return Comparison(chain, steps, differing, engine_total, ours_total)


def engine_runs(args: list, prompts: list[list[int]]) -> list:
    """Greedy completions of ``prompts`` by one llama-server started with ``args``."""
    with LlamaServer(args) as server:
        return [server.complete(ids, NEW_TOKENS) for ids in prompts]


def speculative_args(target_gguf: Path, draft: Path, spec_type: str, chain: int) -> list:
    """llama-server's arguments for ``draft`` drafting ``chain`` tokens a step (every draft verified)."""
    return ["-m", target_gguf, "-md", draft, "--spec-type", spec_type, "--spec-draft-n-max", chain,
            "--spec-draft-p-min", 0]
