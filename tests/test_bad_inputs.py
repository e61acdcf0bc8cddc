"""The bad-input catalogue: every CLI command against bad recipes, datasets, checkpoints, exports, prompt files
and flags. Each case must exit non-zero with ONE ``error:`` line naming the problem, print no traceback, and leave
every existing output file unchanged."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from specgraft.cli import main as cli_main
from specgraft.heads.medusa.model import MedusaHead
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
    head = MedusaHead.build(target, MedusaHead.Config(num_heads=2).resolve(target))
    head.save_pretrained(root / "head")
    broken = root / "broken-head"
    head.save_pretrained(broken)
    (broken / "head.safetensors").write_bytes((broken / "head.safetensors").read_bytes()[:100])

    llama2c = root / "model.bin"
    llama2c.write_bytes(b"\x40\x00\x00\x00" * 7 + b"\x00" * 64)  # header says dim 64, file far too short

    protected = root / "protected"
    protected.mkdir()
    (protected / "keep.txt").write_text("user data")

    # Issue 15's cases.
    (root / "a-file").write_text("not a folder")
    (root / "latin1.jsonl").write_bytes(json.dumps({"text": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
                                        + b"\n")
    (root / "conversations.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}) + "\n")
    null_target = root / "head-null-target"
    head.save_pretrained(null_target)
    meta = json.loads((null_target / "head_config.json").read_text())
    (null_target / "head_config.json").write_text(json.dumps({**meta, "target": None}))
    nan_head = root / "head-nan"
    head.save_pretrained(nan_head)
    weights = load_file(str(nan_head / "head.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, str(nan_head / "head.safetensors"))
    bad_types = root / "report-bad-types"
    bad_types.mkdir()
    (bad_types / "report.json").write_text(json.dumps({"drafter": "medusa", "overall": [1], "domains": "x",
                                                       "plots": [1], "settings": 3}))
    sim_types = root / "report-bad-sim"
    sim_types.mkdir()
    (sim_types / "report.json").write_text(json.dumps({"overall": {"acceptance_by_depth": "abc"}, "drafter": 3}))
    self_report = root / "eval-self"
    self_report.mkdir()
    (self_report / "report.json").write_text(json.dumps({"drafter": {"type": "self", "path": None},
                                                         "overall": {"tau": 5.0}, "domains": {}}))
    from specgraft.export import export_head

    export_head(root / "head", "vllm", root / "export-local-base")  # target recorded as a local path
    return root


def _alias_bomb(path: Path) -> str:
    """367 bytes of YAML that a plain safe_load expands to 9**9 strings."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    return _write(path, "\n".join(lines) + "\n")


