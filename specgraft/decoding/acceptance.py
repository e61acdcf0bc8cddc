"""Acceptance statistics that predict: reach rates, per-(depth, rank) acceptance, and the optimal static tree.

Two kinds of numbers come out of a calibration eval:

* **Reach rates** ``reach[d] = depth_accepted[d] / steps``: the unconditional probability that the accepted path
  reaches depth ``d``. The expected accepted length is exactly ``sum_d reach[d]`` for the setting that was
  measured (tau = 1 + sum), and for a *chain* truncated to ``k <= depth`` tokens it is ``sum_{d<=k} reach[d]``
  (greedy verification of a shorter chain accepts ``min(accepted, k)``). The per-depth *conditional* rates
  (``accepted[d] / attempted[d]``) do not multiply back to tau for a tree: a path that ends on a leaf is never
  attempted deeper, so their product overstates the reach.
* **Rank statistics** ``p[d][r]``: the probability that the rank-``r`` child (siblings in best-first order) of a
  node on the accepted path at depth ``d - 1`` is accepted, given that the node has such a child. An
  :class:`AcceptanceRecorder` in a tree drafter counts them from each verdict; for a static (Medusa) tree it also
  counts how often each node was on the accepted path (per-node reach).

Under the independence assumption (a child's acceptance depends only on its depth and rank) a tree's expected
accepted length is ``sum over nodes of prod p[d][r]`` along the node's path, and :func:`optimal_tree` finds the
tree of ``n`` nodes that maximises it by dynamic programming over subtree sizes (Sequoia, Chen et al. 2024).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specgraft.errors import SpecgraftError

#: Parent counts below which a (depth, rank) rate is considered unmeasured and falls back to the prior.
MIN_RANK_ATTEMPTS = 5


# -- reach rates -------------------------------------------------------------------------------------------------
def reach_rates(depth_accepted: Sequence[int], steps: int) -> list[float]:
    """``depth_accepted[d] / steps`` per depth (index 0 = depth 1): P(the accepted path reaches depth d)."""
    if steps <= 0:
        return []
    if any(int(a) < 0 or int(a) > steps for a in depth_accepted):
        raise SpecgraftError(f"depth_accepted {list(depth_accepted)} must be counts between 0 and steps ({steps})")
    return [int(a) / steps for a in depth_accepted]


def expected_accepted_from_reach(reach: Sequence[float], depth: int | None = None) -> float:
    """Expected accepted drafts per step: ``sum_{d <= depth} reach[d]`` (exact for the measured setting and for
    a chain truncated to ``depth``)."""
    rates = list(reach) if depth is None else list(reach)[:depth]
    return float(sum(rates))


# -- recording -----------------------------------------------------------------------------------------------------
@dataclass
class AcceptanceRecorder:
    """Counts, from each verdict of a tree drafter, acceptance by (depth, rank) and, for a static tree, per node.

    ``attempts[d-1][r]`` counts verdicts in which the node at depth ``d - 1`` of the accepted path had a rank-``r``
    child; ``accepts[d-1][r]`` those in which that child was accepted. Ranks are positions among siblings in the
    order the tree lists them (best first, as the drafters build them) unless explicit ``ranks`` are given.
    Only verdicts that reach :meth:`record` count: the drafters call it from ``accept``, which the decoder skips on
    a generation's last step.
    """

    static_paths: list[list[int]] | None = None
    verdicts: int = 0
    attempts: list[list[int]] = field(default_factory=list)
    accepts: list[list[int]] = field(default_factory=list)
    node_accepted: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.verdicts = 0
        self.attempts, self.accepts = [], []
        self.node_accepted = [0] * len(self.static_paths or [])

    def _bump(self, table: list[list[int]], depth: int, rank: int) -> None:
        while len(table) < depth:
            table.append([])
        row = table[depth - 1]
        while len(row) <= rank:
            row.append(0)
        row[rank] += 1

    def record(self, parents: Sequence[int], accepted: Sequence[int], ranks: Sequence[int] | None = None) -> None:
        """One verdict: ``parents[i]`` of each node (-1 = root), the accepted nodes root to leaf."""
        self.verdicts += 1
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(int(parent), []).append(node)
        path = [-1] + [int(a) for a in accepted]
        for depth, node in enumerate(path, start=1):
            kids = children.get(node, [])
            taken = path[depth] if depth < len(path) else None
            for position, child in enumerate(kids):
                rank = int(ranks[child]) if ranks is not None else position
                self._bump(self.attempts, depth, rank)
                if child == taken:
                    self._bump(self.accepts, depth, rank)
        if self.static_paths is not None:
            if len(self.node_accepted) < len(self.static_paths):
                self.node_accepted = [0] * len(self.static_paths)
            for node in accepted:
                self.node_accepted[int(node)] += 1

    def to_dict(self) -> dict[str, Any]:
        """What report.json stores under ``acceptance_statistics``."""
        out: dict[str, Any] = {"verdicts": self.verdicts, "rank_attempts": self.attempts,
                               "rank_accepts": self.accepts}
        if self.static_paths is not None:
            out["static_tree_paths"] = self.static_paths
            out["node_accepted"] = self.node_accepted
            out["node_reach"] = [a / self.verdicts if self.verdicts else None for a in self.node_accepted]
        return out


def calibration_probabilities(calibration: Mapping[str, Any]) -> list[list[float]]:
    """``p[d][r]`` of a tuner's calibration numbers (``statistics``: the eval report's ``acceptance_statistics``;
    ``prior``: a family's prior for cells never tried, optional); one error line when the report has none."""
    if not calibration.get("statistics"):
        raise SpecgraftError("the calibration report has no acceptance_statistics (per depth and rank); re-run "
                             "`specgraft eval` with this version for the head")
    return rank_probabilities(calibration["statistics"], prior=calibration.get("prior"))


