"""`specgraft eval` end to end on tiny targets saved to disk, and its one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from specgraft.cli import main
from specgraft.evaluation.report import METRIC_KEYS, PLOTS
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Make it rhyme."]},
    {"question_id": 82, "category": "math", "turns": ["What is 2+2?"]},
    {"question_id": 83, "category": "math", "turns": ["Name a prime."]},
]


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A tiny target, drafts and heads saved to disk, and a FastChat prompt file."""
    root = tmp_path_factory.mktemp("cli")
    tok = tiny_tokenizer()
    target = tiny_model("llama")
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    draft = tiny_model("llama", seed=1, num_hidden_layers=1)
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    tiny_model("llama", vocab_size=400).save_pretrained(root / "draft_vocab")
    tok.save_pretrained(root / "draft_vocab")
    other_tok = tiny_tokenizer()
    other_tok.add_tokens(["<extra>"])  # same model vocab size (320), different tokenizer
    draft.save_pretrained(root / "draft_tok")
    other_tok.save_pretrained(root / "draft_tok")

    from specgraft.heads.eagle.model import EagleConfig, EagleHead
    from specgraft.heads.medusa.model import MedusaConfig, MedusaHead

    wrapped = Target(target, tok, name_or_path=str(root / "target"))
    MedusaHead.build(wrapped, MedusaConfig(num_heads=2, hidden_size=64, vocab_size=320)).save_pretrained(
        root / "medusa")
    EagleHead.build(wrapped, EagleConfig()).save_pretrained(root / "eagle")
    shallow = Target(tiny_model("llama", num_hidden_layers=2), tok, name_or_path="shallow")
    MedusaHead.build(shallow, MedusaConfig(num_heads=2, hidden_size=64, vocab_size=320)).save_pretrained(
        root / "medusa_other")
    prompts = root / "question.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    return root


def run_cli(args, capsys):
    code = main(["eval", *[str(a) for a in args], "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def base_args(disk, out, *extra):
    return ["--target", disk / "target", "--prompts", disk / "question.jsonl", "--out", out, "--max-new-tokens", "8",
            *extra]


def test_eval_self_drafter_writes_every_output(disk, tmp_path, capsys):
    out = tmp_path / "report"
    code, stdout, _ = run_cli(base_args(disk, out, "--drafter", "self", "--k", "3"), capsys)
    assert code == 0
    assert "| **overall** | 3 | 4.00 |" in stdout and "lossless check: passed (3/3" in stdout
    for name in ("report.json", "report.md", "answers.jsonl", *PLOTS.values()):
        assert (out / name).is_file(), name
    for name in PLOTS.values():
        assert (out / name).read_bytes()[:8] == PNG_MAGIC

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert {"target", "drafter", "settings", "overall", "domains", "plots", "answers"} <= set(report)
    # linear_kernel auto: the tiny target has no layer worth switching; attention_kernel auto: its 4 query heads
    # share 2 KV heads on the CPU, so verification broadcasts them (gqa)
    assert report["drafter"] == {"type": "self", "path": None, "mode": "chain", "k": 3,
                                "attention_kernel": "gqa", "linear_kernel": "stock"}
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "lossy", "repeats", "seed"} <= set(report["settings"])
    assert report["plots"] == PLOTS and report["answers"] == "answers.jsonl"
    assert set(report["domains"]) == {"writing", "math"}
    for values in [report["overall"], *report["domains"].values()]:
        assert set(METRIC_KEYS) <= set(values)
        assert values["tau"] == 4.0 and values["lossless_passed"] is True
    assert report["domains"]["math"]["num_prompts"] == 2 and report["domains"]["writing"]["num_turns"] == 2

    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(a["prompt_id"], a["domain"], a["turn"]) for a in answers] == [
        ("81", "writing", 0), ("81", "writing", 1), ("82", "math", 0), ("83", "math", 0)]
    assert all(a["baseline_equal"] and a["tau"] == 4.0 for a in answers)
    assert answers[0]["answer"] in answers[1]["prompt"]  # the conversation continues with the generated answer
    assert "Make it rhyme." in answers[1]["prompt"]


