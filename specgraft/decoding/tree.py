"""Draft trees: the structure a drafter proposes and the target verifies in one forward.

A draft tree hangs below the *root*, the last accepted token (already emitted, not yet seen by the target). It has
``n`` nodes in topological order (``parents[i] < i``); ``parents[i] == -1`` makes node ``i`` a child of the root.
A chain of ``k`` drafts is the tree ``parents = [-1, 0, 1, ..., k-2]``.

Verification feeds ``[root] + nodes`` (``n + 1`` query rows, row 0 = root, row ``i + 1`` = node ``i``) after a
cached prefix of ``past_len`` tokens. The root sits at position ``past_len`` (depth 0) and node ``i`` at
``past_len + depth(i)`` (children of the root have depth 1). Each row attends to the whole cached prefix and to its
ancestors-or-self among the ``n + 1`` new rows. Row ``r``'s logits are the target's distribution for the children of
that row, so verifying a tree never needs a second forward.

The shape of a tree (its ``parents``) is summarised once in a :class:`TreeStructure` (depths, children, ancestor
and visibility blocks, per-device index tensors), cached per distinct shape: static trees (chains, Medusa) and
repeated dynamic shapes then cost the decoder no Python walks and no device-to-host reads per step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specgraft.errors import SpecgraftError


class TreeStructure:
    """The host-side summary of a tree shape, with its device tensors built once per device.

    Build it with :func:`tree_structure` (cached per ``parents`` tuple); raises SpecgraftError for parents that are
    not topologically ordered.

    Attributes:
        parents: ``parents[i]`` of each node (-1 = child of the root).
        depths: depth of each node (1 = child of the root).
        children: ``children[r]`` = node indices of the children of row ``r`` (row 0 = root, row ``i + 1`` = node i).
        chain: True for a chain (the empty tree included).
        max_depth: the deepest node's depth (0 for the empty tree).
        row_max_children: ``row_max_children[d]`` = most children of any row at depth ``d`` (``d = 0`` is the root).
    """

    def __init__(self, parents: tuple[int, ...]) -> None:
        if any(not -1 <= p < i for i, p in enumerate(parents)):
            raise SpecgraftError(f"draft tree parents {list(parents)} are not topologically ordered (need -1 <= "
                                 "parents[i] < i); fix the drafter")
        self.parents = parents
        depth_list: list[int] = []
        for p in parents:
            depth_list.append(1 if p < 0 else depth_list[p] + 1)
        self.depths = tuple(depth_list)
        table: list[list[int]] = [[] for _ in range(len(parents) + 1)]
        for i, p in enumerate(parents):
            table[p + 1].append(i)
        self.children = tuple(tuple(c) for c in table)
        self.chain = parents == tuple(range(-1, len(parents) - 1))
        self.max_depth = max(depth_list, default=0)
        row_depths = (0,) + self.depths
        widest = [0] * (self.max_depth + 1)
        for row, kids in enumerate(self.children):
            widest[row_depths[row]] = max(widest[row_depths[row]], len(kids))
        self.row_max_children = tuple(widest)
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}

    @property
    def size(self) -> int:
        return len(self.parents)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive); [] for ``node == -1``."""
        return [*strict_ancestors(self.parents, node)[::-1], node] if node >= 0 else []

    def _cached(self, name: str, device: torch.device | str | None, build) -> torch.Tensor:
        device = torch.device(device if device is not None else "cpu")
        key = (name, device)
        if key not in self._on_device:
            self._on_device[key] = build().to(device)
        return self._on_device[key]

    def ancestors(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n, n] bool: ``A[i, j]`` is True when node ``j`` is node ``i`` or one of its ancestors."""
        def build() -> torch.Tensor:
            anc = torch.eye(self.size, dtype=torch.bool)
            for i, p in enumerate(self.parents):
                if p >= 0:
                    anc[i] |= anc[p]
            return anc
        return self._cached("ancestors", device, build)

    def tree_visibility(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n+1, n+1] bool: which of the ``[root] + nodes`` rows each verification row may attend to."""
        def build() -> torch.Tensor:
            n = self.size
            vis = torch.zeros(n + 1, n + 1, dtype=torch.bool)
            vis[:, 0] = True  # everything sees the root
            vis[1:, 1:] = self.ancestors()
            return vis
        return self._cached("tree_visibility", device, build)

    def row_depths(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n+1] int64 depth of each verification row (0 for the root): position offsets after the prefix."""
        return self._cached("row_depths", device, lambda: torch.tensor((0,) + self.depths, dtype=torch.long))

    def row_paths(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n+1, D+1] int64 verification rows of each row's root-to-row path, root (row 0) first, padded with 0
        after the row itself (row ``r``'s path has ``row_depths()[r] + 1`` entries)."""
        def build() -> torch.Tensor:
            out = torch.zeros(self.size + 1, self.max_depth + 1, dtype=torch.long)
            for node in range(self.size):
                path = [0] + [i + 1 for i in self.path_to(node)]
                out[node + 1, : len(path)] = torch.tensor(path, dtype=torch.long)
            return out
        return self._cached("row_paths", device, build)

    @functools.cached_property
    def rows_by_depth(self) -> tuple[tuple[int, tuple[int, ...], tuple[tuple[int, ...], ...]], ...]:
        """``(depth, rows, paths)`` for each depth present, shallowest first: the verification rows at that depth
        (row 0 = root) and each one's root-to-row path of rows (``depth + 1`` entries, root first). Host-side."""
        by_depth: dict[int, list[int]] = {}
        for row, depth in enumerate((0,) + self.depths):
            by_depth.setdefault(depth, []).append(row)
        return tuple((depth, tuple(rows), tuple(tuple([0] + [i + 1 for i in self.path_to(row - 1)]) for row in rows))
                     for depth, rows in sorted(by_depth.items()))

    def node_depths(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n] int64 depth of each node."""
        return self._cached("node_depths", device, lambda: torch.tensor(self.depths, dtype=torch.long))

    def parent_rows(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n] int64 verification row of each node's parent (``parents + 1``)."""
        return self._cached("parent_rows", device, lambda: torch.tensor(self.parents, dtype=torch.long) + 1)

    def earlier_siblings(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n, n] bool: ``E[i, j]`` is True when ``j < i`` and both nodes share a parent."""
        def build() -> torch.Tensor:
            par = torch.tensor(self.parents, dtype=torch.long)
            idx = torch.arange(self.size)
            return (par.view(-1, 1) == par.view(1, -1)) & (idx.view(1, -1) < idx.view(-1, 1))
        return self._cached("earlier_siblings", device, build)

    def additive_block(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """[n+1, n+1] additive mask among the verification rows: 0 where :meth:`tree_visibility`, else the
        dtype's minimum (the cached part of the tree mask; the prefix columns are all 0)."""
        return self._cached(f"additive_block_{dtype}", device,
                            lambda: additive_from_visible(self.tree_visibility(), dtype))

    def first_children(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n+1] int64 first child of each row (0 for rows without children: callers mask those rows)."""
        return self._cached("first_children", device, lambda: self.children_index()[:, 0].clamp(min=0))

    def children_index(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n+1, C] int64 children of each row, padded with -1 (C = the most children of any row, at least 1)."""
        def build() -> torch.Tensor:
            width = max(max((len(c) for c in self.children), default=0), 1)
            out = torch.full((self.size + 1, width), -1, dtype=torch.long)
            for row, kids in enumerate(self.children):
                if kids:
                    out[row, : len(kids)] = torch.tensor(kids, dtype=torch.long)
            return out
        return self._cached("children_index", device, build)


