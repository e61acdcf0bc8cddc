"""Which export formats hold which head family: the registered families' exporters, looked up by name.

The layout tables themselves (:class:`~specgraft.export.layouts.TensorRule`) are the families' own
(``specgraft/heads/<family>/export.py``); this module is the lookup above them.
"""

from __future__ import annotations

from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.export.layouts import Dims, expand_rules
from specgraft.export.options import FORMATS
from specgraft.heads.registry import family_names, get_family


def expected_tensors(head_type: str, fmt: str, dims: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype kind) of every tensor the engine loads for ``dims`` (the family's layout table)."""
    return expand_rules(engine_exporter(head_type, fmt).layout, dims)


def engine_exporter(head_type: str, fmt: str) -> Any:
    """The registered :class:`~specgraft.heads.registry.EngineExporter` of ``head_type`` for ``fmt`` (refused,
    naming the formats that can, when the format cannot hold the family)."""
    if fmt not in FORMATS:
        raise SpecgraftError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    family = get_family(head_type)
    if fmt not in family.exporters:
        raise SpecgraftError(f"the {fmt} format cannot hold a {head_type} head; export it as one of "
                             f"{', '.join(family.formats)}")
    return family.exporters[fmt]


def formats_for(head_type: str) -> tuple[str, ...]:
    """The formats that can hold ``head_type`` (native holds every family)."""
    return get_family(head_type).formats


def supported_formats() -> dict[str, tuple[str, ...]]:
    """Every registered family -> the formats that hold it."""
    return {name: formats_for(name) for name in family_names()}


def require_supported(head_type: str, fmt: str) -> None:
    """Refuse a (head type, format) pair the format cannot hold, naming the formats that can."""
    if fmt != "native":
        engine_exporter(head_type, fmt)
    elif fmt not in FORMATS:
        raise SpecgraftError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
