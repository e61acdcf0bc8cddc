"""Train: a draft head from a recipe, or a standalone draft model distilled on the target's outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specgraft.config import DistillRecipe, Recipe
from specgraft.distill.trainer import DistillTrainer
from specgraft.target import Target
from specgraft.train.trainer import HeadTrainer


def train_head(recipe: Recipe, target: Target | None = None) -> tuple[Path, dict[str, Any]]:
    """Train ``recipe``'s head (on ``target`` when given, else the recipe's model loaded now) in this process;
    (the saved head folder, the training summary)."""
    trainer = HeadTrainer(recipe, target=target)
    try:
        trainer.setup()
        summary = trainer.train()
    finally:
        trainer.cleanup()
    return Path(recipe.output.dir) / "head", summary


def distill_draft(recipe: DistillRecipe) -> tuple[Path, dict[str, Any]]:
    """Distill ``recipe``'s draft model in this process; (the final draft folder, the training summary)."""
    trainer = DistillTrainer(recipe)
    try:
        trainer.setup()
        summary = trainer.train()
    finally:
        trainer.cleanup()
    return Path(recipe.output.dir) / trainer.final_dir, summary
