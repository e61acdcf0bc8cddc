"""The demos read their drafters' recipes from recipes/demo/ (shipped inside the package), not from code."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgraft.config import load_recipe, to_dict
from specgraft.demos.steps import RECIPES_DIR, demo_recipe
from specgraft.errors import SpecgraftError

ROOT = Path(__file__).resolve().parents[1]


def test_recipes_demo_is_the_packaged_folder_and_every_recipe_validates():
    assert (ROOT / "recipes" / "demo").resolve() == RECIPES_DIR.resolve()
    assert RECIPES_DIR.is_relative_to(ROOT / "specgraft")  # package data: a wheel carries it
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert names == ["embedded-dflash", "embedded-distill", "embedded-eagle3", "embedded-medusa",
                     "smollm2-distill", "smollm2-eagle3", "smollm2-medusa"]
    for name in names:
        recipe = load_recipe(RECIPES_DIR / f"{name}.yaml")
        assert recipe.model.name_or_path and recipe.output.dir


def test_a_demo_recipe_is_the_file_with_the_run_merged_over_it(tmp_path):
    file = to_dict(load_recipe(RECIPES_DIR / "embedded-medusa.yaml"))
    run = {"output": {"dir": str(tmp_path / "medusa")}, "training": {"max_steps": 7}}
    recipe = to_dict(demo_recipe("embedded-medusa", run))
    assert recipe["output"]["dir"] == str(tmp_path / "medusa") and recipe["training"]["max_steps"] == 7
    assert recipe["head"] == file["head"]  # the settings come from the file
    assert recipe["training"]["learning_rate"] == file["training"]["learning_rate"]
    # A run key the schema does not know is refused, not silently dropped.
    with pytest.raises(SpecgraftError, match="max_stepz"):
        demo_recipe("embedded-medusa", {"training": {"max_stepz": 7}})