def _eval(w: Path, out: str, *extra: str) -> list[str]:
    return ["eval", "--target", str(w / "target"), "--drafter", "self", "--prompts", str(w / "prompts.jsonl"),
            "--out", str(w / out), "--max-new-tokens", "2", "--warmup", "0", "--no-progress", *extra]


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
                str(w / "fresh-regen.jsonl")], "does not exist"),
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
     lambda w: ["push", str(w / "export-local-base"), "--repo-id", "org/name", "--base-model", "org/target",
                "--token-env", "SPECGRAFT_NO_SUCH_TOKEN"],
     "token"),
    ("simulate with alpha > 1", lambda w: ["simulate", "--alpha", "1.5", "--draft-length", "4", "--cost-ratio",
                                           "0.1"], "alpha"),
    # -- issue 15: bounded sizes, checked before anything is allocated
    ("yaml alias bomb", lambda w: ["recipe", "check", _alias_bomb(w / "bomb.yaml")], "alias *a is not allowed"),
    ("simulate with a billion-token draft", lambda w: ["simulate", "--alpha", "0.8", "--draft-length", "1000000000",
                                                       "--cost-ratio", "0.1"], "draft length must be at most"),
    ("dry run with a 100k-layer feature index",
     lambda w: ["train", str(recipe(w, "fl", head={"type": "eagle3", "feature_layers": [1, 2, 100000]})),
                "--dry-run"], "head.feature_layers[2] must be in [0, 4096]"),
    # -- silent wrong results
    ("duplicate yaml key", lambda w: ["recipe", "check", _write(w / "dup.yaml", recipe(w, "dk").read_text()
                                                                + "training:\n  max_steps: 5\n")],
     "duplicate key 'training'"),
    ("learning rate nan", lambda w: ["train", str(recipe(w, "nan")), "training.learning_rate=nan"],
     "training.learning_rate must be a finite number"),
    ("learning rate inf in the yaml",
     lambda w: ["train", str(recipe(w, "inf", training={"learning_rate": float("inf")}))],
     "training.learning_rate must be a finite number"),
    ("adam_eps negative", lambda w: ["train", str(recipe(w, "eps", training={"adam_eps": -1.0}))],
     "training.adam_eps must be in (0.0, inf)"),
    ("seed negative", lambda w: ["train", str(recipe(w, "seed", training={"seed": -1}))], "training.seed must be in"),
    ("lora loss weight nan", lambda w: ["train", str(recipe(w, "lw")), "lora.kl_weight=nan"],
     "lora.kl_weight must be a finite number"),
    ("data.max_length above the target's context",
     lambda w: ["train", str(recipe(w, "ctx", data={"max_length": 100000}))], "context of"),
    ("tracking project outside the output folder",
     lambda w: ["train", str(recipe(w, "proj", tracking={"backend": "tensorboard", "project": "../../.."}))],
     "tracking.project must be a plain name"),
    ("eval with temperature inf", lambda w: _eval(w, "fresh-e6", "--temperature", "inf"), "finite"),
    ("regenerate with temperature nan",
     lambda w: ["regenerate", "--model", str(w / "target"), "--data", str(w / "conversations.jsonl"), "--out",
                str(w / "fresh-regen-nan.jsonl"), "--temperature", "nan"], "--temperature must be a finite number"),
    ("regenerate --out an existing file",
     lambda w: ["regenerate", "--model", str(w / "target"), "--data", str(w / "conversations.jsonl"), "--out",
                str(w / "protected" / "keep.txt")], "exists already"),
    ("regenerate --out a folder",
     lambda w: ["regenerate", "--model", str(w / "target"), "--data", str(w / "conversations.jsonl"), "--out",
                str(w / "protected")], "is a folder"),
    ("export of all-NaN head weights",
     lambda w: ["export", str(w / "head-nan"), "--format", "vllm", "--out", str(w / "fresh-x3")], "NaN"),
    # -- tracebacks before issue 15
    ("output.dir is a file", lambda w: ["train", str(recipe(w, "odf", output={"dir": str(w / "a-file")}))],
     "is a file"),
    ("output.dir under a file",
     lambda w: ["train", str(recipe(w, "odu", output={"dir": str(w / "a-file" / "out")}))], "not a folder"),
    ("output.dir with a 300-character name",
     lambda w: ["train", str(recipe(w, "long", output={"dir": str(w / ("n" * 300))}))], "shorten the path"),
    ("--num-processes negative", lambda w: ["train", str(recipe(w, "np")), "--num-processes", "-3"],
     "--num-processes must be at least 1"),
    ("non-UTF-8 JSONL", lambda w: ["train", str(recipe(w, "l1", data={"path": str(w / "latin1.jsonl"),
                                                                      "format": "auto"}))], "not UTF-8"),
    ("data cache folder under a file",
     lambda w: ["train", str(recipe(w, "cache", data={"cache_dir": str(w / "a-file" / "cache")}))],
     "cannot write the data cache folder"),
    ("head_config with a null target (export)",
     lambda w: ["export", str(w / "head-null-target"), "--format", "native", "--out", str(w / "fresh-x4")],
     "'target' is NoneType"),
    ("head_config with a null target (eval)",
     lambda w: ["eval", "--target", str(w / "target"), "--head", str(w / "head-null-target"), "--prompts",
                str(w / "prompts.jsonl"), "--out", str(w / "fresh-e7")], "'target' is NoneType"),
    ("eval --device that is no device", lambda w: _eval(w, "fresh-e8", "--device", "gpu0"),
     "is not a torch device name"),
    ("eval --out an existing report", lambda w: _eval(w, "protected"), "is not empty"),
    ("eval --out with a 300-character name", lambda w: _eval(w, "e" * 300), "shorten the path"),
    ("export with a report of wrong field types",
     lambda w: ["export", str(w / "head"), "--format", "native", "--out", str(w / "fresh-x5"), "--report",
                str(w / "report-bad-types")], "not a `specgraft eval` report"),
    ("simulate with a report of wrong field types",
     lambda w: ["simulate", "--report", str(w / "report-bad-sim"), "--cost-ratio", "0.1"],
     "not a `specgraft eval` report"),
    ("demo --out a file", lambda w: ["demo", "--quick", "--out", str(w / "a-file")], "is a file"),
    ("demo --threads -1", lambda w: ["demo", "--quick", "--out", str(w / "fresh-d"), "--threads", "-1"],
     "--threads must be at least 1"),
    # -- export metadata
    ("export --base-model that is a local path",
     lambda w: ["export", str(w / "head"), "--format", "vllm", "--out", str(w / "fresh-x6"), "--base-model",
                str(w / "target")], "is not a Hub repo id"),
    ("export with the report of another drafter",
     lambda w: ["export", str(w / "head"), "--format", "vllm", "--out", str(w / "fresh-x7"), "--report",
                str(w / "eval-self")], "measured the self drafter"),
    ("push of an export whose target is a local path",
     lambda w: ["push", str(w / "export-local-base"), "--repo-id", "org/name", "--dry-run"], "--base-model ORG/NAME"),
]
if not torch.cuda.is_available():
    CASES.append(("eval --device cuda without CUDA", lambda w: _eval(w, "fresh-e9", "--device", "cuda"),
                  "sees no CUDA GPU"))
if importlib.util.find_spec("wandb") is None:
    CASES.append(("wandb tracking without wandb",
                  lambda w: ["train", str(recipe(w, "wb", tracking={"backend": "wandb"}))], "wandb is not installed"))


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_catalogue_is_large_enough():
    assert len(CASES) >= 60
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


