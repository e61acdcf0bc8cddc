"""Helpers the benchmark and tool scripts share: loading a sibling script (a file, not a package module) to reuse
its functions, and per-run recipe overrides on their command lines."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
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


def parse_run_overrides(items: Iterable[str], runs: Iterable[str], flag: str = "--override") -> dict[str, list[str]]:
    """``["eagle3:training.max_steps=100"]`` -> ``{"eagle3": ["training.max_steps=100"]}``: recipe overrides per
    named run of a benchmark. Exits with one ``error:`` line (status 2) naming the flag for a malformed item or an
    unknown run."""
    names = tuple(runs)
    out: dict[str, list[str]] = {}
    for item in items:
        run, sep, override = item.partition(":")
        if not sep or run not in names or "=" not in override:
            print(f"error: {flag} {item!r} must be RUN:key=value with RUN one of {', '.join(names)}", file=sys.stderr)
            raise SystemExit(2)
        out.setdefault(run, []).append(override)
    return out
