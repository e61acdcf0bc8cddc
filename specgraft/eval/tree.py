"""Draft trees: the structure a drafter proposes and the target verifies in one forward.

A draft tree hangs below the *root*, the last accepted token (already emitted, not yet seen by the target). It has
``n`` nodes in topological order (``parents[i] < i``); ``parents[i] == -1`` makes node ``i`` a child of the root.
A chain of ``k`` drafts is the tree ``parents = [-1, 0, 1, ..., k-2]``.

Verification feeds ``[root] + nodes`` (``n + 1`` query rows, row 0 = root, row ``i + 1`` = node ``i``) after a
cached prefix of ``past_len`` tokens. The root sits at position ``past_len`` (depth 0) and node ``i`` at
``past_len + depth(i)`` (children of the root have depth 1). Each row attends to the whole cached prefix and to its
ancestors-or-self among the ``n + 1`` new rows. Row ``r``'s logits are the target's distribution for the children of
that row, so verifying a tree never needs a second forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specgraft.errors import SpecgraftError


@dataclass
class DraftTree:
    """Draft tokens proposed below the root (the last accepted token).

    Attributes:
        tokens: [n] int64 token ids.
        parents: [n] int64 parent node index, ``-1`` for children of the root; ``parents[i] < i``.
        q: [n, V] float probabilities over the FULL target vocabulary, or None. ``q[i]`` is the draft distribution
            node ``i`` was drawn from (the drafter's distribution at ``i``'s parent), so siblings share one row.
            Needed for lossless sampling verification when ``sampled`` is True; optional otherwise (then only used
            for the ``alpha_exact`` statistic).
        sampled: True when each node's token was drawn at random from ``q[i]``, siblings independently (i.i.d.);
            False when tokens are deterministic (argmax / top-k of the draft), whatever ``q`` says. Siblings are tried
            in index order during sampling verification, so deterministic siblings should be sorted best first.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    sampled: bool = False

    @property
    def size(self) -> int:
        """Number of draft nodes (the root is not a node)."""
        return int(self.tokens.shape[0])

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> DraftTree:
        """A tree with no nodes (plain autoregressive decoding)."""
        return cls(tokens=torch.zeros(0, dtype=torch.long, device=device),
                   parents=torch.zeros(0, dtype=torch.long, device=device))

    @classmethod
    def chain(cls, tokens: torch.Tensor | Sequence[int], q: torch.Tensor | None = None,
              sampled: bool = False) -> DraftTree:
        """A chain: every node is the only child of the previous one (the first is a child of the root)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parents = torch.arange(-1, tokens.shape[0] - 1, dtype=torch.long, device=tokens.device)
        return cls(tokens=tokens, parents=parents, q=q, sampled=sampled)

    def validate(self, vocab_size: int, need_q: bool = False) -> None:
        """Raise SpecgraftError unless shapes, parent order, token range and q are consistent."""
        n = self.size
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise SpecgraftError(f"draft tree tokens {tuple(self.tokens.shape)} and parents "
                                 f"{tuple(self.parents.shape)} must both be 1-D of equal length; fix the drafter")
        if n == 0:
            return
        parents = self.parents.tolist()
        if any(not -1 <= p < i for i, p in enumerate(parents)):
            raise SpecgraftError(f"draft tree parents {parents} are not topologically ordered (need -1 <= parents[i] "
                                 "< i); fix the drafter")
        lo, hi = int(self.tokens.min()), int(self.tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise SpecgraftError(f"draft tokens range [{lo}, {hi}] outside the target vocab of {vocab_size}; "
                                 "the drafter must use the target's vocabulary")
        if self.q is not None and tuple(self.q.shape) != (n, vocab_size):
            raise SpecgraftError(f"draft q has shape {tuple(self.q.shape)}, expected ({n}, {vocab_size}) (full "
                                 "target vocab); fix the drafter")
        if need_q and self.sampled:
            if self.q is None:
                raise SpecgraftError("a sampled draft tree needs q for lossless sampling verification; return q from "
                                     "the drafter or mark the tree sampled=False")
            q_tok = self.q.gather(1, self.tokens.unsqueeze(1)).squeeze(1)  # [n]
            if bool((q_tok <= 0).any()):
                raise SpecgraftError("a sampled draft token has q(token) = 0, so it cannot have been drawn from q; "
                                     "fix the drafter")


def depths(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[n] depth of each node: 1 for children of the root, parent's depth + 1 otherwise."""
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    out: list[int] = []
    for p in plist:
        out.append(1 if p < 0 else out[p] + 1)
    device = parents.device if isinstance(parents, torch.Tensor) else None
    return torch.tensor(out, dtype=torch.long, device=device)