@pytest.mark.slow
def test_real_process_exit_code_and_no_traceback(world):
    """The same contract through a real process (what a shell user sees)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "specgraft", "train", str(recipe(world, "proc", model={
        "name_or_path": str(world / "missing")}))], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr


# -- the error boundary: environment and library errors are one line too (issue 15) ---------------------------


def _failing_command(monkeypatch, exc: BaseException) -> None:
    """`specgraft recipe ...` raising ``exc`` from inside the command."""
    import specgraft.commands.recipe as recipe_cli

    def run(args):
        raise exc

    monkeypatch.setattr(recipe_cli, "run", run)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("exc", "words"), [
    (OSError(errno.ENOSPC, "No space left on device", "/data/out/head.safetensors"),
     "No space left on device (/data/out/head.safetensors); free disk space"),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/out"), "Permission denied (/ro/out); check the file's"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/a/file/x"), "a component of the path is a file"),
    (OSError(errno.ENAMETOOLONG, "File name too long", "/x/" + "n" * 300), "shorten the path"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro"), "read-only"),
    (ValueError("Expected input batch_size (2) to match target batch_size (3)"),
     "ValueError: Expected input batch_size (2) to match target batch_size (3); the input was rejected"),
    (RuntimeError("shape '[2, -1]' is invalid for input of size 3"), "RuntimeError: shape"),
    (AssertionError("cache row count mismatch"), "AssertionError: cache row count mismatch"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "UnicodeDecodeError:"),
])
def test_environment_and_library_errors_are_one_line(monkeypatch, capsys, exc, words):
    _failing_command(monkeypatch, exc)
    assert cli_main(["recipe", "check", "x.yaml"]) == 2
    err = capsys.readouterr().err
    line = _one_error_line(err)
    assert words in line and "Traceback" not in err
    if not isinstance(exc, OSError):
        assert "rerun with -v for the traceback" in line


def test_verbose_adds_the_traceback(monkeypatch, capsys):
    _failing_command(monkeypatch, ValueError("a real bug"))
    assert cli_main(["-v", "recipe", "check", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "raise exc" in err
    assert err.strip().splitlines()[-1].startswith("error: ValueError: a real bug")


@pytest.mark.parametrize(("command", "hint"), [
    ("train", "continue from the last checkpoint with `specgraft train r.yaml --resume`"),
    ("recipe", "rerun the command"),
])
def test_interrupt_names_the_actual_rerun(monkeypatch, capsys, command, hint):
    import specgraft.commands.recipe as recipe_cli
    import specgraft.commands.train as train_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli if command == "train" else recipe_cli, "run", interrupted)
    argv = ["train", "r.yaml"] if command == "train" else ["recipe", "check", "r.yaml"]
    assert cli_main(argv) == 130
    assert hint in _one_error_line(capsys.readouterr().err)


def test_error_after_a_progress_bar_starts_its_own_line(monkeypatch, capsys):
    from tqdm.auto import tqdm

    from specgraft.errors import SpecgraftError

    def fails_mid_bar(args):
        bar = tqdm(total=3, desc="train medusa")
        bar.update(1)
        raise SpecgraftError("the loss became nan at step 2")

    import specgraft.commands.recipe as recipe_cli

    monkeypatch.setattr(recipe_cli, "run", fails_mid_bar)
    assert cli_main(["recipe", "check", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert _one_error_line(err) == "error: the loss became nan at step 2"
    assert not [line for line in err.splitlines() if "error:" in line and not line.startswith("error:")]


# -- runs that fail, resume and rerun --------------------------------------------------------------------------


def test_failed_start_does_not_block_the_plain_rerun(world, capsys):
    """A run that fails before its first checkpoint (here: the loss becomes inf at once) leaves only the resolved
    recipe; rerunning the same command without --resume trains instead of refusing the folder."""
    out = world / "fresh-failed-start"
    diverging = recipe(world, "diverge", training={"learning_rate": 1e30, "max_steps": 3},
                       output={"dir": str(out)})
    assert cli_main(["train", str(diverging), "--no-progress"]) == 2
    assert "the loss became" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["recipe.yaml"]
    fixed = recipe(world, "diverge", training={"learning_rate": 1e-3, "max_steps": 1}, output={"dir": str(out)})
    assert cli_main(["train", str(fixed), "--no-progress"]) == 0
    assert (out / "head" / "head.safetensors").is_file()
    # A folder holding anything else is still refused.
    (world / "fresh-user-files").mkdir()
    (world / "fresh-user-files" / "recipe.yaml").write_text("my: notes\n")
    mine = recipe(world, "mine", output={"dir": str(world / "fresh-user-files")})
    assert cli_main(["train", str(mine), "--no-progress"]) == 2
    assert "is not empty" in _one_error_line(capsys.readouterr().err)
    assert (world / "fresh-user-files" / "recipe.yaml").read_text() == "my: notes\n"


def test_resume_with_max_steps_below_the_checkpoint_is_refused(world, capsys):
    out = world / "fresh-resume"
    path = recipe(world, "resume", training={"max_steps": 2, "checkpoint_every": 1}, output={"dir": str(out)})
    assert cli_main(["train", str(path), "--no-progress"]) == 0
    before = snapshot(out)
    assert cli_main(["train", str(path), "training.max_steps=1", "--resume", "--no-progress"]) == 2
    assert "training.max_steps is 1 but checkpoint" in _one_error_line(capsys.readouterr().err)
    assert snapshot(out) == before  # the saved recipe still says what the checkpoints are


# -- eval --out: never replaced silently, one writer at a time -------------------------------------------------


def test_eval_overwrite_and_lock(world, capsys):
    from specgraft.utils.io import output_lock

    out = world / "fresh-eval-lock"
    assert cli_main(_eval(world, out.name)) == 0
    first = snapshot(out)
    assert cli_main(_eval(world, out.name)) == 2
    assert "is not empty" in _one_error_line(capsys.readouterr().err)
    assert snapshot(out) == first
    with output_lock(out):  # another eval writing there right now
        assert cli_main(_eval(world, out.name, "--overwrite")) == 2
        assert "another specgraft process is writing to" in _one_error_line(capsys.readouterr().err)
    assert snapshot(out) == first
    assert cli_main(_eval(world, out.name, "--overwrite", "--max-new-tokens", "3")) == 0
    assert json.loads((out / "report.json").read_text())["settings"]["max_new_tokens"] == 3


# -- the tokenized-data cache is keyed by content ---------------------------------------------------------------


def test_data_cache_sees_an_edit_with_the_same_size_and_mtime(tmp_path):
    from specgraft.config import DataConfig
    from specgraft.data import build_dataset

    data = tmp_path / "data.txt"
    data.write_text("aaaa bbbb cccc dddd " * 10)
    stat = data.stat()
    cfg = DataConfig(path=str(data), format="text", max_length=32, cache_dir=str(tmp_path / "cache"))
    old_rows = build_dataset(cfg, tiny_tokenizer())["train"]["input_ids"]
    data.write_text("zzzz yyyy xxxx wwww " * 10)  # same length
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    new_rows = build_dataset(cfg, tiny_tokenizer())["train"]["input_ids"]
    assert list(new_rows) != list(old_rows)
    text = tiny_tokenizer().decode(list(new_rows[0]))
    assert "zzzz" in text and "aaaa" not in text


def test_dry_run_says_when_the_data_path_is_missing(world, capsys):
    """The stand-in trains on synthetic data (recipes are dry-run before the data is downloaded), so the dry run
    passes, but it must not say "ok" without saying that the real run would fail."""
    path = recipe(world, "drm", data={"path": str(world / "nope.jsonl"), "max_length": 256})
    assert cli_main(["train", str(path), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "dry run ok" not in captured.out and "dry run passed except for its inputs" in captured.out
    assert f"WARNING: the real run will fail here: data path {world / 'nope.jsonl'} does not exist" in captured.err


# -- issue 47: nothing lost, nothing leaked ------------------------------------------------------------------------
# Every case runs in its own folder `case` (inputs made there; the shared `world` models are read only) and must
# give one `error:` line, exit 2, no traceback, leave the sha256 of every file of `world` and `case` unchanged and
# write nothing outside its output (`case/out`, which a refused run must not create either).

SECRET = b"hf_not-for-the-hub-0123456789"


def _tree(*roots: Path) -> dict[str, str]:
    """sha256 of every file (links read as links) under ``roots``, and every folder, by path."""
    seen: dict[str, str] = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if "hf-home" in path.parts or "cache" in path.parts:
                continue
            if path.is_symlink():
                seen[str(path)] = "link->" + os.readlink(path)
            elif path.is_file():
                seen[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_dir():
                seen[str(path)] = "dir"
    return seen


def assert_no_leak(folder: Path, secret: bytes = SECRET) -> None:
    """The leak check: no regular file under ``folder`` holds ``secret`` (a file reached through a link)."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert secret not in path.read_bytes(), f"{path} holds the secret a link pointed at"


