"""Medusa decoding: the static sparse tree, its accuracy statistics, and the :class:`MedusaDrafter`.

Medusa drafts with a tree fixed in advance. A node is a *path of choices* ``(i_1, ..., i_d)``: at depth ``j`` take
the ``i_j``-th best token of head ``j - 1`` (head ``k`` guesses the token ``k + 2`` positions after the last token
the target processed, i.e. depth ``k + 1`` below the root). If ``acc[k, i]`` is the measured probability that head
``k``'s ``i``-th choice is the right token, a path is accepted with probability about ``prod_j acc[j-1, i_j]`` and the
expected number of accepted drafts is the sum of that product over the tree's nodes. Since extending a path never
raises its product, taking the ``n`` best paths one at a time (each time the best child of a node already in the
tree) maximises that sum and always yields a tree (every prefix of a kept path is kept).

The accuracies are measured on held-out data by :func:`measure_topk_accuracy` and stored in the head's config
(``MedusaConfig.topk_accuracy``, written to ``head_config.json`` by ``save_pretrained``), so a drafter can rebuild
the tree from the saved head alone; without them :func:`default_topk_accuracy` gives a conservative prior.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specgraft.decoding.acceptance import AcceptanceRecorder
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.tree import DraftTree, TreeStructure, tree_structure
from specgraft.errors import SpecgraftError
from specgraft.heads.medusa.model import MedusaHead, label_mask
from specgraft.target import Target

#: Draft nodes of the default tree (the root not counted): with the root, one verification forward of 64 tokens.
DEFAULT_NUM_NODES = 63
#: Choices per head considered by measurement and tree construction.
DEFAULT_TOPK = 10
#: The prior used when no accuracy was measured: head 0's top-1 accuracy, the factor per further head, and the
#: factor per further rank (so acc[k, i] = TOP1 * HEAD_FACTOR**k * RANK_FACTOR**i).
DEFAULT_TOP1_ACCURACY = 0.6
DEFAULT_HEAD_FACTOR = 0.75
DEFAULT_RANK_FACTOR = 0.35
#: Tree modes of :class:`MedusaDrafter`.
MODES = ("tree", "chain")


# ----------------------------------------------------------------------------------------------------------------
# The static tree


@dataclass(frozen=True)
class MedusaTree:
    """A static Medusa tree: node ``i`` is the choice path ``paths[i]`` (ranks per depth, 0 = best).

    Nodes are in breadth-first order, siblings by ascending rank (best first), so ``parents[i] < i`` and the
    structure can be handed to :class:`~specgraft.decoding.tree.DraftTree` as it is.
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        known = set(self.paths)
        for path in self.paths:
            if not path or any(c < 0 for c in path):
                raise SpecgraftError(f"medusa tree path {path} must be a non-empty tuple of ranks >= 0")
            if len(path) > 1 and path[:-1] not in known:
                raise SpecgraftError(f"medusa tree path {path} has no parent {path[:-1]} in the tree")
        if len(known) != len(self.paths):
            raise SpecgraftError("medusa tree paths must be distinct")
        if list(self.paths) != sorted(self.paths, key=_bfs_key):
            raise SpecgraftError("medusa tree paths must be in breadth-first order (by depth, then ranks)")

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]]) -> MedusaTree:
        """A tree from choice paths in any order (sorted breadth-first; every prefix must be present)."""
        return cls(tuple(sorted((tuple(int(c) for c in p) for p in paths), key=_bfs_key)))

    @property
    def size(self) -> int:
        """Draft nodes (the root not counted)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def max_rank(self) -> int:
        """The largest rank used (so ``top-(max_rank + 1)`` of each head suffices)."""
        return max((max(p) for p in self.paths), default=0)

    def parents(self) -> list[int]:
        """Parent node index of each node (-1 for children of the root)."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def depths(self) -> list[int]:
        """Depth of each node (1 for children of the root; head ``depth - 1`` proposes it)."""
        return [len(p) for p in self.paths]

    def ranks(self) -> list[int]:
        """Each node's rank among its head's choices."""
        return [p[-1] for p in self.paths]

    def expected_accepted(self, accuracy: torch.Tensor) -> float:
        """Expected accepted drafts per step (bonus not counted) if head choices were independent."""
        acc = accuracy.double()
        total = 0.0
        for path in self.paths:
            prob = 1.0
            for depth, rank in enumerate(path):
                prob *= float(acc[depth, rank]) if depth < acc.shape[0] and rank < acc.shape[1] else 0.0
            total += prob
        return total


