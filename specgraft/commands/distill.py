"""Distill a standalone draft model on the target's outputs.

``specgraft distill RECIPE [key=value ...] [--resume]`` trains in this process; with ``--num-processes N`` or
``--accelerate-config FILE`` it hands off to ``accelerate launch -m specgraft.distill`` (what multi-GPU and
DeepSpeed users run directly). The draft lands in ``output.dir/draft`` (final) and ``output.dir/best`` (best
held-out alpha_exact): normal transformers folders usable as ``assistant_model=``.
"""

from __future__ import annotations

import argparse

from specgraft.commands.train import add_job_arguments, run_job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser, "recipes/distill/")


def run(args: argparse.Namespace) -> int:
    from specgraft.distill.trainer import BEST_DIR, DistillTrainer

    def done(recipe, trainer, summary) -> str:
        best = summary.get("best_alpha_exact")
        best_text = (f"; best held-out alpha_exact {best:.4f} at step {summary.get('best_step')} in "
                     f"{recipe.output.dir}/{BEST_DIR}" if best is not None else "")
        return (f"draft saved to {recipe.output.dir}/{trainer.final_dir}  ({summary['steps']} steps, "
                f"{summary['tokens_per_s']:.0f} tokens/s{best_text})")

    return run_job(args, DistillTrainer, "specgraft.distill", done)