def _secret(case: Path) -> Path:
    outside = case / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "token").write_bytes(SECRET)
    (outside / ".ssh").mkdir(exist_ok=True)
    (outside / ".ssh" / "id_rsa").write_bytes(SECRET)
    return outside


def _head_copy(world: Path, case: Path, name: str = "head") -> Path:
    import shutil

    return Path(shutil.copytree(world / "head", case / name))


def _linked_recipe(w: Path, c: Path) -> list[str]:
    head = _head_copy(w, c)
    (head / "recipe.yaml").symlink_to(_secret(c) / "token")
    return ["export", str(head), "--format", "native", "--out", str(c / "out")]


def _linked_adapter(w: Path, c: Path) -> list[str]:
    head = _head_copy(w, c)
    (head / "adapter").symlink_to(_secret(c) / ".ssh", target_is_directory=True)
    return ["export", str(head), "--format", "native", "--out", str(c / "out")]


def _linked_adapter_file(w: Path, c: Path) -> list[str]:
    head = _head_copy(w, c)
    (head / "adapter").mkdir()
    (head / "adapter" / "adapter_config.json").symlink_to(_secret(c) / "token")
    return ["export", str(head), "--format", "native", "--out", str(c / "out")]


def _export(w: Path, c: Path, fmt: str = "vllm") -> Path:
    from specgraft.export import export_head

    return export_head(w / "head", fmt, c / "exported", keep_name=True).path


def _push_swapped_link(w: Path, c: Path) -> list[str]:
    export = _export(w, c)
    (export / "config.json").unlink()
    (export / "config.json").symlink_to(_secret(c) / "token")
    return ["push", str(export), "--repo-id", "org/x", "--dry-run"]


def _push_edited(w: Path, c: Path) -> list[str]:
    export = _export(w, c)
    (export / "config.json").write_bytes(SECRET)
    return ["push", str(export), "--repo-id", "org/x", "--dry-run"]


def _report_folder(c: Path) -> Path:
    report = c / "report"
    report.mkdir()
    (report / "report.json").write_text(json.dumps({"drafter": {"type": "medusa"}, "overall": {"tau": 1.5},
                                                    "domains": {}}))
    return report


def _user_folder(c: Path) -> Path:
    folder = c / "out"
    folder.mkdir()
    (folder / "keep.txt").write_text("user data")
    return folder