def strict_ancestors(parents: Sequence[int], node: int) -> list[int]:
    """The ancestors of ``node`` (its parent first, up to a root child; the root, -1, is not listed), given each
    node's parent index (-1 for the root)."""
    chain = []
    node = parents[node] if node >= 0 else -1
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain


def level_visibility(committed: int, past: int, ancestor_slots: Sequence[Sequence[int]],
                     device: torch.device | str | None = None) -> torch.Tensor:
    """[m, past + m] bool visibility of one tree level of ``m`` nodes fed after ``past`` cached slots: row ``r``
    sees the ``committed`` leading slots (the accepted context), the cache slots ``ancestor_slots[r]`` of its
    ancestors fed at earlier levels, and itself (slot ``past + r``). The per-level mask of drafters that grow a
    tree level by level in their own KV cache (EAGLE, a draft model's tree)."""
    m = len(ancestor_slots)
    visible = torch.zeros(m, past + m, dtype=torch.bool, device=device)
    visible[:, :committed] = True
    for row, slots in enumerate(ancestor_slots):
        if len(slots):
            visible[row, list(slots)] = True
        visible[row, past + row] = True
    return visible


def additive_from_visible(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool visibility of any shape -> the additive float mask of the same shape: 0 where visible, the dtype's
    minimum elsewhere (what attention adds to its scores)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


@functools.lru_cache(maxsize=512)
def tree_structure(parents: tuple[int, ...]) -> TreeStructure:
    """The (cached) :class:`TreeStructure` of a ``parents`` tuple."""
    return TreeStructure(parents)


def chain_structure(length: int) -> TreeStructure:
    """The structure of a chain of ``length`` nodes."""
    return tree_structure(tuple(range(-1, length - 1)))


@dataclass
class DraftTree:
    """Draft tokens proposed below the root (the last accepted token).

    Attributes:
        tokens: [n] int64 token ids.
        parents: [n] int64 parent node index, ``-1`` for children of the root; ``parents[i] < i``.
        q: [n, V] float probabilities over the FULL target vocabulary, or None. ``q[i]`` is the draft distribution
            node ``i`` was drawn from (the drafter's distribution at ``i``'s parent), so siblings share one row.
            Needed (and only read) when ``sampled`` is True; deterministic drafts should leave it None, since the
            verifier and the ``alpha_exact`` statistic treat their tokens as point masses.
        sampled: True when each node's token was drawn at random from ``q[i]``, siblings independently (i.i.d.);
            False when tokens are deterministic (argmax / top-k of the draft), whatever ``q`` says. Siblings are tried
            in index order during sampling verification, so deterministic siblings should be sorted best first.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    sampled: bool = False
    #: the shape's :class:`TreeStructure` when the drafter knows it (saves the decoder one read of ``parents``).
    structure: TreeStructure | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        """Number of draft nodes (the root is not a node)."""
        return int(self.tokens.shape[0])

    def get_structure(self) -> TreeStructure:
        """The tree's :class:`TreeStructure` (read from ``parents`` once, then kept)."""
        if self.structure is None or self.structure.size != self.size:
            self.structure = tree_structure(tuple(int(p) for p in self.parents.tolist()))
        return self.structure

    @classmethod
    def from_lists(cls, tokens: Sequence[int], parents: Sequence[int], q: torch.Tensor | None = None,
                   sampled: bool = False, device: torch.device | str | None = None) -> DraftTree:
        """A tree from host-side token and parent lists (its structure is known without reading ``parents``)."""
        structure = tree_structure(tuple(int(p) for p in parents))
        return cls(tokens=torch.tensor(list(tokens), dtype=torch.long, device=device),
                   parents=structure.parent_rows(device) - 1, q=q, sampled=sampled, structure=structure)

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> DraftTree:
        """A tree with no nodes (plain autoregressive decoding)."""
        return cls(tokens=torch.zeros(0, dtype=torch.long, device=device),
                   parents=torch.zeros(0, dtype=torch.long, device=device), structure=chain_structure(0))

    @classmethod
    def chain(cls, tokens: torch.Tensor | Sequence[int], q: torch.Tensor | None = None,
              sampled: bool = False) -> DraftTree:
        """A chain: every node is the only child of the previous one (the first is a child of the root)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        structure = chain_structure(int(tokens.shape[0]))
        return cls(tokens=tokens, parents=structure.parent_rows(tokens.device) - 1, q=q, sampled=sampled,
                   structure=structure)

    def check_shapes(self, vocab_size: int, need_q: bool = False) -> None:
        """The checks that need no device read: shapes, the structure's parent order, q's presence and shape."""
        n = self.size
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise SpecgraftError(f"draft tree tokens {tuple(self.tokens.shape)} and parents "
                                 f"{tuple(self.parents.shape)} must both be 1-D of equal length; fix the drafter")
        if n == 0:
            return
        self.get_structure()
        if self.q is not None and tuple(self.q.shape) != (n, vocab_size):
            raise SpecgraftError(f"draft q has shape {tuple(self.q.shape)}, expected ({n}, {vocab_size}) (full "
                                 "target vocab); fix the drafter")
        if need_q and self.sampled and self.q is None:
            raise SpecgraftError("a sampled draft tree needs q for lossless sampling verification; return q from "
                                 "the drafter or mark the tree sampled=False")

    def problems(self, vocab_size: int, need_q: bool = False) -> torch.Tensor:
        """[2] int64 on the tree's device, no host read: (any token outside the vocab, any sampled token with
        q(token) = 0 when ``need_q``). The decoder reads it with the step's verdict and raises then."""
        safe = self.tokens.clamp(0, vocab_size - 1)
        bad_range = (safe != self.tokens).any()
        if not (need_q and self.sampled and self.q is not None and self.size):
            return torch.stack([bad_range, torch.zeros_like(bad_range)]).long()
        bad_q = (self.q.gather(1, safe.unsqueeze(1)).squeeze(1) <= 0).any()
        return torch.stack([bad_range, bad_q]).long()

    def raise_problems(self, vocab_size: int, flags: Sequence[int]) -> None:
        """Raise the SpecgraftError that :meth:`problems` flagged (reads the tree again; error path only)."""
        if flags[0]:
            lo, hi = int(self.tokens.min()), int(self.tokens.max())
            raise SpecgraftError(f"draft tokens range [{lo}, {hi}] outside the target vocab of {vocab_size}; "
                                 "the drafter must use the target's vocabulary")
        if flags[1]:
            raise SpecgraftError("a sampled draft token has q(token) = 0, so it cannot have been drawn from q; "
                                 "fix the drafter")

    def validate(self, vocab_size: int, need_q: bool = False) -> None:
        """Raise SpecgraftError unless shapes, parent order, token range and q are consistent (reads the device;
        the decoder uses :meth:`check_shapes` and :meth:`problems` instead, which defer the read)."""
        self.check_shapes(vocab_size, need_q)
        if self.size:
            self.raise_problems(vocab_size, self.problems(vocab_size, need_q).tolist())