def _bfs_key(path: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    return (len(path), path)


def build_sparse_tree(accuracy: torch.Tensor | Sequence[Sequence[float]], num_nodes: int = DEFAULT_NUM_NODES,
                      max_depth: int | None = None) -> MedusaTree:
    """The greedy expected-acceptance-maximising tree of ``num_nodes`` nodes.

    Args:
        accuracy: [K, topk] ``acc[k, i]`` = P(head k's i-th choice is the right token).
        num_nodes: draft nodes (root not counted).
        max_depth: deepest level (default K, one level per head).
    """
    acc = torch.as_tensor(accuracy, dtype=torch.float64)
    if acc.dim() != 2 or acc.shape[0] < 1 or acc.shape[1] < 1:
        raise SpecgraftError(f"medusa accuracy must be a [num_heads, topk] matrix, got shape {tuple(acc.shape)}")
    if not bool(((acc >= 0) & (acc <= 1)).all()):
        raise SpecgraftError("medusa accuracies must be probabilities in [0, 1]; re-measure them")
    if int(num_nodes) != num_nodes or num_nodes < 1:
        raise SpecgraftError(f"medusa tree num_nodes must be a positive integer, got {num_nodes}")
    num_heads, topk = acc.shape
    depth_limit = num_heads if max_depth is None else min(int(max_depth), num_heads)
    if depth_limit < 1:
        raise SpecgraftError(f"medusa tree max_depth must be at least 1, got {max_depth}")
    values = acc.tolist()
    # Max-heap of candidate paths by product of accuracies; ties broken by breadth-first order (deterministic).
    heap: list[tuple[float, tuple[int, tuple[int, ...]], tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...], prob: float) -> None:
        depth = len(path)
        if depth >= depth_limit:
            return
        for rank in range(topk):
            child = path + (rank,)
            heapq.heappush(heap, (-prob * values[depth][rank], _bfs_key(child), child))

    push_children((), 1.0)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        neg_prob, _, path = heapq.heappop(heap)
        chosen.append(path)
        push_children(path, -neg_prob)
    return MedusaTree.from_paths(chosen)


def chain_tree(num_heads: int) -> MedusaTree:
    """The chain of each head's top-1 choice: ``(0,), (0, 0), ...`` (``num_heads`` nodes)."""
    if num_heads < 1:
        raise SpecgraftError(f"a medusa chain needs at least one head, got {num_heads}")
    return MedusaTree(tuple((0,) * d for d in range(1, num_heads + 1)))


def default_topk_accuracy(num_heads: int, topk: int = DEFAULT_TOPK) -> torch.Tensor:
    """A prior [K, topk] accuracy matrix for heads whose accuracy was never measured (decays with head and rank)."""
    heads = torch.arange(num_heads, dtype=torch.float64).unsqueeze(1)  # [K, 1]
    ranks = torch.arange(topk, dtype=torch.float64).unsqueeze(0)  # [1, topk]
    return (DEFAULT_TOP1_ACCURACY * DEFAULT_HEAD_FACTOR ** heads * DEFAULT_RANK_FACTOR ** ranks).float()


# ----------------------------------------------------------------------------------------------------------------
# Measuring the accuracies


def _as_batch(item: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """One batch dict ([B, T] tensors) from a batch dict, a dataset row (lists) or a bare ids tensor."""
    if isinstance(item, torch.Tensor):
        item = {"input_ids": item}
    if not isinstance(item, Mapping) or "input_ids" not in item:
        raise SpecgraftError("measure_topk_accuracy needs batches or rows with input_ids (and optionally "
                             "attention_mask and loss_mask)")
    batch = {}
    for key in ("input_ids", "attention_mask", "loss_mask"):
        if item.get(key) is None:
            continue
        value = torch.as_tensor(item[key], dtype=torch.long)
        if value.dim() == 1:
            value = value.unsqueeze(0)
        batch[key] = value.to(device)
    return batch


@torch.no_grad()
def measure_topk_accuracy(head: MedusaHead, target: Target | None, batches: Iterable[Any],
                          topk: int = DEFAULT_TOPK, max_batches: int | None = None) -> torch.Tensor:
    """Estimate ``acc[k, i]`` = P(head k's i-th choice is the token k+2 positions ahead) on held-out data.

    Args:
        head: the trained Medusa heads.
        target: the target the head was built for (None: ``head.target``).
        batches: batches (dicts of [B, T] ``input_ids``/``attention_mask``/``loss_mask``), dataset rows (dicts of
            lists) or [B, T] id tensors. Pairs are counted as in training: labels on ``loss_mask`` tokens only.
        topk: ranks to measure.
        max_batches: stop after this many batches.

    Returns:
        [K, topk] float32 accuracies (0 for a head that saw no labelled pair). Store them with
        ``head.set_topk_accuracy(acc)`` before ``save_pretrained`` so drafters can build the tree without data.
    """
    target = head.target if target is None else target
    if int(topk) != topk or topk < 1:
        raise SpecgraftError(f"topk must be a positive integer, got {topk}")
    num_heads = head.num_heads
    hits = torch.zeros(num_heads, topk, dtype=torch.float64)
    counts = torch.zeros(num_heads, dtype=torch.float64)
    layer = head.required_layers()[0]
    was_training = head.training
    head.eval()
    try:
        for n, item in enumerate(batches):
            if max_batches is not None and n >= max_batches:
                break
            batch = _as_batch(item, target.device)
            input_ids = batch["input_ids"]
            out = target.forward(input_ids, batch.get("attention_mask"), layers=(layer,), logits=False)
            hidden = out.hidden_states[layer]  # [B, T, h]
            labelled = label_mask(input_ids, batch.get("loss_mask"), batch.get("attention_mask"))
            real = label_mask(input_ids, None, batch.get("attention_mask"))
            seq_len = input_ids.shape[1]
            for k in range(num_heads):
                offset = k + 2
                if seq_len <= offset:
                    continue
                sel = real[:, : seq_len - offset] & labelled[:, offset:]  # [B, T - offset]
                rows = hidden[:, : seq_len - offset][sel]  # [N, h]
                if rows.shape[0] == 0:
                    continue
                labels = input_ids[:, offset:][sel]  # [N]
                logits = head.head_logits(rows, k)  # [N, V]
                label_logit = logits.gather(-1, labels.unsqueeze(-1))  # [N, 1]
                rank = (logits > label_logit).sum(-1)  # [N] 0 = top-1
                hits[k] += torch.bincount(rank[rank < topk].cpu(), minlength=topk)[:topk].double()
                counts[k] += rows.shape[0]
    finally:
        head.train(was_training)
    return (hits / counts.clamp_min(1.0).unsqueeze(1)).float()


def head_topk_accuracy(head: MedusaHead, topk: int = DEFAULT_TOPK) -> torch.Tensor:
    """The head's stored measured accuracies, or :func:`default_topk_accuracy` when none were measured."""
    stored = head.config.topk_accuracy
    if stored is None:
        return default_topk_accuracy(head.num_heads, topk)
    return torch.tensor(stored, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# The drafter


class MedusaDrafter(Drafter):
    """Drafts with Medusa heads: a static tree (or chain) of the heads' top choices below the root.

    Each step reads the target's last hidden state at the last position the target processed (the token before
    the root), runs the heads the tree needs once, and fills the static tree: a node of depth ``d`` and rank ``i``
    gets head ``d - 1``'s ``i``-th best token. Only heads ``0 .. D-1`` run, D the tree's depth after the decoder's
    depth limit (a chain of 1 runs one head, not K vocabulary projections). Siblings are deterministic top-k
    choices, best first (``sampled=False``), which both greedy and lossless sampling verification accept; being
    point masses they carry no ``q`` (``alpha_exact`` is then the target's probability of the drafted token). The
    structure of the tree (and so the decoder's mask block) is built once per depth limit.

    Args:
        head: the Medusa heads (built for the target being decoded).
        mode: ``tree`` (static sparse tree) or ``chain`` (top-1 of each head).
        num_nodes: draft nodes of the tree (root not counted).
        accuracy: [K, topk] accuracies to build the tree from (default: the head's stored ones, else the prior).
        max_depth: deepest level drafted (default: K).
        paths: an explicit tree (rank paths, e.g. from ``tuned.json``) instead of building one; overrides
            ``mode``, ``num_nodes``, ``accuracy`` and ``max_depth``.
    """

    def __init__(self, head: MedusaHead, mode: str = "tree", num_nodes: int = DEFAULT_NUM_NODES,
                 accuracy: torch.Tensor | Sequence[Sequence[float]] | None = None, max_depth: int | None = None,
                 paths: Sequence[Sequence[int]] | None = None) -> None:
        if not isinstance(head, MedusaHead):
            raise SpecgraftError(f"MedusaDrafter needs a MedusaHead, got {type(head).__name__}; load the head "
                                 "with load_head and pass a medusa one")
        if mode not in MODES:
            raise SpecgraftError(f"medusa drafting mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.head = head
        self.mode = mode
        self.needs_hidden_states = tuple(head.required_layers())
        if paths is not None:
            self.tree = MedusaTree.from_paths(paths)  # an explicit tree, e.g. a tuned one (tuned.json)
            if self.tree.depth > head.num_heads:
                raise SpecgraftError(f"the medusa tree is {self.tree.depth} levels deep but the head has "
                                     f"{head.num_heads} heads; re-tune for this head")
        elif mode == "chain":
            depth = head.num_heads if max_depth is None else min(int(max_depth), head.num_heads)
            self.tree = chain_tree(max(depth, 1))
        else:
            acc = head_topk_accuracy(head) if accuracy is None else torch.as_tensor(accuracy, dtype=torch.float32)
            if acc.shape[0] != head.num_heads:
                raise SpecgraftError(f"medusa accuracy has {acc.shape[0]} rows but the head has {head.num_heads} "
                                     "heads; measure it for this head")
            self.tree = build_sparse_tree(acc, num_nodes=num_nodes, max_depth=max_depth)
        if self.tree.max_rank >= head.config.vocab_size:
            raise SpecgraftError(f"the medusa tree uses rank {self.tree.max_rank} but the vocabulary has only "
                                 f"{head.config.vocab_size} tokens; measure fewer top-k choices")
        self._depth_list = self.tree.depths()
        #: Acceptance by (depth, rank) and per static node, counted from each verdict (see eval.acceptance).
        self.acceptance = AcceptanceRecorder(static_paths=[list(p) for p in self.tree.paths])
        self.acceptance.reset()
        self._ranks = self.tree.ranks()
        self._last_parents: list[int] = []
        # Per (depth limit, device): the tree's structure, its [n] parents, head (depth - 1) and rank indices,
        # and the top-r each head needs (its largest rank + 1) -- all fixed for a static tree.
        self._indices: dict[tuple[int, torch.device], tuple[TreeStructure, torch.Tensor, torch.Tensor,
                                                            torch.Tensor, int]] = {}

    def _tree_indices(self, depth_limit: int,
                      device: torch.device) -> tuple[TreeStructure, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        key = (depth_limit, device)
        if key not in self._indices:
            # Breadth-first order: the nodes within the depth limit are a prefix, so parent indices stay valid.
            n = sum(1 for d in self._depth_list if d <= depth_limit)
            parents = self.tree.parents()[:n]
            ranks = self.tree.ranks()[:n]
            structure = tree_structure(tuple(parents))
            self._indices[key] = (
                structure,
                structure.parent_rows(device) - 1,
                torch.tensor([d - 1 for d in self._depth_list[:n]], dtype=torch.long, device=device),
                torch.tensor(ranks, dtype=torch.long, device=device),
                max(ranks) + 1,
            )
        return self._indices[key]

    def bind(self, target: Any, tokenizer: Any = None) -> None:
        """Refuse a target other than the one the head was built for (architecture, sizes, tokenizer)."""
        self.head.target_identity.require_same_model(target, tokenizer, what=f"{self.head.head_type} head")

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        device = ctx.token_ids.device
        hidden = ctx.hidden_states.get(self.needs_hidden_states[0])
        depth_limit = min(self.tree.depth, ctx.max_depth)
        self._last_parents = []
        if hidden is None or hidden.shape[0] == 0 or depth_limit <= 0:
            # A one-token prompt: the target has not processed any position yet, so there is nothing to read.
            return DraftTree.empty(device)
        last = hidden[-1].to(self.head.blocks[0].layers[0].weight.device)  # [h]
        structure, parents, head_index, rank, top_r = self._tree_indices(depth_limit, last.device)
        # Only the heads the tree reaches: head d-1 proposes depth d.
        logits = torch.stack([self.head.head_logits(last, k) for k in range(structure.max_depth)]).float()  # [D, V]
        top = logits.topk(top_r, dim=-1).indices  # [D, r]
        tokens = top[head_index, rank]  # [n]
        self._last_parents = self.tree.parents()[:len(tokens)]
        return DraftTree(tokens=tokens.to(device), parents=parents.to(device), sampled=False, structure=structure)

    def accept(self, accepted_node_indices: Sequence[int], bonus_token: int) -> None:
        self.acceptance.record(self._last_parents, accepted_node_indices, ranks=self._ranks)


# -- registry hooks: settings (eval flags, tuned.json) -> drafter ------------------------------------------------
def setting_from_flags(*, mode: str | None = None, k: int | None = None, tree_size: int | None = None,
                       top_k: int | None = None) -> dict[str, Any]:
    """``specgraft eval``'s --mode/--k/--tree-size as a Medusa setting (unset flags keep the drafter defaults)."""
    if top_k is not None:
        raise SpecgraftError("--eagle-top-k applies to eagle/eagle3 heads, not medusa")
    if tree_size is not None and tree_size < 2:
        raise SpecgraftError(f"--tree-size counts the root, so it must be >= 2, got {tree_size}")
    setting: dict[str, Any] = {"mode": mode or "tree"}
    if tree_size is not None:
        setting["tree_size"] = int(tree_size)
    if k is not None:
        setting["depth"] = int(k)
    return setting


def drafter_from_setting(head: MedusaHead, setting: Mapping[str, Any]) -> MedusaDrafter:
    """A drafter at ``setting``: a tuned tree (``paths``) or a tree/chain of ``tree_size`` tokens (root counted)
    and at most ``depth`` levels."""
    if "paths" in setting:
        return MedusaDrafter(head, mode="tree", paths=setting["paths"])
    kwargs: dict[str, Any] = {"mode": setting.get("mode", "tree")}
    if setting.get("tree_size") is not None:
        kwargs["num_nodes"] = int(setting["tree_size"]) - 1
    if setting.get("depth") is not None:
        kwargs["max_depth"] = int(setting["depth"])
    return MedusaDrafter(head, **kwargs)


def describe_drafter(drafter: MedusaDrafter) -> dict[str, Any]:
    return {"k": drafter.tree.depth, "tree_size": drafter.tree.size + 1}


def default_setting(head: MedusaHead) -> dict[str, Any]:
    """The tree an untuned `specgraft eval` drafts, built from the head's stored accuracies."""
    tree = build_sparse_tree(head_topk_accuracy(head).tolist(), DEFAULT_NUM_NODES)
    return {"mode": "tree", "tree_size": tree.size + 1, "depth": tree.depth, "paths": [list(p) for p in tree.paths]}


def tuning_prior(head: MedusaHead) -> list[list[float]]:
    """The per-head top-k accuracies ``tune`` uses as the prior of its acceptance model."""
    return head_topk_accuracy(head).tolist()


def train_metrics(head: MedusaHead, target: Target, batches: Iterable[Any], max_batches: int,
                  measured_on: str) -> dict[str, Any]:
    """Registry hook run once after training: measure each head's top-k accuracy on ``batches`` and store it in
    the head, so the drafter builds its static tree from measured numbers; returns the facts worth logging."""
    import logging

    head.eval()
    accuracy = measure_topk_accuracy(head, target, batches, max_batches=max_batches)
    head.train()
    head.set_topk_accuracy(accuracy)
    logging.getLogger(__name__).info("medusa top-1 accuracy per head (%s data): %s", measured_on,
                                     ", ".join(f"{a:.3f}" for a in accuracy[:, 0].tolist()))
    return {"medusa_top1_accuracy": [round(a, 4) for a in accuracy[:, 0].tolist()],
            "medusa_top5_accuracy": [round(a, 4) for a in accuracy[:, :5].sum(-1).tolist()],
            "accuracy_measured_on": measured_on}