def _gguf_in_out(w: Path, c: Path) -> list[str]:
    (c / "out").mkdir()
    (c / "out" / "model.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    return ["convert-gguf", str(c / "out" / "model.gguf"), "--out", str(c / "out"), "--overwrite"]


def _tuned_by_hand(w: Path, c: Path) -> list[str]:
    head = _head_copy(w, c)
    (head / "tuned.json").write_text('{"my": "notes"}')
    return ["tune", "--target", str(w / "target"), "--head", str(head), "--prompts", str(w / "prompts.jsonl"),
            "--overwrite"]


#: (class, case id, argv builder (world, case folder), words the error line must contain)
CASES_47 = [
    # -- data loss through --overwrite
    ("overwrite", "profile --out the run folder",
     lambda w, c: ["profile", "--target", str(w / "target"), "--head", str(_head_copy(w, c)), "--out",
                   str(c / "head"), "--overwrite"], "is the input"),
    ("overwrite", "profile --out the head's weights",
     lambda w, c: ["profile", "--target", str(w / "target"), "--head", str(_head_copy(w, c)), "--out",
                   str(c / "head" / "head.safetensors"), "--overwrite"], "written by another program"),
    ("overwrite", "profile --out a folder", lambda w, c: ["profile", "--target", str(w / "target"), "--out",
                                                          str(_user_folder(c)), "--overwrite"], "is a folder"),
    ("overwrite", "convert-gguf --out the folder holding its source", _gguf_in_out, "contains the input"),
    ("overwrite", "export --out its own --report folder",
     lambda w, c: ["export", str(w / "head"), "--format", "native", "--report", str(_report_folder(c)), "--out",
                   str(c / "report"), "--overwrite"], "is the input"),
    ("overwrite", "export --out a folder holding the head",
     lambda w, c: ["export", str(_head_copy(w, c, "runs/x/head")), "--format", "native", "--out",
                   str(c / "runs"), "--overwrite"], "contains the input"),
    ("overwrite", "export --overwrite a folder it did not write",
     lambda w, c: ["export", str(w / "head"), "--format", "native", "--out", str(_user_folder(c)),
                   "--overwrite"], "written by another program"),
    ("overwrite", "eval --overwrite a folder it did not write",
     lambda w, c: [*_eval(w, "unused"), "--out", str(_user_folder(c)), "--overwrite"], "written by another program"),
    ("overwrite", "eval --out the head folder",
     lambda w, c: ["eval", "--target", str(w / "target"), "--head", str(_head_copy(w, c)), "--prompts",
                   str(w / "prompts.jsonl"), "--out", str(c / "head"), "--overwrite"], "is the input"),
    ("overwrite", "demo --overwrite a folder it did not write",
     lambda w, c: ["demo", "--quick", "--out", str(_user_folder(c)), "--overwrite"], "written by another program"),
    ("overwrite", "convert-llama2c --overwrite a folder it did not write",
     lambda w, c: ["convert-llama2c", str(w / "model.bin"), str(w / "model.bin"), "--out", str(_user_folder(c)),
                   "--overwrite"], "written by another program"),
    ("overwrite", "train output.overwrite into a folder it did not write",
     lambda w, c: ["train", str(recipe(w, "ow47", output={"dir": str(_user_folder(c)), "overwrite": True}))],
     "written by another program"),
    ("overwrite", "export --overwrite an eval report",
     lambda w, c: ["export", str(w / "head"), "--format", "native", "--out",
                   str(_marked(_user_folder(c), "eval")), "--overwrite"], "written by `specgraft eval`"),
    ("overwrite", "tune --overwrite a tuned.json written by hand", _tuned_by_hand, "written by another program"),
    ("overwrite", "regenerate --out its own --data",
     lambda w, c: ["regenerate", "--model", str(w / "target"), "--data", str(_copy(w / "conversations.jsonl", c)),
                   "--out", str(c / "conversations.jsonl")], "is the input"),
    # -- files leak into exports
    ("leak", "export native: recipe.yaml links outside", _linked_recipe, "outside"),
    ("leak", "export native: adapter/ links outside", _linked_adapter, "outside"),
    ("leak", "export native: a file in adapter/ links outside", _linked_adapter_file, "outside"),
    ("leak", "push --dry-run /etc", lambda w, c: ["push", "/etc", "--repo-id", "org/x", "--dry-run"],
     "has no specgraft_manifest.json"),
    ("leak", "push a head folder (not an export)",
     lambda w, c: ["push", str(w / "head"), "--repo-id", "org/x", "--dry-run"], "not the output of `specgraft export`"),
    ("leak", "push an export whose file became a link", _push_swapped_link, "is a symlink"),
    ("leak", "push an export whose file was edited", _push_edited, "changed since `specgraft export` wrote it"),
]


def _profile(c: Path, edit) -> str:
    """A valid-looking cost profile with ``edit`` applied to its dict."""
    data = {"version": 1, "device": "cpu", "device_name": "cpu", "dtype": "float32", "threads": 1,
            "torch_version": "2", "target": {}, "kv_length": 64,
            "step_s": {"chain": {"1": 0.01, "2": 0.012}, "tree": {"2": 0.013}}, "drafters": {}}
    edit(data)
    (c / "profile.json").write_text(json.dumps(data))
    return str(c / "profile.json")


def _tune_with(w: Path, *extra: str) -> list[str]:
    return ["tune", "--target", str(w / "target"), "--head", str(w / "head"), "--prompts", str(w / "prompts.jsonl"),
            "--out", str(w / "fresh-tune-unused"), *extra]


def _report(c: Path, overall: dict, drafter: dict | None = None) -> str:
    folder = c / "report"
    folder.mkdir(exist_ok=True)
    text = json.dumps({"drafter": drafter or {"type": "medusa", "path": None, "mode": "tree"}, "domains": {},
                       "overall": {"steps": 4, "depth_accepted": [2, 1], "tau": 1.5, **overall}})
    (folder / "report.json").write_text(text)
    return str(folder)


def _head_with_tuned(w: Path, c: Path, record: object) -> str:
    head = _head_copy(w, c)
    (head / "tuned.json").write_text(json.dumps(record))
    return str(head)


NUMBER_CASES = [
    ("numbers", "tune with a NaN step cost",
     lambda w, c: _tune_with(w, "--cost-profile", _profile(c, lambda d: d["step_s"]["chain"].update({"2": math.nan}))),
     "holds NaN, which is not a finite number"),
    ("numbers", "tune with a negative step cost",
     lambda w, c: _tune_with(w, "--cost-profile", _profile(c, lambda d: d["step_s"]["chain"].update({"2": -0.5}))),
     "step_s.chain.2 is -0.5; it must be a finite number > 0"),
    ("numbers", "tune with all-zero step costs",
     lambda w, c: _tune_with(w, "--cost-profile", _profile(c, lambda d: d["step_s"].update(
         chain={"1": 0, "2": 0}))), "step_s.chain.1 is 0; it must be a finite number > 0"),
    ("numbers", "tune with a profile section of the wrong type",
     lambda w, c: _tune_with(w, "--cost-profile", _profile(c, lambda d: d.update(drafters={"x": [1, 2]}))),
     "drafters.x is list, not an object"),
    ("numbers", "tune with a step cost given as a string",
     lambda w, c: _tune_with(w, "--cost-profile", _profile(c, lambda d: d["step_s"]["chain"].update({"2": "fast"}))),
     "is 'fast', not a number"),
    ("numbers", "simulate with a NaN report value",
     lambda w, c: ["simulate", "--report", _report(c, {"alpha_exact": math.nan}), "--cost-ratio", "0.1"],
     "holds NaN"),
    ("numbers", "simulate with a negative acceptance rate",
     lambda w, c: ["simulate", "--report", _report(c, {"acceptance_by_depth": [0.5, -0.2]}), "--cost-ratio", "0.1"],
     "acceptance_by_depth[1] is -0.2"),
    ("numbers", "tune with the calibration of another drafter",
     lambda w, c: _tune_with(w, "--calibration", _report(c, {}, {"type": "self", "path": None})),
     "measured the self drafter, not this medusa drafter"),
    ("numbers", "profile --kv-length 0",
     lambda w, c: ["profile", "--target", str(w / "target"), "--out", str(c / "p.json"), "--kv-length", "0"],
     "--kv-length must be at least 2"),
    ("numbers", "tune --kv-length 0", lambda w, c: _tune_with(w, "--kv-length", "0"), "--kv-length must be at least 2"),
    ("numbers", "profile --repeats unbounded",
     lambda w, c: ["profile", "--target", str(w / "target"), "--out", str(c / "p.json"), "--repeats", "1000000000"],
     "--repeats must be in [1, 1000]"),
    ("numbers", "eval --repeats unbounded", lambda w, c: [*_eval(w, "unused"), "--out", str(c / "out"), "--repeats",
                                                          "1000000000"], "repeats must be at most 1000"),
    ("numbers", "export --speculative-tokens huge",
     lambda w, c: ["export", str(w / "head"), "--format", "native", "--out", str(c / "out"), "--speculative-tokens",
                   "1000000000"], "speculative tokens must be an integer in [1, 64]"),
    ("numbers", "export with a NaN report value",
     lambda w, c: ["export", str(w / "head"), "--format", "native", "--out", str(c / "out"), "--report",
                   _report(c, {"tau": math.nan}, {"type": "medusa", "path": str(w / "head")})], "holds NaN"),
    ("numbers", "export --repo-id ../../x",
     lambda w, c: ["export", str(w / "head"), "--format", "native", "--out", str(c / "out"), "--repo-id", "../../x"],
     "is not a Hub repo id"),
    ("numbers", "push --repo-id org/..",
     lambda w, c: ["push", str(_export(w, c)), "--repo-id", "org/..", "--dry-run"], "is not of the form ORG/NAME"),
    ("numbers", "export with a tuned.json depth of -1",
     lambda w, c: ["export", _head_with_tuned(w, c, {"kind": "medusa", "setting": {"mode": "tree", "depth": -1},
                                                     "device": {}}), "--format", "native", "--out", str(c / "out")],
     "setting.depth is -1"),
    ("numbers", "eval with a tuned.json whose setting is a list",
     lambda w, c: ["eval", "--target", str(w / "target"), "--head", _head_with_tuned(w, c, {
         "kind": "medusa", "setting": [3], "device": {}}), "--prompts", str(w / "prompts.jsonl"), "--out",
                   str(c / "out")], "setting is list, not an object"),
]
CASES_47 += NUMBER_CASES


def _gzip_bomb(c: Path, name: str, line: bytes, size: int, lines: bool = False) -> Path:
    """A small .gz that expands to about ``size`` bytes: ``line`` repeated (one huge line unless ``lines``)."""
    import gzip

    path = c / name
    unit = line + b"\n" if lines else line
    chunk = unit * max(1, (1 << 20) // len(unit))
    with gzip.open(path, "wb", compresslevel=9) as fh:
        for _ in range(size // len(chunk)):
            fh.write(chunk)
    return path


def _gguf_huge_array(c: Path) -> str:
    """A 100-byte GGUF whose metadata claims an array of 2**30 strings (a reader would allocate by it)."""
    import struct

    key = b"tokenizer.ggml.tokens"
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, 1 << 30) + b"\0" * 64)
    (c / "huge.gguf").write_bytes(data)
    return str(c / "huge.gguf")


def _gguf_huge_string(c: Path) -> str:
    import struct

    key = b"general.architecture"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, 1 << 40)
    (c / "huge.gguf").write_bytes(data + b"llama")
    return str(c / "huge.gguf")


