"""Typed recipes: strict validation with dotted paths, suggestions, overrides, and every shipped recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specgraft.config import Recipe, apply_overrides, load_recipe, save_recipe, to_dict
from specgraft.errors import ConfigError

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))
# recipes/accelerate/ holds accelerate launcher configs, not specgraft recipes.
SPECGRAFT_RECIPES = [p for p in RECIPES if "accelerate" not in p.parts]

MINIMAL = {"model": {"name_or_path": "org/model"}, "data": {"path": "data.jsonl"}, "output": {"dir": "out"}}


def write(tmp_path, obj, name="r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else yaml.safe_dump(obj))
    return path


def test_minimal_recipe_gets_defaults(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    assert isinstance(recipe, Recipe)
    assert recipe.head.type == "medusa" and recipe.head.num_heads == 3
    assert recipe.training.adam_betas == [0.9, 0.999]
    assert recipe.tracking.backend == "tensorboard"


def test_unknown_key_suggests_the_nearest(tmp_path):
    bad = {**MINIMAL, "training": {"learning_rat": 1e-3}}
    with pytest.raises(ConfigError,
                       match=r"unknown recipe key training\.learning_rat; did you mean training\.learning_rate"):
        load_recipe(write(tmp_path, bad))
    with pytest.raises(ConfigError, match=r"unknown recipe key trainig; did you mean training\?"):
        load_recipe(write(tmp_path, {**MINIMAL, "trainig": {}}))


def test_wrong_type_and_missing_field_name_the_dotted_path(tmp_path):
    with pytest.raises(ConfigError, match=r"training\.max_steps must be an integer, got a string 'many'"):
        load_recipe(write(tmp_path, {**MINIMAL, "training": {"max_steps": "many"}}))
    with pytest.raises(ConfigError, match=r"head\.feature_layers\[1\] must be an integer"):
        load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "eagle3", "feature_layers": [1, "x"]}}))
    with pytest.raises(ConfigError, match=r"missing required recipe field model\.name_or_path"):
        load_recipe(write(tmp_path, {**MINIMAL, "model": {"dtype": "float32"}}))
    with pytest.raises(ConfigError, match=r"missing required recipe field output"):
        load_recipe(write(tmp_path, {"model": MINIMAL["model"], "data": MINIMAL["data"]}))
    with pytest.raises(ConfigError, match=r"head\.type must be one of medusa, eagle, eagle3(, \w+)*, got 'eagle4'"):
        load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "eagle4"}}))
    with pytest.raises(ConfigError, match=r"head\.num_heads must be positive, got 0"):
        load_recipe(write(tmp_path, {**MINIMAL, "head": {"num_heads": 0}}))
    with pytest.raises(ConfigError, match=r"distill\.lmbda must be in \[0\.0, 1\.0\], got 1\.5"):
        load_recipe(write(tmp_path, {**MINIMAL, "distill": {"lmbda": 1.5}}))


def test_malformed_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_recipe(write(tmp_path, "model:\n  name_or_path: [unclosed\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_recipe(write(tmp_path, "- a\n- b\n"))


def test_overrides_apply_before_validation(tmp_path):
    path = write(tmp_path, MINIMAL)
    recipe = load_recipe(path, ["training.max_steps=7", "head.type=eagle3", "head.feature_layers=[1,2,3]",
                                "training.learning_rate=3e-5", "tracking.run_name=abc"])
    assert recipe.training.max_steps == 7 and recipe.head.type == "eagle3"
    assert recipe.head.feature_layers == [1, 2, 3] and recipe.training.learning_rate == 3e-5
    with pytest.raises(ConfigError, match=r"unknown recipe key training\.max_step; did you mean training\.max_steps"):
        load_recipe(path, ["training.max_step=7"])
    with pytest.raises(ConfigError, match="not of the form key.sub=value"):
        apply_overrides({}, ["training.max_steps"])


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["head.num_heads=5"])
    save_recipe(recipe, tmp_path / "resolved.yaml")
    again = load_recipe(tmp_path / "resolved.yaml")
    assert to_dict(again) == to_dict(recipe)


def test_shipped_recipes_exist():
    assert SPECGRAFT_RECIPES, "recipes/ must ship recipes"


@pytest.mark.parametrize("path", SPECGRAFT_RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.model.name_or_path and recipe.output.dir


def test_head_section_is_the_family_config_chosen_by_type(tmp_path):
    """One schema per thing: a field of another family is refused (the flat mirror accepted it silently), the
    type must name a registered family, and the saved recipe keeps the type."""
    from specgraft.heads.eagle3.config import Eagle3Config

    with pytest.raises(ConfigError, match=r"unknown recipe key head\.num_heads"):
        load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "eagle3", "num_heads": 3}}))
    with pytest.raises(ConfigError, match=r"head\.type must be one of medusa, eagle, eagle3.*did you mean 'eagle3'"):
        load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "eagel3"}}))
    recipe = load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "eagle3", "ttt_steps": 3}}))
    assert isinstance(recipe.head, Eagle3Config) and recipe.head.type == "eagle3" and recipe.head.ttt_steps == 3
    save_recipe(recipe, tmp_path / "saved.yaml")
    again = load_recipe(tmp_path / "saved.yaml")
    assert to_dict(again) == to_dict(recipe) and to_dict(again)["head"]["type"] == "eagle3"


def test_head_training_and_distillation_recipes_are_separate_schemas(tmp_path):
    from specgraft.config import DistillRecipe

    distill = load_recipe(write(tmp_path, {**MINIMAL, "distill": {"loss": "rkl"}}))
    assert isinstance(distill, DistillRecipe) and distill.distill.loss == "rkl" and not hasattr(distill, "head")
    head = load_recipe(write(tmp_path, MINIMAL))
    assert isinstance(head, Recipe) and not hasattr(head, "distill")
    with pytest.raises(ConfigError, match=r"a recipe is either head training .* or distillation"):
        load_recipe(write(tmp_path, {**MINIMAL, "distill": {}, "head": {"type": "medusa"}}))
    with pytest.raises(ConfigError, match=r"is a distillation recipe; run it with `specgraft distill`"):
        load_recipe(write(tmp_path, {**MINIMAL, "distill": {}}), schema=Recipe)
    with pytest.raises(ConfigError, match=r"is a head-training recipe; run it with `specgraft train`"):
        load_recipe(write(tmp_path, MINIMAL), schema=DistillRecipe)


def test_medusa2_lora_lives_in_the_medusa_section_and_old_recipes_still_load(tmp_path, caplog):
    """Medusa-2's adapter settings are the Medusa family's (head.lora); a recipe-level lora: section (older recipes)
    is moved there with a deprecation warning, and loads to the same recipe and the same resume fingerprint."""
    from specgraft.train.trainer import recipe_fingerprint

    lora = {"enabled": True, "r": 8, "kl_weight": 0.5}
    new = load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "medusa", "lora": lora}}, "new.yaml"))
    with caplog.at_level("WARNING", logger="specgraft.config"):
        old = load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "medusa"}, "lora": lora}, "old.yaml"))
    assert "recipe-level lora: section is deprecated" in caplog.text
    assert new.head.lora.enabled and new.head.lora.r == 8 and to_dict(old) == to_dict(new)
    assert recipe_fingerprint(old) == recipe_fingerprint(new)
    assert "lora" not in to_dict(new) and to_dict(new)["head"]["lora"]["kl_weight"] == 0.5
    # The override path follows the section: the old dotted key still works, and lands in head.lora.
    assert load_recipe(write(tmp_path, MINIMAL, "o.yaml"), ["lora.r=4"]).head.lora.r == 4
    both = {**MINIMAL, "head": {"type": "medusa", "lora": dict(lora)}, "lora": lora}
    with pytest.raises(ConfigError, match="has both lora: and head.lora:"):
        load_recipe(write(tmp_path, both, "b.yaml"))
    with pytest.raises(ConfigError, match="the lora: section belongs to medusa heads"):
        load_recipe(write(tmp_path, {**MINIMAL, "head": {"type": "eagle"}, "lora": lora}, "e.yaml"))
    with pytest.raises(ConfigError, match="head.lora.kl_weight must be a finite number"):
        load_recipe(write(tmp_path, MINIMAL, "n.yaml"), ["lora.kl_weight=nan"])
