"""A typed config (a recipe, a head family's config) as plain data, and the resolved recipe written as YAML beside
every output."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from specgraft.utils.io import atomic_write_text


def to_dict(obj: Any) -> Any:
    """A plain (YAML/JSON-serialisable) copy of a config dataclass; a head family's config keeps its ``type``
    (a class attribute of the family config, not a field)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        head_type = getattr(type(obj), "type", None)
        if isinstance(head_type, str) and "type" not in out:
            out = {"type": head_type, **out}
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def save_recipe(recipe: Any, path: str | Path) -> None:
    """Write the fully resolved recipe as YAML (atomically)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(recipe), sort_keys=False))