def _tiny_gguf(c: Path, **changes) -> str:
    from specgraft.testing import write_tiny_gguf

    return str(write_tiny_gguf(c / "model.gguf", **changes))


EXPAND_CASES = [
    ("expand", "eval --prompts: a .gz of one 100 MB line",
     lambda w, c: [*_eval(w, "unused"), "--out", str(c / "out"), "--prompts",
                   str(_gzip_bomb(c, "bomb.jsonl.gz", b"a", 100 << 20))], "has a line longer than 8 MiB"),
    ("expand", "eval --prompts: a .gz of 100 MB of short prompts",
     lambda w, c: [*_eval(w, "unused"), "--out", str(c / "out"), "--prompts",
                   str(_gzip_bomb(c, "many.jsonl.gz", b'{"text": "hi"}', 100 << 20, lines=True))],
     "holds more than 100,000 prompts"),
    ("expand", "train data: a .gz of one 100 MB record",
     lambda w, c: ["train", str(recipe(w, "gzb", data={"path": str(_gzip_bomb(c, "data.jsonl.gz", b"a", 100 << 20)),
                                                        "format": "auto"}))], "has a line longer than 64 MiB"),
    ("expand", "convert-gguf: metadata claims a 2**30-string array",
     lambda w, c: ["convert-gguf", _gguf_huge_array(c), "--out", str(c / "out")],
     "(an array of 1073741824 items) does not fit"),
    ("expand", "convert-gguf: metadata claims a 1 TB string",
     lambda w, c: ["convert-gguf", _gguf_huge_string(c), "--out", str(c / "out")], "(a string) does not fit"),
    ("expand", "eval --prompts: a damaged .gz", lambda w, c: [*_eval(w, "unused"), "--out", str(c / "out"),
                                                             "--prompts", str(_write(c / "cut.jsonl.gz", "x"))],
     "not a complete gzip file"),
    ("gguf", "convert-gguf: a tensor missing", lambda w, c: ["convert-gguf", _tiny_gguf(
        c, drop_tensors=("blk.1.ffn_up.weight",)), "--out", str(c / "out")],
     "model.layers.1.mlp.up_proj.weight are missing and would be random"),
    ("gguf", "convert-gguf: metadata names a layer the file lacks",
     lambda w, c: ["convert-gguf", _tiny_gguf(c, block_count=3), "--out", str(c / "out")],
     "does not hold every weight its metadata describes"),
    ("gguf", "convert-gguf: context length 0",
     lambda w, c: ["convert-gguf", _tiny_gguf(c, context_length=0), "--out", str(c / "out")],
     "its context length is 0"),
    ("gguf", "eval with a GGUF target missing a tensor",
     lambda w, c: ["eval", "--target", _tiny_gguf(c, drop_tensors=("output_norm.weight",)), "--drafter", "self",
                   "--prompts", str(w / "prompts.jsonl"), "--out", str(c / "out")], "are missing and would be random"),
]
CASES_47 += EXPAND_CASES


