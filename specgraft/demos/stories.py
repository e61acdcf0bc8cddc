"""The end-to-end demo on the embedded default target (CPU, no downloads): ``specgraft demo``.

``specgraft demo`` grafts Medusa and EAGLE-3 heads onto the small trained target shipped with specgraft, trains
them with the real training pipeline, distills a standalone draft model, evaluates every drafter per domain with
the lossless speculative decoder (tau, acceptance by depth, wall-clock speedup, answers), exports the heads for
vLLM and SGLang, and writes a summary (markdown + PNG). ``--quick`` runs a tiny version (used by the tests).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specgraft.config import DistillRecipe, Recipe
from specgraft.data.regenerate import continue_texts
from specgraft.defaults.corpus import DOMAINS, demo_prompts, prompt_cuts
from specgraft.defaults.target import default_corpus_dataset, default_target_path, default_training_report
from specgraft.demos import demo_drafters
from specgraft.demos.steps import demo_recipe, in_registry_order, run_drafters, write_summary
from specgraft.target import Target, load_target
from specgraft.utils.io import atomic_write_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoBudget:
    """How much the demo trains and evaluates (the full run is sized for minutes on a small CPU)."""

    docs_per_domain: int
    max_length: int
    micro_batch_size: int
    medusa_steps: int
    eagle3_steps: int
    distill_steps: int
    dflash_steps: int
    prompts_per_domain: int
    max_new_tokens: int
    repeats: int
    #: Longest greedy continuation of each training prompt in the self-distilled training file.
    continuation_tokens: int
    #: The device cost profile the tuning step measures (tokens verified at once, timing repeats, draft calls).
    profile_token_counts: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    profile_repeats: int = 5
    draft_calls: int = 15


FULL = DemoBudget(docs_per_domain=300, max_length=256, micro_batch_size=8, medusa_steps=300, eagle3_steps=300,
                  distill_steps=300, dflash_steps=300, prompts_per_domain=5, max_new_tokens=64, repeats=1,
                  continuation_tokens=128)
QUICK = DemoBudget(docs_per_domain=20, max_length=128, micro_batch_size=4, medusa_steps=8, eagle3_steps=8,
                   distill_steps=8, dflash_steps=8, prompts_per_domain=1, max_new_tokens=16, repeats=1,
                   continuation_tokens=16,
                   profile_token_counts=(1, 2, 3, 4, 8), profile_repeats=1, draft_calls=2)


def run_demo(out: Path, budget: DemoBudget, threads: int | None = None, skip: set[str] | None = None
             ) -> dict[str, Any]:
    """Train, evaluate and export every drafter on the default target; returns the summary."""
    skip = skip or set()
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)

    target_path = default_target_path()
    target = load_target(target_path)
    report = default_training_report()
    print(f"[demo] target: {target} (held-out perplexity per domain: "
          f"{_fmt_ppl(report)}) from {target_path}", flush=True)

    train_file, prompts_file = write_demo_data(out / "data", budget, target)

    steps = {kind: getattr(budget, f"{kind}_steps") for kind in in_registry_order(demo_drafters("embedded"))}
    recipes = {kind: _recipe(kind, target_path, train_file, out / kind, budget, n) for kind, n in steps.items()
               if kind not in skip}
    results, tuning, exports = run_drafters(out, target, target_path, recipes, prompts_file, budget, threads,
                                            export="export" not in skip)

    elapsed = time.perf_counter() - started
    num_prompts = len(train_file.read_text(encoding="utf-8").splitlines())
    target_line = (f"the embedded default target (held-out perplexity: {_fmt_ppl(report)}); the drafters trained "
                   f"on its own greedy continuations (up to {budget.continuation_tokens} tokens) of {num_prompts} "
                   "prompts from its training corpus")
    return write_summary(out, results, exports, elapsed, target_line, tuning,
                          title="specgraft demo, embedded default target: default vs tuned speedup")


def write_demo_data(data_dir: Path, budget: DemoBudget, target: Target | None = None) -> tuple[Path, Path]:
    """(``train.jsonl``, ``prompts.jsonl``) in ``data_dir``: training text and held-out prompts from a disjoint
    stream (``budget.prompts_per_domain`` per domain). The demo and ``benchmarks/bench_acceptance.py`` train and
    evaluate on these.

    With ``target`` (what the demo does) the training text is self-distilled: ``budget.docs_per_domain`` prompts
    per domain, cut from the corpus's training stream the way the held-out prompts are cut, each followed by the
    target's greedy continuation (up to ``budget.continuation_tokens`` tokens), which is what greedy speculative
    decoding has to predict. The drafters trained on it accept far more than those trained on the corpus (a Medusa
    head: tau 3.38 vs 2.48 at its tuned tree, same steps). Without ``target``, the corpus's training documents as
    they are (what the embedded target itself was trained on; ``bench_acceptance.py`` measures on these).
    """
    train_file = data_dir / "train.jsonl"
    if target is None:
        texts = default_corpus_dataset("train", n_docs=budget.docs_per_domain, seed=1)["text"]
        atomic_write_text(train_file, "".join(json.dumps({"text": t}) + "\n" for t in texts))
    else:
        prompts = [p for domain in DOMAINS for p in prompt_cuts(domain, budget.docs_per_domain, 1, split="train")]
        random.Random("demo:self-distilled:1").shuffle(prompts)  # domains mixed across packed sequences
        data_dir.mkdir(parents=True, exist_ok=True)
        continue_texts(target.model, target.tokenizer, [{"text": p} for p in prompts], train_file,
                       max_new_tokens=budget.continuation_tokens, prompt_of=None)
    prompts_file = data_dir / "prompts.jsonl"
    prompts = demo_prompts(budget.prompts_per_domain, seed=0)
    atomic_write_text(prompts_file, "".join(json.dumps(p) + "\n" for p in prompts))
    return train_file, prompts_file


def _recipe(kind: str, target_path: Path, train_file: Path, out_dir: Path, budget: DemoBudget,
            steps: int) -> Recipe | DistillRecipe:
    """``recipes/demo/embedded-<kind>.yaml`` with this run's paths and ``budget``."""
    return demo_recipe(f"embedded-{kind}", {
        "model": {"name_or_path": str(target_path)},
        "data": {"path": str(train_file), "max_length": budget.max_length, "cache_dir": str(out_dir.parent / "cache")},
        "output": {"dir": str(out_dir)},
        "training": {"max_steps": steps, "micro_batch_size": budget.micro_batch_size,
                     "warmup_steps": max(1, steps // 20), "checkpoint_every": max(steps, 1),
                     "log_every": max(1, steps // 10)},
    })


def _fmt_ppl(report: dict[str, Any]) -> str:
    ppl = (report.get("heldout") or {}).get("perplexity") or {}
    if isinstance(ppl, dict):
        return ", ".join(f"{k} {v:.2f}" for k, v in ppl.items() if isinstance(v, (int, float)))
    return str(ppl)
