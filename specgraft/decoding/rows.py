"""The row-layout protocol of row-exact verification, which the decoder speaks and an attention kernel implements.

A model switched to :data:`~specgraft.decoding.kv.EXACT_ATTENTION` (by :mod:`specgraft.kernels.exact_attention`)
verifies a tree so that every row attends to its own keys in logical order, by the very call one-token decoding
makes. The decoder passes each verification forward a :class:`RowKeys` under :data:`ROWS_KWARG` and runs it inside
:func:`rows_one_at_a_time`; which modules compute row by row is the kernel's business (it marks them with
:data:`ROW_BY_ROW_FLAG`). The decoder knows nothing else of the kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specgraft.decoding.kv import EXACT_ATTENTION
from specgraft.decoding.tree import tree_structure
from specgraft.errors import SpecgraftError

ROWS_KWARG = "specgraft_rows"
"""The keyword the decoder passes a :class:`RowKeys` under; transformers forwards it to every attention call."""


@dataclass(frozen=True)
class RowGroup:
    """Verification rows that see the same number of keys (one depth of the tree).

    Attributes:
        rows: [g] int64 row indices within the forward.
        first_row: ``rows[0]`` on the host.
        length: keys each row sees (the cached prefix, then its root-to-row path).
        keys: [g * length] int64 cache positions of each row's keys in logical order, rows one after another; None
            when the group is one row whose keys are the first ``length`` cache positions (a chain's rows).
    """

    rows: torch.Tensor
    first_row: int
    length: int
    keys: torch.Tensor | None


@dataclass(frozen=True)
class RowKeys:
    """Which cached keys each query row of one forward attends to: its ``groups`` by depth after ``past`` cached
    positions (``size`` rows in all). Built once per forward, used by every layer."""

    past: int
    size: int
    groups: tuple[RowGroup, ...]


def row_keys(past: int, structure: Any, device: torch.device | str | None = None) -> RowKeys:
    """The :class:`RowKeys` of a verification of ``structure`` (a :class:`~specgraft.decoding.tree.TreeStructure`: the
    root row, then its nodes) after ``past`` cached positions."""
    if past < 0:
        raise SpecgraftError(f"past length {past} is negative")
    groups = []
    prefix = None
    for depth, rows, paths in structure.rows_by_depth:
        length = past + depth + 1
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        if len(rows) == 1 and paths[0] == tuple(range(depth + 1)):
            groups.append(RowGroup(rows=rows_t, first_row=rows[0], length=length, keys=None))
            continue
        if prefix is None:
            prefix = torch.arange(past, device=device)
        path_slots = past + torch.tensor(paths, dtype=torch.long, device=device)  # [g, depth + 1]
        keys = torch.cat([prefix.expand(len(rows), past), path_slots], dim=1).reshape(-1)
        groups.append(RowGroup(rows=rows_t, first_row=rows[0], length=length, keys=keys))
    return RowKeys(past=past, size=structure.size + 1, groups=tuple(groups))


def chain_row_keys(past: int, length: int, device: torch.device | str | None = None) -> RowKeys:
    """:func:`row_keys` for ``length`` rows that form a causal chain (row ``i`` sees rows ``0..i``)."""
    return row_keys(past, tree_structure(tuple(range(-1, length - 2))), device)


ROW_BY_ROW_FLAG = "specgraft_row_by_row"
"""Instance attribute of a switched activation or rotary-embedding module: True while a verification forward runs
(:func:`rows_one_at_a_time`), when the module computes its rows one call each."""


def uses_exact_attention(model: Any) -> bool:
    """True when ``model`` runs :data:`EXACT_ATTENTION` (the decoder then passes row layouts)."""
    return getattr(model.config, "_attn_implementation", None) == EXACT_ATTENTION


@contextlib.contextmanager
def rows_one_at_a_time(model: Any) -> Iterator[None]:
    """While a verification forward of ``model`` runs, its switched modules compute row by row."""
    switched = [m for m in model.modules() if hasattr(m, ROW_BY_ROW_FLAG)]
    for module in switched:
        setattr(module, ROW_BY_ROW_FLAG, True)
    try:
        yield
    finally:
        for module in switched:
            setattr(module, ROW_BY_ROW_FLAG, False)