def _broken_merges(w: Path, c: Path) -> str:
    """A copy of the target whose tokenizer.json has a merge rule that is not a pair."""
    import shutil

    target = Path(shutil.copytree(w / "target", c / "target"))
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    tokenizer["model"]["merges"] = [["a"], *(tokenizer["model"].get("merges") or [])]
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(target)


def _edited_head_config(w: Path, c: Path) -> str:
    head = _head_copy(w, c)
    meta = json.loads((head / "head_config.json").read_text())
    meta["config"]["num_heads"] += 1
    (head / "head_config.json").write_text(json.dumps(meta))
    return str(head)


MESSAGE_CASES = [
    ("traceback", "train --resume into a non-UTF-8 output.dir",
     lambda w, c: ["train", str(recipe(w, "nu")), f"output.dir={c}/out-\udcff", "--resume"], "is not valid UTF-8"),
    ("traceback", "eval of a target whose tokenizer has a malformed merge rule",
     lambda w, c: ["eval", "--target", _broken_merges(w, c), "--drafter", "self", "--prompts",
                   str(w / "prompts.jsonl"), "--out", str(c / "out")], "could not load the tokenizer of"),
    ("traceback", "regenerate with a tokenizer that has a malformed merge rule",
     lambda w, c: ["regenerate", "--model", _broken_merges(w, c), "--data", str(w / "conversations.jsonl"), "--out",
                   str(c / "out.jsonl")], "could not load the tokenizer of --model"),
    ("message", "an override after a flag",
     lambda w, c: ["train", str(recipe(w, "oaf")), "--no-progress", "training.max_steps=2"],
     "override(s) training.max_steps=2 came after a flag; overrides go right after the recipe"),
    ("message", "--prompts a folder", lambda w, c: [*_eval(w, "unused"), "--out", str(c / "out"), "--prompts",
                                                   str(w / "protected")], "is a folder, not a file"),
    ("message", "--prompts a device", lambda w, c: [*_eval(w, "unused"), "--out", str(c / "out"), "--prompts",
                                                   "/dev/null"], "is not a regular file"),
    ("message", "a recipe that is a folder", lambda w, c: ["train", str(w / "protected")], "is a folder, not a file"),
    ("message", "export --out the head's weights file",
     lambda w, c: ["export", str(_head_copy(w, c)), "--format", "native", "--out",
                   str(c / "head" / "head.safetensors")],
     "is a file; pass a folder path"),
    ("message", "a hand-edited head_config.json",
     lambda w, c: ["export", _edited_head_config(w, c), "--format", "vllm", "--out", str(c / "out")],
     "head_config.json disagree"),
    ("message", "--cost-profile a folder",
     lambda w, c: _tune_with(w, "--cost-profile", str(w / "protected")), "cost profile"),
]
CASES_47 += MESSAGE_CASES


def _marked(folder: Path, command: str) -> Path:
    from specgraft.utils.outputs import mark_output

    mark_output(folder, command)
    return folder


def _copy(src: Path, folder: Path) -> Path:
    (folder / src.name).write_bytes(src.read_bytes())
    return folder / src.name


