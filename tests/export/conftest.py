"""Fixtures for export tests (helpers in helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgraft.target import Target

from .helpers import HEAD_CONFIGS, make_head, save_target_gguf, save_tiny_target


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> Target:
    return save_tiny_target(tmp_path_factory.mktemp("target") / "tiny-llama")


@pytest.fixture(scope="module")
def llama_target_gguf(llama_target, tmp_path_factory) -> Path:
    """The tiny llama target as a llama.cpp GGUF (for the llamacpp format's --target-gguf)."""
    return save_target_gguf(llama_target, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def saved_heads(llama_target, tmp_path_factory) -> dict[str, Path]:
    """One saved head folder per head type on the tiny llama target."""
    root = tmp_path_factory.mktemp("heads")
    folders = {}
    for head_type in HEAD_CONFIGS:
        head = make_head(llama_target, head_type)
        folders[head_type] = head.save_pretrained(root / head_type)
    return folders
