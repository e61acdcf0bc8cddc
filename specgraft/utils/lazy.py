"""Package attributes resolved on first use (PEP 562), so importing a package does not import its heavy modules.

``specgraft --help`` imports the package of every subcommand; a package ``__init__`` that re-exported its modules'
names eagerly would pull torch and transformers into every start. ``lazy_exports`` keeps the same public names
(``from specgraft.data import build_dataset`` still works) and imports the defining module when a name is read."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to the submodule (relative to
    the package) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