def run_contract(world: Path, case: Path, argv: list[str], words: str, capsys, monkeypatch) -> str:
    """Run ``argv`` and check the whole contract; returns the error line."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(world / "hf-home"))
    monkeypatch.setenv("SPECGRAFT_GGUF_CACHE", str(case / "gguf-cache"))  # never the user's cache
    out_existed = (case / "out").exists()
    before = _tree(world, case)
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, f"{argv} exited {code}: {err}"
    line = _one_error_line(err)
    assert words.lower() in line.lower(), line
    assert "Traceback" not in err
    after = _tree(world, case)
    if not out_existed:
        assert not (case / "out").exists(), "a refused run created its output"
    assert after == before, f"files changed: {sorted(set(after.items()) ^ set(before.items()))[:6]}"
    assert_no_leak(case / "out") if (case / "out").is_dir() else None
    return line


@pytest.mark.parametrize("case", CASES_47, ids=[f"{c[0]}: {c[1]}" for c in CASES_47])
def test_issue_47_case(world, case, tmp_path, capsys, monkeypatch):
    _, _, build_argv, words = case
    argv = build_argv(world, tmp_path)
    run_contract(world, tmp_path, argv, words, capsys, monkeypatch)


def test_issue_47_has_a_case_per_class():
    classes = {c[0] for c in CASES_47} | ({"lock"} if LOCK_CASES else set())
    assert {"overwrite", "leak", "lock", "numbers", "expand", "gguf", "traceback", "message"} <= classes


def test_leak_check_catches_a_command_that_follows_a_link(world, tmp_path, monkeypatch):
    """The negative control: an export made to follow links (the guard switched off) must fail the leak check, so
    the check above is not vacuous."""
    import specgraft.export.exporter as exporter

    def follows_links(root, names, what):
        return [n for n in names if (root / n).is_file()] + [
            str(p.relative_to(root)) for n in names if (root / n).is_dir() for p in (root / n).rglob("*")]

    monkeypatch.setattr(exporter, "files_inside", follows_links)
    argv = _linked_recipe(world, tmp_path)
    assert cli_main(argv) == 0
    with pytest.raises(AssertionError, match="holds the secret"):
        assert_no_leak(tmp_path / "out")


def test_overwrite_replaces_an_earlier_output_of_the_same_command(world, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["export", str(world / "head"), "--format", "native", "--out", str(out)]) == 0
    (out / "stale.bin").write_bytes(b"old")
    assert cli_main(["export", str(world / "head"), "--format", "native", "--out", str(out), "--overwrite"]) == 0
    assert not (out / "stale.bin").exists() and (out / "head.safetensors").is_file()
    manifest = json.loads((out / "specgraft_manifest.json").read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in out.iterdir()
                                      if not p.name.startswith(".") and p.name != "specgraft_manifest.json")
    capsys.readouterr()
    assert cli_main(["push", str(out), "--repo-id", "org/x", "--dry-run"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(manifest)


#: Concurrent writers: (case id, argv builder, the folder and lock-file name another run holds)
LOCK_CASES = [
    ("train into a folder another train writes",
     lambda w, c: ["train", str(recipe(w, "lk", output={"dir": str(c / "out")}))], lambda c: (c / "out", None)),
    ("distill into a folder another distill writes",
     lambda w, c: ["distill", str(recipe(w, "lkd", distill={}, output={"dir": str(c / "out")}))],
     lambda c: (c / "out", None)),
    ("tune while another tune writes its reports",
     lambda w, c: ["tune", "--target", str(w / "target"), "--head", str(_head_copy(w, c)), "--prompts",
                   str(w / "prompts.jsonl")], lambda c: (c / "head" / "tune", None)),
    ("regenerate into a file another regenerate writes",
     lambda w, c: ["regenerate", "--model", str(w / "target"), "--data", str(w / "conversations.jsonl"), "--out",
                   str(c / "regen.jsonl")], lambda c: (c, ".regen.jsonl.specgraft-output.json")),
    ("export into a folder another export writes",
     lambda w, c: ["export", str(w / "head"), "--format", "native", "--out", str(c / "out")],
     lambda c: (c / "out", None)),
    ("profile into a file another profile writes",
     lambda w, c: ["profile", "--target", str(w / "target"), "--out", str(c / "p.json")],
     lambda c: (c, ".p.json.specgraft-output.json")),
    ("convert-gguf into a folder another conversion writes",
     lambda w, c: ["convert-gguf", str(_copy(w / "model.bin", c)), "--out", str(c / "out")],
     lambda c: (c / "out", None)),
    ("demo into a folder another demo writes",
     lambda w, c: ["demo", "--quick", "--out", str(c / "out")], lambda c: (c / "out", None)),
]


@pytest.mark.parametrize("case", LOCK_CASES, ids=[c[0] for c in LOCK_CASES])
def test_issue_47_one_writer_per_output(world, case, tmp_path, capsys, monkeypatch):
    from specgraft.utils.io import LOCK_NAME, output_lock

    _, build_argv, held = case
    argv = build_argv(world, tmp_path)
    folder, name = held(tmp_path)
    with output_lock(folder, "the other run", name=name or LOCK_NAME):
        run_contract(world, tmp_path, argv, "another specgraft process is writing to", capsys, monkeypatch)


@pytest.mark.parametrize("case", [c for c in EXPAND_CASES if c[0] == "expand" and "damaged" not in c[1]],
                         ids=[c[1] for c in EXPAND_CASES if c[0] == "expand" and "damaged" not in c[1]])
def test_expanding_inputs_are_refused_under_1_gb(world, case, tmp_path):
    """Peak memory of the whole process (imports included) until the refusal stays under 1 GB: the limits are
    checked while reading, not after."""
    _, _, build_argv, words = case
    argv = build_argv(world, tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(world / "hf-home")}
    peak_file = tmp_path / "peak_kib.txt"
    # The child's own high-water mark, written as it exits: the kernel's rusage of a child also counts the memory
    # it shared with this (large) test process before its exec, which is not the command's.
    runner = ("import atexit, runpy, sys\n"
              "def _peak():\n"
              "    hwm = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')]\n"
              f"    open({str(peak_file)!r}, 'w').write(hwm[0])\n"
              "atexit.register(_peak)\n"
              "sys.argv = ['specgraft', *sys.argv[1:]]\n"
              "runpy.run_module('specgraft', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.run([sys.executable, "-c", runner, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, env=env)
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    peak_kib = int(peak_file.read_text())
    assert peak_kib < 1 << 20, f"peak memory {peak_kib / 1024:.0f} MiB"
    print(f"{case[1]}: peak {peak_kib / 1024:.0f} MiB")


def test_issue_47_traceback_disk_full_in_safetensors(world, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (no OSError): still one line with the OS hint."""
    import safetensors.torch
    from safetensors import SafetensorError

    def disk_full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.setattr("specgraft.export.exporter.save_file", disk_full)
    assert safetensors.torch.save_file is not disk_full
    argv = ["export", str(world / "head"), "--format", "vllm", "--out", str(tmp_path / "out")]
    line = run_contract(world, tmp_path, argv, "No space left on device", capsys, monkeypatch)
    assert "free disk space" in line


def test_issue_47_traceback_ctrl_c_while_starting(monkeypatch, capsys):
    """Ctrl-C while the command's libraries are imported (before the command runs) is one line, exit 130."""
    import specgraft.cli as cli

    def interrupted(command=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli_main(["train", "r.yaml"]) == 130
    err = capsys.readouterr().err
    assert _one_error_line(err) == "error: interrupted while starting; rerun the command" and "Traceback" not in err


def test_issue_47_message_export_help_lists_each_familys_formats(capsys):
    """`export --help` names, per family, exactly the formats the registry can export it to."""
    from specgraft.export.formats import supported_formats

    with pytest.raises(SystemExit):
        cli_main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for family, formats in supported_formats().items():
        assert f"{family}: {', '.join(f for f in formats if f != 'native')};" in text, (family, formats)
