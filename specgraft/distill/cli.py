"""Distill a standalone draft model on the target's outputs.

``specgraft distill RECIPE [key=value ...] [--resume]`` trains in this process; with ``--num-processes N`` or
``--accelerate-config FILE`` it hands off to ``accelerate launch -m specgraft.distill`` (what multi-GPU and
DeepSpeed users run directly). The draft lands in ``output.dir/draft`` (final) and ``output.dir/best`` (best
held-out alpha_exact): normal transformers folders usable as ``assistant_model=``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (see recipes/distill/).")
    parser.add_argument("overrides", nargs="*", help="Recipe overrides key.sub=value, e.g. distill.loss=tvd.")
    parser.add_argument("--resume", action="store_true",
                        help="Continue the run in output.dir from its newest good checkpoint.")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="Launch this many processes through `accelerate launch`.")
    parser.add_argument("--accelerate-config", default=None,
                        help="An accelerate config file (DDP, DeepSpeed; see recipes/accelerate/).")
    parser.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")


def run(args: argparse.Namespace) -> int:
    if args.num_processes or args.accelerate_config:
        return _launch(args)
    from specgraft.config import load_recipe
    from specgraft.distill.trainer import BEST_DIR, DistillTrainer

    recipe = load_recipe(args.recipe, args.overrides)
    trainer = DistillTrainer(recipe, resume=args.resume, show_progress=not args.no_progress)
    try:
        trainer.setup()
        summary = trainer.train()
    finally:
        trainer.cleanup()
    if trainer.accelerator.is_main_process:
        best = summary.get("best_alpha_exact")
        best_text = (f"; best held-out alpha_exact {best:.4f} at step {summary.get('best_step')} in "
                     f"{recipe.output.dir}/{BEST_DIR}" if best is not None else "")
        print(f"draft saved to {recipe.output.dir}/{trainer.final_dir}  ({summary['steps']} steps, "
              f"{summary['tokens_per_s']:.0f} tokens/s{best_text})")
    return 0


def _launch(args: argparse.Namespace) -> int:
    """Re-run this job under ``accelerate launch`` (one process per device)."""
    from specgraft.config import load_recipe

    load_recipe(args.recipe, args.overrides)  # fail fast, before starting processes
    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [accelerate, "launch"]
    if args.accelerate_config:
        cmd += ["--config_file", args.accelerate_config]
    if args.num_processes:
        cmd += ["--num_processes", str(args.num_processes)]
    cmd += ["-m", "specgraft.distill", args.recipe, *args.overrides]
    if args.resume:
        cmd.append("--resume")
    if args.no_progress:
        cmd.append("--no-progress")
    print("launching:", " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)