def test_eval_draft_model_tree_and_limit(disk, tmp_path, capsys):
    out = tmp_path / "r"
    code, _, _ = run_cli(base_args(disk, out, "--draft", disk / "draft", "--k", "3", "--mode", "tree",
                                   "--branching", "2,2", "--limit-per-domain", "1"), capsys)
    assert code == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["drafter"] == {"type": "draft_model", "path": str(disk / "draft"), "mode": "tree", "k": 3,
                                 "branching": [2, 2], "setting_source": "flags",
                                 "attention_kernel": "gqa", "linear_kernel": "stock"}
    assert report["overall"]["num_prompts"] == 2 and report["overall"]["lossless_passed"] is True
    assert 1.0 <= report["overall"]["tau"] <= 4.0


@pytest.mark.parametrize("head, head_type", [("medusa", "medusa"), ("eagle", "eagle")])
def test_eval_head_drafters(disk, tmp_path, capsys, head, head_type):
    out = tmp_path / head
    code, _, err = run_cli(base_args(disk, out, "--head", disk / head, "--tree-size", "8", "--limit-per-domain", "1"),
                           capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["drafter"]["type"] == head_type and report["drafter"]["mode"] == "tree"
    assert report["drafter"]["path"] == str(disk / head) and report["drafter"]["tree_size"] == 8
    assert report["overall"]["lossless_passed"] is True and report["overall"]["tau"] >= 1.0


def test_eval_sampling_records_not_checkable(disk, tmp_path, capsys):
    out = tmp_path / "s"
    code, stdout, _ = run_cli(base_args(disk, out, "--drafter", "self", "--temperature", "0.8", "--top-p", "0.9",
                                        "--top-k", "50", "--seed", "7"), capsys)
    assert code == 0 and "lossless check: not checkable per prompt" in stdout
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["settings"]["temperature"] == 0.8 and report["settings"]["top_k"] == 50
    assert report["settings"]["seed"] == 7 and report["overall"]["lossless_passed"] is None


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("case", ["vocab", "tokenizer", "head_target", "context", "empty", "domain_field",
                                  "temperature", "top_p_zero", "top_p_big", "bad_json", "k"])
def test_bad_input_exits_2_with_one_error_line(disk, tmp_path, capsys, case):
    prompts = disk / "question.jsonl"
    drafter = ["--drafter", "self"]
    extra: list = []
    fragments: tuple[str, ...]
    if case == "vocab":
        drafter, fragments = ["--draft", disk / "draft_vocab"], ("vocabulary of 400", "has 320")
    elif case == "tokenizer":
        drafter, fragments = ["--draft", disk / "draft_tok"], ("different tokenizer",)
    elif case == "head_target":
        drafter, fragments = ["--head", disk / "medusa_other"], ("num_hidden_layers 2 vs 4",)
    elif case == "context":
        prompts = write(tmp_path / "long.jsonl", json.dumps({"question_id": 9, "category": "c",
                                                             "turns": ["x" * 600]}) + "\n")
        fragments = ("prompt 9 (domain c) has", "context of 512")
    elif case == "empty":
        prompts, fragments = write(tmp_path / "empty.jsonl", ""), ("is empty",)
    elif case == "domain_field":
        extra, fragments = ["--domain-field", "topic"], ("unknown domain field 'topic'", "fields present")
    elif case == "temperature":
        extra, fragments = ["--temperature", "-0.5"], ("temperature must be >= 0",)
    elif case == "top_p_zero":
        extra, fragments = ["--top-p", "0"], ("top_p must be in (0, 1]",)
    elif case == "top_p_big":
        extra, fragments = ["--top-p", "1.5"], ("top_p must be in (0, 1]",)
    elif case == "bad_json":
        prompts = write(tmp_path / "bad.jsonl", '{"prompt": "a"}\n{oops\n')
        fragments = ("line 2", "not valid JSON")
    else:
        extra, fragments = ["--k", "0"], ("--k must be a positive integer",)
    out = tmp_path / "out"
    code, _, err = run_cli(["--target", disk / "target", *drafter, "--prompts", prompts, "--out", out,
                            "--max-new-tokens", "4", *extra], capsys)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in errors[0]
    assert not (out / "report.json").exists()
