"""Every shipped head-training recipe runs one step against a tiny random model of its target's architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgraft.cli import main as cli_main
from specgraft.errors import SpecgraftError
from specgraft.train.dry_run import guess_model_type

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
#: recipe folder -> the command that runs its recipes.
COMMAND = {"medusa": "train", "eagle": "train", "eagle3": "train", "dflash": "train", "distill": "distill"}
JOB_RECIPES = sorted(p for family in COMMAND for p in (RECIPES / family).glob("*.yaml"))


@pytest.mark.parametrize("recipe", JOB_RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_dry_run(recipe, capsys):
    assert cli_main([COMMAND[recipe.parent.name], str(recipe), "--dry-run"]) == 0
    # Shipped recipes name data that is downloaded later: the dry run then says the data part is not ok.
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(("dry run ok:", "dry run passed except for its inputs:")) for line in lines), lines


def test_every_recipe_folder_is_dry_run():
    folders = {p.name for p in RECIPES.iterdir() if p.is_dir()} - {"accelerate"}
    assert folders <= set(COMMAND) | {"demo"}, f"add a command for {folders - set(COMMAND)}"


def test_model_type_guess():
    assert guess_model_type("meta-llama/Llama-3.1-8B-Instruct") == "llama"
    assert guess_model_type("Qwen/Qwen3-8B") == "qwen3"
    assert guess_model_type("Qwen/Qwen2.5-0.5B") == "qwen2"
    assert guess_model_type("google/gemma-2-9b-it") == "gemma2"
    with pytest.raises(SpecgraftError, match="cannot tell the architecture"):
        guess_model_type("org/mystery-model")
