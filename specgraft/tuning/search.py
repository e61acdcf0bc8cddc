"""What a head family's `specgraft tune` search is built from, besides :mod:`specgraft.decoding.acceptance`.

Part of eval's public protocol for head families (like the drafter, tree and acceptance modules): a family's
``tune.py`` reads its cost-profile section and the profile's measured token counts through these helpers and
never imports the profiler itself. The profile is passed in by the tuner (any object with ``step_s``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specgraft.errors import SpecgraftError

if TYPE_CHECKING:  # annotations only: the profiler is not part of the protocol
    from specgraft.tuning.cost import CostProfile

#: Largest tree (tokens verified, root included) the tuner considers.
MAX_TREE_TOKENS = 64


def max_verified_tokens(profile: CostProfile, limit: int = MAX_TREE_TOKENS) -> int:
    """The largest verification the profile measured (trees are not extrapolated), at most ``limit``."""
    return min(limit, max(profile.step_s["chain"]), max(profile.step_s.get("tree") or {0: 0}) or limit)


def section_table(section: Mapping[str, Any], name: str) -> dict[str, float]:
    """A drafter section's cost table ``name`` (e.g. ``chain_s``), its values as floats; one error line when the
    profile lacks it."""
    table = section.get(name)
    if not table:
        raise SpecgraftError(f"the cost profile's {section.get('kind')} drafter has no {name!r} table; re-run "
                             "`specgraft profile` with this version")
    return {str(k): float(v) for k, v in table.items()}


def monotone(table: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing curve (pool-adjacent-violators): verifying more tokens never costs less, so a
    dip is timing noise, and pooling it with its neighbours averages that noise out."""
    keys = sorted(table)
    blocks: list[list[float]] = []  # [sum, count] per pooled block
    for k in keys:
        blocks.append([table[k], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(keys, values))
