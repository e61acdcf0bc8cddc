"""argparse value types shared by the subcommands."""

from __future__ import annotations

import argparse

#: Floating dtype names accepted by recipes and CLIs (:data:`specgraft.utils.models.DTYPES` maps them to torch).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def int_list(text: str) -> list[int]:
    """``"2,2,4"`` -> ``[2, 2, 4]``; an argparse type (a bad value is one usage error)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def float_list(text: str) -> list[float]:
    """``"0.8,0.6"`` -> ``[0.8, 0.6]``; an argparse type (a bad value is one usage error)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values
