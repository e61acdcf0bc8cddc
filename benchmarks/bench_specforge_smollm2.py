"""EAGLE-3 acceptance per budget: specgraft vs SpecForge on SmolLM2-135M-Instruct, the same rows, steps and tokens,
scored by the same decoder and tree on MT-bench first turns.

Inputs: the target as a transformers folder (``--target-model``; from the packaged GGUF with ``specgraft
convert-gguf``) and the recipe's training data (``--data``: a file or folder of conversations, e.g. the target's own
answers to ShareGPT first turns, ``specgraft regenerate``; see the recipe's header). The held-out prompts are the
first turns of the first ``--per-domain`` MT-bench questions of each category (``--questions``), never trained on.
The rest is :mod:`benchlib.specforge`'s protocol: the rows built once by specgraft's data pipeline at the recipe's
data section and given to both trainers, SpecForge 0.2's offline EAGLE-3 (plus each ``--peer-lever``) and
``specgraft train`` (the recipe's offline features; plus each ``--lever``) at the same steps and batch, SpecForge's
checkpoints imported through the sglang export's reader, every head decoded by specgraft's lossless decoder at the
EAGLE family's default tree and chain.

Prints the tau table with each head's ratio to SpecForge's and to the best SpecForge run, writes ``--out`` (every
number), the benchlib result (``benchmarks/results/<--result-name>.json``) and a PNG beside it::

    python benchmarks/bench_specforge_smollm2.py --peers /scratch/peers --target-model runs/smollm2-135m-instruct \\
        --data data/sharegpt-smollm2.jsonl --out /tmp/sfsmol.json --threads 2 \\
        --lever lr3e3_decay05:training.learning_rate=3e-3,head.loss_decay=0.5 --peer-lever lr3e3:learning_rate=3e-3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.specforge import add_side_by_side_arguments, check_budget, parse_levers, parse_peer_levers, side_by_side
from benchlib.stages import ROOT, scratch_folder
from benchlib.stories import SHARED

RECIPE = "recipes/eagle3/smollm2-135m-instruct.yaml"
MT_BENCH = SHARED / "mt_bench" / "question.jsonl"


def refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_inputs(args: argparse.Namespace) -> None:
    """One ``error:`` line (status 2) for an input that is absent, before anything is built."""
    if not (args.target_model / "config.json").is_file():
        refuse(f"--target-model {args.target_model} is not a transformers model folder (no config.json); make one "
               "with `specgraft convert-gguf GGUF --out DIR` (see the recipe's header)")
    if not args.data.exists():
        refuse(f"--data {args.data} absent; make the target's own answers with `specgraft regenerate` (see the "
               "recipe's header)")
    if not args.questions.is_file():
        refuse(f"--questions {args.questions} absent; pass MT-bench's question.jsonl (../shared/data/mt_bench, or "
               "SPECGRAFT_SHARED_DATA pointing at a copy)")
    if args.per_domain < 1:
        refuse(f"--per-domain must be a positive integer, got {args.per_domain}")


def write_first_turns(questions: Path, per_domain: int, dest: Path) -> dict[str, Any]:
    """The first turn of the first ``per_domain`` questions of each domain, as a FastChat question file; the split
    facts :func:`benchlib.specforge.side_by_side` reads (``prompts_file``, ``num_prompts``)."""
    from specgraft.evaluation.prompts import load_prompts

    prompts = load_prompts(questions, limit_per_domain=per_domain)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps({"question_id": p.id, "category": p.domain, "turns": p.turns[:1]}) + "\n"
                            for p in prompts), encoding="utf-8")
    return {"prompts_file": str(dest), "num_prompts": len(prompts), "questions": str(questions),
            "domains": sorted({p.domain for p in prompts})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_side_by_side_arguments(parser, recipe=RECIPE, steps=100, micro_batch=4, max_new_tokens=64,
                               result_name="specforge-smollm2")
    parser.add_argument("--target-model", type=Path, required=True,
                        help="SmolLM2-135M-Instruct as a transformers folder (specgraft convert-gguf)")
    parser.add_argument("--data", type=Path, required=True, help="the recipe's training data (file or folder)")
    parser.add_argument("--questions", type=Path, default=MT_BENCH, help="MT-bench question.jsonl")
    parser.add_argument("--per-domain", type=int, default=1, help="held-out MT-bench first turns per category")
    args = parser.parse_args()
    check_budget(args)
    check_inputs(args)
    parse_levers(args.lever)
    parse_peer_levers(args.peer_lever)

    from specgraft.config import load_recipe

    started = time.perf_counter()
    work = scratch_folder(args)
    features = load_recipe(ROOT / args.recipe).training.features
    split = {"train_text": str(args.data.resolve()),
             **write_first_turns(args.questions, args.per_domain, work / "mt_bench_first_turns.jsonl")}
    return side_by_side(args, "SmolLM2-135M-Instruct", args.target_model.resolve(), split, work, features, started)


if __name__ == "__main__":
    sys.exit(main())
