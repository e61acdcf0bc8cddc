"""The bad-input catalogue: every CLI command against bad recipes, datasets, checkpoints, exports, prompt files
and flags. Each case must exit non-zero with ONE ``error:`` line naming the problem, print no traceback, and leave
every existing output file unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specgraft.cli import main as cli_main
from specgraft.config import HeadConfig
from specgraft.heads.medusa import MedusaHead
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Inputs shared by the cases: a tiny target, another target, data files, a head, an output to protect."""
    root = tmp_path_factory.mktemp("bad-inputs")
    target_dir = root / "target"
    tiny_model("llama").save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    other_dir = root / "other-target"
    tiny_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1).save_pretrained(other_dir)
    tiny_tokenizer().save_pretrained(other_dir)
    small_vocab = root / "small-vocab-draft"
    tiny_model("llama", vocab_size=300).save_pretrained(small_vocab)
    tiny_tokenizer().save_pretrained(small_vocab)

    other_tok = tiny_tokenizer()
    other_tok.add_tokens(["<extra_token>"])
    tiny_model("llama").save_pretrained(root / "other-tokenizer")
    other_tok.save_pretrained(root / "other-tokenizer")

    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(root / "bert")

    (root / "text.txt").write_text("the cat sat on the mat. " * 40 + "\n\n" + "a dog ran. " * 40)
    (root / "no_fields.jsonl").write_text(json.dumps({"question": "hi", "label": 3}) + "\n")
    (root / "no_assistant.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    (root / "prompts_empty.jsonl").write_text("")
    (root / "prompts.jsonl").write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["hi"]}) + "\n")
    (root / "prompts_generic.jsonl").write_text(json.dumps({"text": "hi", "kind": "x"}) + "\n")

    target = Target(tiny_model("llama"), tiny_tokenizer(), name_or_path=str(target_dir))
    head = MedusaHead.build(target, MedusaHead.config_from_recipe(HeadConfig(num_heads=2), target))
    head.save_pretrained(root / "head")
    broken = root / "broken-head"
    head.save_pretrained(broken)
    (broken / "head.safetensors").write_bytes((broken / "head.safetensors").read_bytes()[:100])

    llama2c = root / "model.bin"
    llama2c.write_bytes(b"\x40\x00\x00\x00" * 7 + b"\x00" * 64)  # header says dim 64, file far too short

    protected = root / "protected"
    protected.mkdir()
    (protected / "keep.txt").write_text("user data")
    return root


def recipe(world: Path, name: str, **sections) -> Path:
    base = {"model": {"name_or_path": str(world / "target")},
            "data": {"path": str(world / "text.txt"), "format": "text", "max_length": 32,
                     "cache_dir": str(world / "cache")},
            "training": {"max_steps": 1, "micro_batch_size": 2},
            "output": {"dir": str(world / f"fresh-{name}")}, "tracking": {"backend": "none"}}
    for section, values in sections.items():
        if isinstance(values, dict):
            base.setdefault(section, {}).update(values)
        else:
            base[section] = values
    path = world / f"{name}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "cache" not in p.parts}


