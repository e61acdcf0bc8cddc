"""Verification of draft trees against the target: pure functions, no model.

* :func:`process_logits` turns target (or draft) logits into the sampling distribution: temperature, then top-k,
  then top-p, the order transformers' ``generate`` applies them. Plain sampling and speculative sampling both draw
  from exactly this distribution, so their outputs are identically distributed.
* :func:`verify_greedy`: accept the child equal to the target's argmax, level by level; the bonus is the argmax
  at the last accepted node.
* :func:`verify_sampling`: lossless recursive rejection sampling over a tree, vectorised over a batch of
  independent trials (the decoder uses a batch of one; the statistical tests use 10^5).

  - Sampled (i.i.d.) siblings, each drawn from its ``q``: accept ``x`` with probability ``min(1, p(x) / q(x))``;
    on rejection ``p <- norm(max(0, p - q))`` and try the next sibling (SpecInfer's multi-step speculative sampling;
    for a chain this is Leviathan et al. / Chen et al. 2023).
  - Deterministic siblings (argmax, top-k: q is a point mass): accept ``x`` with probability ``p(x)``; on rejection
    set ``p(x) = 0``, renormalise, try the next sibling.
  - When every child of the current node is rejected, the bonus token is drawn from the current residual ``p``;
    when the node has no children, from its unmodified ``p``.

Both rules emit each token with exactly the target's (processed) distribution given the emitted prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specgraft.decoding.tree import TreeStructure, tree_structure
from specgraft.errors import SpecgraftError


@dataclass(frozen=True)
class SamplingParams:
    """Target-side sampling settings. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_sampling_params(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_sampling_params(temperature: float, top_k: int, top_p: float) -> None:
    """Raise SpecgraftError for settings outside their domain."""
    if not temperature >= 0.0:  # also rejects NaN
        raise SpecgraftError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise SpecgraftError(f"top_k must be a non-negative integer (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise SpecgraftError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities of the token actually sampled.

    Greedy (``temperature == 0``) returns the one-hot distribution of the argmax (first index on exact ties, as
    ``torch.argmax``). Otherwise: divide by the temperature, keep the ``top_k`` largest logits, then keep the
    smallest set of most probable tokens whose mass reaches ``top_p`` (at least one token), renormalise.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of strictly better-ranked tokens
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def verify_greedy(parents: torch.Tensor | Sequence[int], tokens: torch.Tensor | Sequence[int],
                  target_argmax: torch.Tensor | Sequence[int]) -> tuple[list[int], int]:
    """Greedy verification.

    Args:
        parents: [n] node parents (-1 = root).
        tokens: [n] node tokens.
        target_argmax: [n+1] target argmax per verification row (row 0 = root, row i+1 = node i).

    Returns:
        (accepted node indices root-to-leaf, bonus token = target argmax at the last accepted row).
    """
    table = _as_structure(parents).children
    toks = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    best = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else list(target_argmax)
    accepted: list[int] = []
    row = 0
    while True:
        want = best[row]
        nxt = next((c for c in table[row] if toks[c] == want), None)
        if nxt is None:
            return accepted, int(want)
        accepted.append(nxt)
        row = nxt + 1


def _as_structure(parents: torch.Tensor | Sequence[int] | TreeStructure) -> TreeStructure:
    if isinstance(parents, TreeStructure):
        return parents
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    return tree_structure(tuple(int(p) for p in plist))


def greedy_verdict(structure: TreeStructure, tokens: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """Greedy verification on the device, without a host read: the same path as :func:`verify_greedy`.

    Args:
        structure: the tree's shape.
        tokens: [n] node tokens.
        target_argmax: [n+1] target argmax per verification row.

    Returns:
        [2] int64 ``(last accepted node or -1, bonus token)``; the accepted path is
        ``structure.path_to(last)``.
    """
    n = structure.size
    if n == 0:
        return torch.stack([torch.full_like(target_argmax[0], -1), target_argmax[0]])
    device = tokens.device
    if structure.chain:
        # A chain: the accepted length is the run of leading matches.
        accepted = (tokens == target_argmax[:-1]).cumprod(0).sum()
        return torch.stack([accepted - 1, target_argmax[accepted]])
    match = tokens == target_argmax.index_select(0, structure.parent_rows(device))  # [n]
    # Only the first matching sibling counts (verify_greedy takes the first child equal to the argmax).
    match = match & ~(structure.earlier_siblings(device) & match.unsqueeze(0)).any(1)
    on_path = ~(structure.ancestors(device) & ~match.unsqueeze(0)).any(1)  # [n]: every ancestor-or-self matched
    # At most one node per depth is on the path: the deepest one is the path's end.
    score = torch.where(on_path, structure.node_depths(device), 0)
    last = torch.where(score.max() > 0, score.argmax(), -1)
    bonus = target_argmax[last + 1]
    return torch.stack([last, bonus])


@dataclass
class SamplingVerdict:
    """Outcome of :func:`verify_sampling` for a batch of B independent trials (D = tree depth).

    Attributes:
        path: [B, D] accepted node indices root-to-leaf, padded with -1.
        num_accepted: [B] number of accepted nodes.
        bonus: [B] the extra token sampled after the accepted path.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor


def _acceptance_prob(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for a sampled draft token x (q_x > 0 is guaranteed by the caller)."""
    return (p_x / q_x).clamp(max=1.0)


def _iid_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[B, V] unnormalised residual after rejecting a token drawn from q: max(0, p - q)."""
    return (p - q).clamp(min=0.0)


def _point_residual(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B, V] unnormalised residual after rejecting a deterministic draft token x: p with p(x) set to 0."""
    return p.scatter(1, x.unsqueeze(1), 0.0)


def _renormalise(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Normalise rows of ``residual``; rows with no mass left (only reachable through float rounding, since a
    rejection then has probability 0) fall back to ``fallback``."""
    total = residual.sum(-1, keepdim=True)
    ok = total > 0
    return torch.where(ok, residual / torch.where(ok, total, torch.ones_like(total)), fallback)


def verify_sampling(
    parents: torch.Tensor | Sequence[int],
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    sampled: bool,
    generator: torch.Generator | None = None,
    trim: bool = True,
) -> SamplingVerdict:
    """Lossless recursive rejection sampling over a draft tree, for B independent trials sharing its shape.

    No host read happens inside (the loops run over the tree's depth and its rows' children, known from the
    structure); the bonus tokens are drawn in one multinomial at the end, each from the residual at which its
    trial stopped.

    Args:
        parents: [n] shared tree structure (-1 = child of the root, ``parents[i] < i``), or its TreeStructure.
        tokens: [B, n] draft tokens per trial.
        p: [B, n+1, V] processed target probabilities per verification row (row 0 = root, row i+1 = node i).
        q: [B, n, V] draft distribution each node was drawn from; required when ``sampled``.
        sampled: True for i.i.d. sampled siblings, False for deterministic ones (q ignored).
        generator: source of all randomness (uniforms for acceptance, multinomial draws for the bonus).
        trim: cut ``path`` to the longest accepted path (one host read); False keeps D = the tree's depth.

    Returns:
        A :class:`SamplingVerdict`.
    """
    if sampled and q is None:
        raise SpecgraftError("sampling verification of a sampled draft needs q; return q from the drafter")
    batch, n_rows, vocab = p.shape
    n = n_rows - 1
    device = p.device
    structure = _as_structure(parents)
    if structure.size != n:
        raise SpecgraftError(f"the tree has {structure.size} nodes but p has {n_rows} rows; need n + 1 rows")
    children = structure.children_index(device)  # [n+1, C]
    arange = torch.arange(batch, device=device)
    path = torch.full((batch, max(structure.max_depth, 1)), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    row = torch.zeros(batch, dtype=torch.long, device=device)  # current verification row per trial
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    final = p[:, 0]  # [B, V] the distribution each trial's bonus is drawn from (set when it stops)
    for depth in range(structure.max_depth + 1):
        # Every trial still going sits at a row of this depth.
        fresh = p[arange, row]  # [B, V] target distribution at the current node
        residual = fresh
        chosen = torch.full((batch,), -1, dtype=torch.long, device=device)
        for slot in range(structure.row_max_children[depth]):
            child = children[row, slot]  # [B]
            active = ~done & (chosen < 0) & (child >= 0)
            safe_child = child.clamp(min=0)
            x = tokens[arange, safe_child]  # [B]
            p_x = residual[arange, x]
            u = torch.rand(batch, generator=generator, device=device)
            if sampled:
                q_child = q[arange, safe_child]  # [B, V]
                accept = u < _acceptance_prob(p_x, q_child[arange, x])
                rejected_residual = _renormalise(_iid_residual(residual, q_child), residual)
            else:
                accept = u < p_x
                rejected_residual = _renormalise(_point_residual(residual, x), residual)
            chosen = torch.where(active & accept, child, chosen)
            update = (active & ~accept).unsqueeze(1)
            residual = torch.where(update, rejected_residual, residual)
        stop = ~done & (chosen < 0)
        final = torch.where(stop.unsqueeze(1), residual, final)
        done = done | stop
        go = ~done
        if depth < structure.max_depth:
            path[arange, num_accepted.clamp(max=path.shape[1] - 1)] = torch.where(
                go, chosen, path[arange, num_accepted.clamp(max=path.shape[1] - 1)])
        num_accepted = num_accepted + go.long()
        row = torch.where(go, chosen + 1, row)
    bonus = torch.multinomial(final, 1, generator=generator).squeeze(1)
    width = int(num_accepted.max()) if trim else structure.max_depth
    return SamplingVerdict(path=path[:, :width], num_accepted=num_accepted, bonus=bonus)


def alpha_exact(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) over the last axis: the probability that a token drawn from q is accepted under p."""
    return torch.minimum(p, q).sum(-1)
