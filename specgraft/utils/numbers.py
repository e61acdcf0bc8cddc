"""Numbers read from files, checked where they are read: one line naming the file, the field and the fix.

A JSON file may hold ``NaN``/``Infinity`` literals (Python writes them), strings where numbers belong, or negative
and zero costs; any of them turns into "nan tokens/s", a negative speed or a ZeroDivisionError far from the file.
The readers of each file type (:class:`~specgraft.tuning.cost.CostProfile`, ``tuned.json``, eval reports) check
their numbers with these helpers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from specgraft.errors import SpecgraftError


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(value: Any, where: str, fix: str, *, low: float = 0.0, low_open: bool = False,
                 high: float | None = None) -> float:
    """``value`` as a float when it is a finite number in [low, high] (``low_open``: (low, high]); else one
    :class:`SpecgraftError` line naming ``where`` and ending with ``fix``."""
    if not is_number(value):
        raise SpecgraftError(f"{where} is {value!r}, not a number; {fix}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or (high is not None and number > high):
        bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise SpecgraftError(f"{where} is {value!r}; it must be a finite number {bound}; {fix}")
    return number


def check_number_tree(tree: Any, where: str, fix: str, *, low: float = 0.0, low_open: bool = False,
                      high: float | None = None, allow_null: bool = False) -> None:
    """Every leaf of nested objects/lists ``tree`` passes :func:`check_number` (nulls when ``allow_null``);
    ``where`` names the root (a leaf is named ``where.key[i]``)."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            check_number_tree(value, f"{where}.{key}", fix, low=low, low_open=low_open, high=high,
                              allow_null=allow_null)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            check_number_tree(value, f"{where}[{i}]", fix, low=low, low_open=low_open, high=high,
                              allow_null=allow_null)
    elif not (allow_null and tree is None):
        check_number(tree, where, fix, low=low, low_open=low_open, high=high)


def check_finite_leaves(tree: Any, where: str, fix: str) -> None:
    """Every number among the leaves of ``tree`` is finite (strings, bools and nulls are left alone)."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            check_finite_leaves(value, f"{where}.{key}", fix)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            check_finite_leaves(value, f"{where}[{i}]", fix)
    elif is_number(tree) and not math.isfinite(float(tree)):
        raise SpecgraftError(f"{where} is {tree!r}; it must be a finite number; {fix}")
