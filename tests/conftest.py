"""Shared fixtures: tiny random targets (no downloads) and the real stories260K target from ../shared/data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specgraft.testing import TINY_ARCHITECTURES, tiny_model, tiny_tokenizer

# Tiny models gain nothing from intra-op threads, and extra threads thrash when processes share 2 cores.
torch.set_num_threads(1)

#: ``../shared/data`` beside the checkout (absent in a user's clone: tests that need it skip).
SHARED_DATA = Path(os.environ.get("SPECGRAFT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(params=TINY_ARCHITECTURES)
def tiny_arch(request) -> str:
    """Parametrises a test over every tiny architecture."""
    return request.param


@pytest.fixture
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (only the project's own machines have ../shared/data)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tinystories_path(shared_data) -> Path:
    return shared_data / "tinystories" / "tinystories_train.txt"


@pytest.fixture(scope="session")
def stories260k_dir(shared_data, tmp_path_factory) -> Path:
    """stories260K converted once per session to a normal transformers folder (model + tokenizer)."""
    from specgraft.llama2c import convert_llama2c

    src = shared_data / "models" / "stories260K"
    out = tmp_path_factory.mktemp("stories260K") / "hf"
    convert_llama2c(src / "stories260K.bin", src / "tok512.bin", out)
    return out