#: (case id, argv builder, words the error line must contain)
CASES = [
    ("malformed yaml", lambda w: ["train", _write(w / "bad.yaml", "model: [x\n")], "not valid YAML"),
    ("unknown recipe key", lambda w: ["train", str(recipe(w, "k", training={"max_step": 3}))],
     "did you mean training.max_steps"),
    ("wrong type in recipe", lambda w: ["train", str(recipe(w, "t", training={"max_steps": "ten"}))],
     "training.max_steps must be an integer"),
    ("override of an unknown key", lambda w: ["train", str(recipe(w, "o")), "trainig.max_steps=3"],
     "unknown recipe key trainig"),
    ("missing recipe file", lambda w: ["train", str(w / "nope.yaml")], "does not exist"),
    ("model path does not exist", lambda w: ["train", str(recipe(w, "m", model={"name_or_path": str(w / "x")}))],
     "does not exist"),
    ("model is not a causal LM", lambda w: ["train", str(recipe(w, "b", model={"name_or_path": str(w / "bert")}))],
     "not a decoder-only causal LM"),
    ("dataset without conversations/messages/text",
     lambda w: ["train", str(recipe(w, "d", data={"path": str(w / "no_fields.jsonl"), "format": "auto"}))],
     "conversations"),
    ("conversation without assistant turn",
     lambda w: ["train", str(recipe(w, "a", data={"path": str(w / "no_assistant.jsonl"), "format": "auto"}))],
     "assistant"),
    ("output folder not empty", lambda w: ["train", str(recipe(w, "n", output={"dir": str(w / "protected")}))],
     "is not empty"),
    ("zero heads", lambda w: ["train", str(recipe(w, "z", head={"num_heads": 0}))], "must be positive"),
    ("eagle3 layer out of range",
     lambda w: ["train", str(recipe(w, "l", head={"type": "eagle3", "feature_layers": [1, 2, 99]},
                                    output={"dir": str(w / "fresh-l")}))], "out of range"),
    ("draft vocab larger than the target's",
     lambda w: ["train", str(recipe(w, "v", head={"type": "eagle3", "draft_vocab_size": 100000},
                                    output={"dir": str(w / "fresh-v")}))], "draft"),
    ("lora module that does not exist",
     lambda w: ["train", str(recipe(w, "r", lora={"enabled": True, "target_modules": ["c_attn"]},
                                    output={"dir": str(w / "fresh-r")}))], "do not exist"),
    ("unknown CLI flag", lambda w: ["train", str(recipe(w, "f")), "--frobnicate"], "unrecognized arguments"),
    ("distill loss that does not exist", lambda w: ["distill", str(recipe(w, "dl", distill={"loss": "kl2"}))],
     "distill.loss must be one of"),
    ("distill lmbda outside [0, 1]", lambda w: ["distill", str(recipe(w, "dm", distill={"lmbda": 2.0}))],
     "distill.lmbda"),
    ("distill student with another tokenizer",
     lambda w: ["distill", str(recipe(w, "ds", distill={"student": str(w / "other-tokenizer")}))], "tokenizer"),
    ("truncated llama2.c checkpoint",
     lambda w: ["convert-llama2c", str(w / "model.bin"), str(w / "model.bin"), "--out", str(w / "fresh-c")],
     "llama2.c"),
    ("regenerate with a missing model",
     lambda w: ["regenerate", "--model", str(w / "x"), "--data", str(w / "no_assistant.jsonl"), "--out",
                str(w / "protected" / "keep.txt")], "does not exist"),
    ("eval with an empty prompt file",
     lambda w: ["eval", "--target", str(w / "target"), "--drafter", "self", "--prompts",
                str(w / "prompts_empty.jsonl"), "--out", str(w / "protected")], "empty"),
    ("eval with temperature < 0",
     lambda w: ["eval", "--target", str(w / "target"), "--drafter", "self", "--prompts", str(w / "prompts.jsonl"),
                "--out", str(w / "fresh-e1"), "--temperature", "-1"], "temperature"),
    ("eval with top_p outside (0, 1]",
     lambda w: ["eval", "--target", str(w / "target"), "--drafter", "self", "--prompts", str(w / "prompts.jsonl"),
                "--out", str(w / "fresh-e2"), "--top-p", "1.5"], "top_p"),
    ("eval with an unknown domain field",
     lambda w: ["eval", "--target", str(w / "target"), "--drafter", "self", "--prompts",
                str(w / "prompts_generic.jsonl"), "--prompt-field", "text", "--domain-field", "nope",
                "--out", str(w / "fresh-e3")], "nope"),
    ("eval with a draft of another vocabulary",
     lambda w: ["eval", "--target", str(w / "target"), "--draft", str(w / "small-vocab-draft"), "--prompts",
                str(w / "prompts.jsonl"), "--out", str(w / "fresh-e4")], "vocab"),
    ("eval with a head made for another target",
     lambda w: ["eval", "--target", str(w / "other-target"), "--head", str(w / "head"), "--prompts",
                str(w / "prompts.jsonl"), "--out", str(w / "fresh-e5")], "made for target"),
    ("export medusa to sglang",
     lambda w: ["export", str(w / "head"), "--format", "sglang", "--out", str(w / "fresh-x1")], "sglang"),
    ("export into a non-empty folder",
     lambda w: ["export", str(w / "head"), "--format", "native", "--out", str(w / "protected")], "not empty"),
    ("export a head with missing tensors",
     lambda w: ["export", str(w / "broken-head"), "--format", "native", "--out", str(w / "fresh-x2")],
     "safetensors"),
    ("push without a token",
     lambda w: ["push", str(w / "head"), "--repo-id", "org/name", "--token-env", "SPECGRAFT_NO_SUCH_TOKEN"],
     "token"),
    ("simulate with alpha > 1", lambda w: ["simulate", "--alpha", "1.5", "--draft-length", "4", "--cost-ratio",
                                           "0.1"], "alpha"),
]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_catalogue_is_large_enough():
    assert len(CASES) >= 20
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(world, case, capsys, monkeypatch):
    _, build_argv, words = case
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(world / "hf-home"))  # no cached login either
    argv = build_argv(world)
    before = snapshot(world / "protected")
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code not in (0, None), f"{argv} exited {code}"
    assert len(lines) == 1, err
    assert words.lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in err
    assert snapshot(world / "protected") == before, "an existing output file changed"


def test_real_process_exit_code_and_no_traceback(world):
    """The same contract through a real process (what a shell user sees)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "specgraft", "train", str(recipe(world, "proc", model={
        "name_or_path": str(world / "missing")}))], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