def is_chain(parents: torch.Tensor | Sequence[int]) -> bool:
    """True for a chain (``parents == [-1, 0, 1, ...]``), the empty tree included."""
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    return plist == list(range(-1, len(plist) - 1))


def ancestor_matrix(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[n, n] bool: ``A[i, j]`` is True when node ``j`` is node ``i`` or one of its ancestors (root excluded)."""
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    n = len(plist)
    device = parents.device if isinstance(parents, torch.Tensor) else None
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(plist):
        if p >= 0:
            anc[i] |= anc[p]
    return anc.to(device) if device is not None else anc


def children_table(parents: torch.Tensor | Sequence[int]) -> list[list[int]]:
    """``table[r]``: node indices of the children of row ``r`` (row 0 = root, row ``i + 1`` = node ``i``)."""
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    table: list[list[int]] = [[] for _ in range(len(plist) + 1)]
    for i, p in enumerate(plist):
        table[p + 1].append(i)
    return table


def path_to(parents: torch.Tensor | Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (inclusive)."""
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    path = []
    while node >= 0:
        path.append(node)
        node = plist[node]
    return path[::-1]


def leaves(parents: torch.Tensor | Sequence[int]) -> list[int]:
    """Nodes without children."""
    table = children_table(parents)
    return [i for i in range(len(table) - 1) if not table[i + 1]]


def verification_inputs(tree: DraftTree, root_token: int, past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([1, n+1] input ids, [1, n+1] position ids)`` for verifying ``tree`` after ``past_len`` cached tokens."""
    device = tree.tokens.device
    ids = torch.cat([torch.tensor([root_token], dtype=torch.long, device=device), tree.tokens])
    pos = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths(tree.parents).to(device)]) + past_len
    return ids.unsqueeze(0), pos.unsqueeze(0)


def visibility(parents: torch.Tensor | Sequence[int], past_len: int) -> torch.Tensor:
    """[n+1, past_len+n+1] bool: which keys each verification row (root first) may attend to."""
    anc = ancestor_matrix(parents)
    n = anc.shape[0]
    tree_vis = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    tree_vis[:, 0] = True  # everything sees the root
    tree_vis[1:, 1:] = anc
    prefix = torch.ones(n + 1, past_len, dtype=torch.bool)
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
    mask = torch.zeros(vis.shape, dtype=dtype, device=query_positions.device)
    mask.masked_fill_(~vis, torch.finfo(dtype).min)
    return mask.view(1, 1, *vis.shape)


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
    d = depths(tree.parents)
    keep = [i for i, di in enumerate(d.tolist()) if di <= max_depth]
    if len(keep) == tree.size:
        return tree, keep
    remap = {old: new for new, old in enumerate(keep)}
    plist = tree.parents.tolist()
    new_parents = torch.tensor([remap[plist[i]] if plist[i] >= 0 else -1 for i in keep],
                               dtype=torch.long, device=tree.tokens.device)
    idx = torch.tensor(keep, dtype=torch.long, device=tree.tokens.device)
    q = tree.q.index_select(0, idx) if tree.q is not None else None
    return DraftTree(tokens=tree.tokens.index_select(0, idx), parents=new_parents, q=q, sampled=tree.sampled), keep