def rank_probabilities(stats: dict[str, Any], prior: Sequence[Sequence[float]] | None = None,
                       min_attempts: int = MIN_RANK_ATTEMPTS) -> list[list[float]]:
    """``p[d][r]`` from recorded ``acceptance_statistics``; cells with fewer than ``min_attempts`` attempts take
    the prior's value (0 without a prior). The result has the prior's shape when it is larger."""
    try:
        attempts, accepts = stats["rank_attempts"], stats["rank_accepts"]
    except (KeyError, TypeError):
        raise SpecgraftError("the calibration report has no acceptance_statistics.rank_attempts/rank_accepts; "
                             "re-run `specgraft eval` with this version to record them") from None
    depth = max(len(attempts), len(prior or []))
    probs: list[list[float]] = []
    for d in range(depth):
        tried = attempts[d] if d < len(attempts) else []
        hit = accepts[d] if d < len(accepts) else []
        width = max(len(tried), len(prior[d]) if prior is not None and d < len(prior) else 0)
        row = []
        for r in range(width):
            t = tried[r] if r < len(tried) else 0
            if t >= min_attempts:
                row.append((hit[r] if r < len(hit) else 0) / t)
            elif prior is not None and d < len(prior) and r < len(prior[d]):
                row.append(float(prior[d][r]))
            else:
                row.append(0.0)
        probs.append(row)
    return probs


# -- the optimal tree ----------------------------------------------------------------------------------------------
def tree_value(paths: Sequence[Sequence[int]], probs: Sequence[Sequence[float]]) -> float:
    """Expected accepted drafts of the tree whose nodes are rank paths: ``sum_paths prod p[d][r]``."""
    total = 0.0
    for path in paths:
        value = 1.0
        for d, r in enumerate(path):
            value *= probs[d][r] if d < len(probs) and r < len(probs[d]) else 0.0
        total += value
    return total


def optimal_tree(probs: Sequence[Sequence[float]], num_nodes: int, max_depth: int | None = None,
                 max_rank: int | None = None) -> tuple[float, list[tuple[int, ...]]]:
    """The tree of at most ``num_nodes`` nodes maximising the expected accepted drafts, and that value.

    Dynamic program over (depth, first rank considered, nodes left): a subtree below a node at depth ``d - 1``
    spends ``m`` nodes on its rank-``r`` child (the child and ``m - 1`` descendants) and the rest on ranks
    ``> r``; the child contributes ``p[d][r] * (1 + best subtree of m - 1 nodes below it)``.

    Args:
        probs: ``p[d][r]`` for depths 1..D (index 0 = depth 1), ranks best first.
        num_nodes: the node budget (root not counted).
        max_depth: the deepest level (default: ``len(probs)``).
        max_rank: only ranks ``< max_rank`` (default: every measured rank).

    Returns:
        (expected accepted drafts, rank paths of the chosen tree in breadth-first order).
    """
    if int(num_nodes) != num_nodes or num_nodes < 0:
        raise SpecgraftError(f"tree size must be a non-negative integer, got {num_nodes}")
    depth_limit = len(probs) if max_depth is None else min(int(max_depth), len(probs))
    table = [list(row)[: max_rank if max_rank is not None else None] for row in probs[:depth_limit]]

    @functools.cache
    def best(depth: int, rank: int, budget: int) -> tuple[float, tuple[tuple[int, int], ...]]:
        # Best value of children of rank >= `rank` at `depth` (1-based) with `budget` nodes;
        # the plan lists (rank, nodes spent on that child's subtree).
        if budget == 0 or depth > len(table) or rank >= len(table[depth - 1]):
            return 0.0, ()
        skip_value, skip_plan = best(depth, rank + 1, budget)
        chosen = (skip_value, skip_plan)
        p = table[depth - 1][rank]
        if p > 0.0:
            for spent in range(1, budget + 1):
                below, _ = best(depth + 1, 0, spent - 1)
                rest, rest_plan = best(depth, rank + 1, budget - spent)
                value = p * (1.0 + below) + rest
                if value > chosen[0] + 1e-15:
                    chosen = (value, ((rank, spent),) + rest_plan)
        return chosen

    def expand(depth: int, prefix: tuple[int, ...], budget: int, out: list[tuple[int, ...]]) -> None:
        _, plan = best(depth, 0, budget)
        for rank, spent in plan:
            path = prefix + (rank,)
            out.append(path)
            expand(depth + 1, path, spent - 1, out)

    value, _ = best(1, 0, int(num_nodes))
    paths: list[tuple[int, ...]] = []
    expand(1, (), int(num_nodes), paths)
    paths.sort(key=lambda p: (len(p), p))
    return value, paths
