"""One Medusa ablation on stories260K: train a recipe (CPU time measured) and decode the held-out TinyStories prompts.

Uses what ``benchmarks/bench_heads_stories260k.py`` uses (``benchlib``): its scratch folder, stories260K conversion
and TinyStories split (held-out prompts = the first sentences of lines at the END of ``tinystories_train.txt``; the
training text stops before them), its ``specgraft train`` child process (same overrides: model, data, cache, steps,
micro-batch, one checkpoint at the end, output) and its ``run_eval`` of the head (greedy, the head's default static
tree; ``--modes tree,chain`` adds the chain). Adds what an ablation needs:

* ``cpu_s``: user + system CPU seconds of the training process (``getrusage(RUSAGE_CHILDREN)``; on a shared machine
  wall time says little), regeneration included when the recipe sets ``data.regenerate``;
* ``heldout_text_top1``: each head's top-1 accuracy on the held-out tail's human text (BOS + paragraph), the same
  yardstick for every run (``top1`` in the train summary is measured on the recipe's own eval split, which is the
  target's text when the data is regenerated);
* one result file per run, ``benchmarks/results/medusa-stories260k-<name>.json``.

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
from typing import Any

from benchlib.results import add_result_arguments, write_result
from benchlib.stages import train_one
from benchlib.stories import TINYSTORIES, evaluate_heads, prepare_stories260k

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/medusa/stories260k.yaml"


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
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default: the recipe's)")
    parser.add_argument("--per-domain", type=int, default=6, help="held-out prompts per domain (3 domains)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="tau does not depend on repeats; speed does")
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--modes", default="tree", help="comma-separated drafting modes: tree, chain")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of training and decoding")
    add_result_arguments(parser, "", default_help="medusa-stories260k-NAME")
    args = parser.parse_args()

    work = args.work
    model_dir, split = prepare_stories260k(work, args.per_domain)
    from specgraft.config import load_recipe

    recipe = write_recipe(args.recipe, args.override, work / "recipes" / f"{args.name}.yaml")
    resolved = load_recipe(recipe)
    args.steps = args.steps or resolved.training.max_steps
    args.micro_batch = args.micro_batch or resolved.training.micro_batch_size
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = train_one(args.name, str(recipe), "online", model_dir, split, work, args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run["head"] = resolved.head.type  # the drafter evaluate() builds (an EAGLE recipe can be run side by side)
    rows = evaluate_heads(model_dir, [run], split, work / "eval" / args.name, args,
                          tuple(args.modes.split(",")))
    summary = run["summary"]
    result: dict[str, Any] = {
        "name": args.name, "recipe": str(args.recipe), "overrides": args.override,
        "steps": args.steps, "micro_batch": args.micro_batch,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "wall_s": run["wall_s"],
        "top1": summary.get("medusa_top1_accuracy"), "top1_measured_on": summary.get("accuracy_measured_on"),
        "heldout_text_top1": None if run["head"] != "medusa" else heldout_text_top1(
            model_dir, run["head_dir"], TINYSTORIES, split["train_lines"],
            resolved.data.max_length),
        "decoding": {r["mode"]: {"tau": r["overall"]["tau"], "acceptance_by_depth":
                                 r["overall"].get("acceptance_by_depth"), "tree_size": r["drafter"].get("tree_size"),
                                 "lossless_passed": r["overall"]["lossless_passed"],
                                 "lossless": r["overall"]["lossless_check"]} for r in rows},
    }
    print(json.dumps(result))
    top1 = result["heldout_text_top1"]
    figures = [{"run": args.name, "overrides": " ".join(args.override), "steps": args.steps,
                "micro_batch": args.micro_batch, "train_cpu_s": round(result["cpu_s"], 1),
                "heldout_text_top1": " / ".join(f"{a:.3f}" for a in top1) if top1 else None,
                "mode": mode, "tree_size": d["tree_size"], "tau": d["tau"], "lossless": d["lossless"]}
               for mode, d in result["decoding"].items()]
    write_result(args.result_name or f"medusa-stories260k-{args.name}", figures,
                 title=f"Medusa ablation on stories260K: run {args.name}", dtype="float32", threads=args.threads,
                 results_dir=args.results_dir, details=result)
    return 0 if all(r["overall"]["lossless_passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
