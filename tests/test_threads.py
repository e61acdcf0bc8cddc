"""``--threads N`` on the long-running commands: one helper sets torch's thread count and refuses N < 1."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from specgraft.cli import main as cli_main
from specgraft.errors import SpecgraftError
from specgraft.utils.threads import set_torch_threads

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"train": REPO / "recipes" / "medusa" / "stories260k.yaml",
           "distill": REPO / "recipes" / "distill" / "stories260k.yaml"}


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_set_torch_threads_sets_torchs_count(restore_threads):
    set_torch_threads(2)
    assert torch.get_num_threads() == 2
    set_torch_threads(None)  # no option given: torch's own choice stays
    assert torch.get_num_threads() == 2
    set_torch_threads(1)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("threads", [0, -3])
def test_set_torch_threads_refuses_fewer_than_one(threads, restore_threads):
    before = torch.get_num_threads()
    with pytest.raises(SpecgraftError, match=f"--threads must be a positive integer, got {threads}; pass"):
        set_torch_threads(threads)
    assert torch.get_num_threads() == before


def _argv(command: str, tmp_path: Path, threads: str) -> list[str]:
    """The command with --threads and an input that fails right after the option is applied (no model loads)."""
    missing = str(tmp_path / "missing")
    if command in RECIPES:
        return [command, str(tmp_path / "missing.yaml"), "--threads", threads]
    if command == "regenerate":
        return [command, "--model", f"{missing}/model", "--data", missing, "--out", str(tmp_path / "o.jsonl"),
                "--threads", threads]
    prompts = tmp_path / "prompts.jsonl"  # eval reads its prompts before it sets threads and loads the target
    prompts.write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["hi"]}) + "\n")
    return [command, "--target", f"{missing}/model", "--drafter", "self", "--prompts", str(prompts), "--out",
            str(tmp_path / "eval"), "--threads", threads]


@pytest.mark.parametrize("command", ["train", "distill", "regenerate", "eval"])
def test_each_command_applies_threads_first(command, tmp_path, monkeypatch, capsys):
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert cli_main(_argv(command, tmp_path, "3")) == 2  # the missing input, reported after the option applied
    assert calls == [3]
    capsys.readouterr()
    assert cli_main(_argv(command, tmp_path, "0")) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: --threads must be a positive integer, got 0; pass --threads 1 or more"]
    assert calls == [3]


@pytest.mark.parametrize("command", sorted(RECIPES))
def test_a_multi_process_launch_passes_threads_on(command, monkeypatch, restore_threads):
    launched: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env=None: launched.append(cmd) or 0)
    assert cli_main([command, str(RECIPES[command]), "--num-processes", "2", "--threads", "2"]) == 0
    (cmd,) = launched
    assert cmd[-3:] == [str(RECIPES[command]), "--threads", "2"]
