"""One Medusa ablation on stories260K: train a recipe (CPU time measured) and decode the held-out TinyStories prompts.

Reuses ``benchmarks/bench_heads_stories260k.py``: its scratch folder, stories260K conversion and TinyStories split
(held-out prompts = the first sentences of lines at the END of ``tinystories_train.txt``; the training text stops
before them), its ``specgraft train`` child process (same overrides: model, data, cache, steps, micro-batch, one
checkpoint at the end, output) and its ``run_eval`` of the head (greedy, the head's default static tree; ``--modes
tree,chain`` adds the chain). Adds what an ablation needs:

* ``cpu_s``: user + system CPU seconds of the training process (``getrusage(RUSAGE_CHILDREN)``; on a shared machine
  wall time says little), regeneration included when the recipe sets ``data.regenerate``;
* ``heldout_text_top1``: each head's top-1 accuracy on the held-out tail's human text (BOS + paragraph), the same
  yardstick for every run (``top1`` in the train summary is measured on the recipe's own eval split, which is the
  target's text when the data is regenerated);
* one JSON line per run appended to ``--results``.

    python benchmarks/bench_medusa_stories260k.py --work runs/medusa-ablation --name base
    python benchmarks/bench_medusa_stories260k.py --work runs/medusa-ablation --name lr1e-2 \\
        --override training.learning_rate=1e-2
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from specgraft.utils.scripts import load_sibling

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/medusa/stories260k.yaml"


def _bench_heads() -> ModuleType:
    """The sibling benchmark (not a package) whose setup, training and evaluation this one reuses."""
    return load_sibling(__file__, "bench_heads_stories260k")


def heldout_text_top1(model_dir: Path, head_dir: str, source_text: Path, train_lines: int,
                      max_tokens: int) -> list[float]:
    """Per-head top-1 accuracy on the held-out tail of ``source_text`` (its lines from ``train_lines`` on), each
    non-blank line as BOS + its first ``max_tokens - 1`` tokens."""
    import torch

    from specgraft.heads import load_head
    from specgraft.heads.medusa.drafter import measure_topk_accuracy
    from specgraft.target import load_target

    target = load_target(model_dir)
    head = load_head(target, head_dir)
    tokenizer = target.tokenizer
    lines = source_text.read_text(encoding="utf-8").splitlines()[train_lines:]
    batches = [torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(" ".join(line.split()),
                                                                        add_special_tokens=False)[: max_tokens - 1]]])
               for line in lines if line.strip()]  # [1, T] each
    accuracy = measure_topk_accuracy(head, target, batches, topk=1)  # [K, 1]
    return [round(a, 4) for a in accuracy[:, 0].tolist()]


def write_recipe(recipe: Path, overrides: list[str], out: Path) -> Path:
    """``recipe`` with ``key=value`` overrides applied (the trainer's own override rules), written to ``out``."""
    from specgraft.config import load_recipe, save_recipe

    out.parent.mkdir(parents=True, exist_ok=True)
    save_recipe(load_recipe(recipe, overrides), out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (shared by runs: model, split)")
    parser.add_argument("--name", required=True, help="run name (its folder under <work>/runs)")
    parser.add_argument("--recipe", type=Path, default=ROOT / RECIPE)
    parser.add_argument("--override", nargs="*", default=[], help="recipe key=value overrides of this run")
    parser.add_argument("--results", type=Path, help="JSON lines file to append to (default <work>/results.jsonl)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default: the recipe's)")
    parser.add_argument("--per-domain", type=int, default=6, help="held-out prompts per domain (3 domains)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="tau does not depend on repeats; speed does")
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--modes", default="tree", help="comma-separated drafting modes: tree, chain")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of training and decoding")
    args = parser.parse_args()

    heads = _bench_heads()
    heads.MODES = tuple(args.modes.split(","))
    args.out = args.work / "setup.json"  # prepare_stories260k places its scratch folder at --work
    prepared = heads.prepare_stories260k(args)
    if prepared is None:
        return 2
    work, model_dir, split = prepared
    from specgraft.config import load_recipe

    recipe = write_recipe(args.recipe, args.override, work / "recipes" / f"{args.name}.yaml")
    resolved = load_recipe(recipe)
    args.steps = args.steps or resolved.training.max_steps
    args.micro_batch = args.micro_batch or resolved.training.micro_batch_size
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = heads.train_one(args.name, str(recipe), "online", model_dir, split, work, args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run["head"] = resolved.head.type  # the drafter evaluate() builds (an EAGLE recipe can be run side by side)
    rows = heads.evaluate(model_dir, [run], split, work / "eval" / args.name, args)
    summary = run["summary"]
    result: dict[str, Any] = {
        "name": args.name, "recipe": str(args.recipe), "overrides": args.override,
        "steps": args.steps, "micro_batch": args.micro_batch,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "wall_s": run["wall_s"],
        "top1": summary.get("medusa_top1_accuracy"), "top1_measured_on": summary.get("accuracy_measured_on"),
        "heldout_text_top1": None if run["head"] != "medusa" else heldout_text_top1(
            model_dir, run["head_dir"], heads.SHARED / "tinystories" / "tinystories_train.txt", split["train_lines"],
            resolved.data.max_length),
        "decoding": {r["mode"]: {"tau": r["overall"]["tau"], "acceptance_by_depth":
                                 r["overall"].get("acceptance_by_depth"), "tree_size": r["drafter"].get("tree_size"),
                                 "lossless_passed": r["overall"]["lossless_passed"],
                                 "lossless": r["overall"]["lossless_check"]} for r in rows},
    }
    print(json.dumps(result))
    results = args.results or work / "results.jsonl"
    with results.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(result) + "\n")
    return 0 if all(r["overall"]["lossless_passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
