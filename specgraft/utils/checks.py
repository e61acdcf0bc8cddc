"""The range and choice checks every typed config (recipes, head families' configs) validates its fields with: one
:class:`~specgraft.errors.ConfigError` line naming the dotted path of the field, the allowed values and the value."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence

from specgraft.errors import ConfigError

#: Largest output_hidden_states index a recipe may name (the deepest open models have a few hundred layers).
MAX_LAYER_INDEX = 4096


def check_choice(path: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), list(choices), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path} must be one of {', '.join(choices)}, got {value!r}{hint}")


def check_positive(path: str, value: int | float) -> None:
    if not value > 0:  # also false for NaN
        raise ConfigError(f"{path} must be positive, got {value}")


def check_range(path: str, value: float, low: float | None, high: float | None,
                 low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite number, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ConfigError(f"{path} must be in {interval}, got {value}")