def _structure(parents: torch.Tensor | Sequence[int] | TreeStructure) -> TreeStructure:
    if isinstance(parents, TreeStructure):
        return parents
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    return tree_structure(tuple(int(p) for p in plist))


def _device_of(parents: torch.Tensor | Sequence[int] | TreeStructure) -> torch.device | None:
    return parents.device if isinstance(parents, torch.Tensor) else None


def depths(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[n] depth of each node: 1 for children of the root, parent's depth + 1 otherwise."""
    return _structure(parents).node_depths(_device_of(parents)).clone()


def is_chain(parents: torch.Tensor | Sequence[int]) -> bool:
    """True for a chain (``parents == [-1, 0, 1, ...]``), the empty tree included."""
    return _structure(parents).chain


def ancestor_matrix(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[n, n] bool: ``A[i, j]`` is True when node ``j`` is node ``i`` or one of its ancestors (root excluded)."""
    return _structure(parents).ancestors(_device_of(parents)).clone()


def children_table(parents: torch.Tensor | Sequence[int]) -> list[list[int]]:
    """``table[r]``: node indices of the children of row ``r`` (row 0 = root, row ``i + 1`` = node ``i``)."""
    return [list(c) for c in _structure(parents).children]


def path_to(parents: torch.Tensor | Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (inclusive)."""
    return _structure(parents).path_to(node)


def leaves(parents: torch.Tensor | Sequence[int]) -> list[int]:
    """Nodes without children."""
    table = children_table(parents)
    return [i for i in range(len(table) - 1) if not table[i + 1]]


def verification_inputs(tree: DraftTree, root_token: int, past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([1, n+1] input ids, [1, n+1] position ids)`` for verifying ``tree`` after ``past_len`` cached tokens."""
    device = tree.tokens.device
    ids = torch.cat([torch.tensor([root_token], dtype=torch.long, device=device), tree.tokens])
    pos = tree.get_structure().row_depths(device) + past_len
    return ids.unsqueeze(0), pos.unsqueeze(0)


def visibility(parents: torch.Tensor | Sequence[int] | TreeStructure, past_len: int,
               device: torch.device | str | None = None) -> torch.Tensor:
    """[n+1, past_len+n+1] bool: which keys each verification row (root first) may attend to."""
    tree_vis = _structure(parents).tree_visibility(device)
    prefix = torch.ones(tree_vis.shape[0], past_len, dtype=torch.bool, device=tree_vis.device)
    return torch.cat([prefix, tree_vis], dim=1)


def additive_mask(
    visible: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """A [1, 1, q, kv] additive float mask: 0 where visible, the dtype's minimum elsewhere.

    Args:
        visible: [q, kv] bool structural visibility (prefix, ancestors, causality).
        query_positions: [q] absolute position of each query row.
        key_positions: [kv] absolute position of each key column.
        sliding_window: when given, a query at position ``t`` additionally sees only keys at positions
            ``> t - sliding_window`` (the convention of transformers' ``sliding_window_overlay``).
    """
    vis = visible.to(query_positions.device)
    if sliding_window is not None:
        dist = query_positions.view(-1, 1) - key_positions.view(1, -1)  # [q, kv]
        vis = vis & (dist < sliding_window)
    return additive_from_visible(vis, dtype).view(1, 1, *vis.shape)


def tree_attention_mask(
    parents: torch.Tensor | Sequence[int],
    past_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The [1, 1, n+1, past_len+n+1] additive verification mask for ``[root] + nodes`` after ``past_len`` tokens."""
    vis = visibility(parents, past_len).to(device)
    depth = torch.cat([torch.zeros(1, dtype=torch.long), depths(parents).cpu()]).to(device)
    qpos = depth + past_len
    kpos = torch.cat([torch.arange(past_len, device=device), qpos])
    return additive_mask(vis, qpos, kpos, dtype, sliding_window)


def prune_to_depth(tree: DraftTree, max_depth: int) -> tuple[DraftTree, list[int]]:
    """Drop nodes deeper than ``max_depth``; returns the pruned tree and the kept original node indices."""
    if tree.size == 0:
        return tree, []
    structure = tree.get_structure()
    if structure.max_depth <= max_depth:
        return tree, list(range(tree.size))
    keep = [i for i, di in enumerate(structure.depths) if di <= max_depth]
    remap = {old: new for new, old in enumerate(keep)}
    new_parents = [remap[structure.parents[i]] if structure.parents[i] >= 0 else -1 for i in keep]
    idx = torch.tensor(keep, dtype=torch.long, device=tree.tokens.device)
    q = tree.q.index_select(0, idx) if tree.q is not None else None
    new_structure = tree_structure(tuple(new_parents))
    return DraftTree(tokens=tree.tokens.index_select(0, idx), parents=new_structure.parent_rows(idx.device) - 1,
                     q=q, sampled=tree.sampled, structure=new_structure), keep
