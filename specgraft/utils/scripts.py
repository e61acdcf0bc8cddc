"""Loading a sibling script (a benchmark or tool that is a file, not a package module) to reuse its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_sibling(caller_file: str | Path, name: str) -> ModuleType:
    """The module in ``<folder of caller_file>/<name>.py``, executed fresh and registered under ``name``.

    Benchmarks reuse each other's data splits and launchers this way without being installed as a package."""
    path = Path(caller_file).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses and pickling look a class's module up by name.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
