"""EAGLE-1/2/3 drafting for the speculative decoder: a dynamic draft tree (EAGLE-2) or a chain.

The draft works on (feature, next token) pairs: pair ``i`` is the target feature of position ``i`` with the token
``x_{i+1}``, at draft position ``i``; its output feature predicts the token ``x_{i+2}`` and is fed back as the
feature of the next pair. Per decoding step (see :mod:`specgraft.decoding.drafter` for the protocol):

1. Catch up: run the pairs whose target features the decoder just delivered (positions ``hidden_start .. L-2``,
   paired with the tokens up to the root) on top of the draft's own KV cache (a transformers ``DynamicCache``).
   The output at pair ``L-2`` gives the distribution of the root's children.
2. Draft a tree. Dynamic tree (EAGLE-2): the root's top-k children are the depth-1 candidates; at each further depth
   the ``top_k`` candidates with the best cumulative log-probability are expanded -- fed to the draft in ONE
   forward under a tree mask (each sees the committed pairs, its ancestors and itself, at position ``L-2+d``) --
   and each proposes its own top-k children. Finally every candidate is ranked by cumulative log-probability and
   the best ``total_tokens - 1`` form the tree (ties go to the earlier candidate, so a node's parent always ranks
   before it). Chain: one token per depth, the argmax (greedy) or a draw from the draft distribution (sampling).
3. After the verdict (:meth:`EagleDrafter.accept`) the draft's cache is cut back to the committed pairs: the next
   step re-runs the accepted positions with the target's TRUE features, exactly what training saw.

Siblings in the dynamic tree are the draft's deterministic top-k (``sampled=False``: the verifier then uses the
deterministic-sibling rule, which is lossless) and carry no ``q``; a sampled chain is marked ``sampled=True`` and
its ``q`` is the draft's distribution at each node's parent processed with the decoder's sampling settings, over
the full target vocabulary (zero outside an EAGLE-3 draft vocabulary). The greedy chain never leaves the device
(argmax tokens are fed back as tensors); the tree reads each level's top-k once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specgraft.decoding import kv
from specgraft.decoding.acceptance import AcceptanceRecorder
from specgraft.decoding.drafter import DraftContext, Drafter, eval_mode
from specgraft.decoding.tree import DraftTree, additive_from_visible, level_visibility, strict_ancestors
from specgraft.decoding.verify import process_logits
from specgraft.errors import SpecgraftError
from specgraft.heads.eagle.model import EagleHeadBase

#: Drafting modes.
MODES = ("tree", "chain")


class EagleDrafter(Drafter):
    """Drafts with a trained EAGLE-1 (``eagle``) or EAGLE-3 (``eagle3``) head.

    Args:
        head: the head (its ``target`` must be the model being decoded, or one with the same identity).
        mode: ``tree`` (EAGLE-2 dynamic tree) or ``chain``.
        top_k: children per expanded node, and nodes expanded per depth (tree mode).
        depth: the deepest draft node (tree and chain).
        total_tokens: tree size including the root; the tree keeps the best ``total_tokens - 1`` candidates.
    """

    def __init__(self, head: EagleHeadBase, mode: str = "tree", top_k: int = 10, depth: int = 6,
                 total_tokens: int = 60) -> None:
        if not isinstance(head, EagleHeadBase):
            raise SpecgraftError(f"EagleDrafter needs an eagle or eagle3 head, got {type(head).__name__}; use the "
                                 "Medusa drafter for Medusa heads")
        if mode not in MODES:
            raise SpecgraftError(f"EAGLE drafting mode must be one of {MODES}, got {mode!r}")
        for name, value, low in (("top_k", top_k, 1), ("depth", depth, 1), ("total_tokens", total_tokens, 2)):
            if isinstance(value, bool) or int(value) != value or value < low:
                raise SpecgraftError(f"EAGLE drafter {name} must be an integer >= {low}, got {value!r}")
        self.head = head
        self.mode = mode
        self.top_k = int(top_k)
        self.depth = int(depth)
        self.total_tokens = int(total_tokens)
        self.needs_hidden_states = tuple(head.required_layers())
        self._vocab_size = head.target_identity.vocab_size
        #: Acceptance by (depth, rank among siblings), counted from each verdict (see eval.acceptance).
        self.acceptance = AcceptanceRecorder()
        self._last_parents: list[int] = []
        self.reset()

    # -- protocol --------------------------------------------------------------------------------------------
    def bind(self, target: Any, tokenizer: Any = None) -> None:
        """Refuse a model other than the target the head was built for (architecture, sizes, tokenizer)."""
        self.head.target_identity.require_same_model(target, tokenizer, what=f"{self.head.head_type} head")

    def reset(self) -> None:
        self._cache = kv.new_cache()
        self._seen = 0  # pairs with TRUE target features in the cache: positions 0 .. _seen-1
        # Draft id -> target id ([Vd] on the head's device, None for a full vocabulary): once per prompt, not per step.
        self._token_map = self.head.draft_token_ids()

    def accept(self, accepted_node_indices: Sequence[int], bonus_token: int) -> None:
        # Drop every tree entry: the accepted positions come back next step with the target's true features.
        kv.crop_cache(self._cache, self._seen)
        self.acceptance.record(self._last_parents, accepted_node_indices)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        with eval_mode(self.head):
            return self._propose(ctx)

    # -- internals -------------------------------------------------------------------------------------------
    def _propose(self, ctx: DraftContext) -> DraftTree:
        device = ctx.token_ids.device
        self._last_parents = []
        length = ctx.length
        start = int(ctx.hidden_start)
        if start > self._seen:
            raise SpecgraftError(f"the EAGLE drafter has target features up to position {self._seen - 1} but the "
                                 f"decoder resumes at {start}; call reset() before each prompt")
        # Forget anything beyond the delivered start (a proposal without accept(), or a rewound history).
        kv.crop_cache(self._cache, start)
        self._seen = start
        new = length - 1 - start  # pairs to run with true features
        depth = min(self.depth, int(ctx.max_depth))
        if new <= 0 or depth <= 0:
            return DraftTree.empty(device)
        head = self.head
        head_device = head.param_device
        dtype = head.param_dtype
        states = {int(i): ctx.hidden_states[int(i)].to(head_device).unsqueeze(0) for i in self.needs_hidden_states}
        features = head.input_features(states)  # [1, new, h]
        ids = ctx.token_ids[start + 1 : length].to(head_device).unsqueeze(0)  # [1, new]: x_{i+1} of pair i
        positions = torch.arange(start, length - 1, device=head_device)
        mask = None  # one new pair sees the whole cache
        if new > 1:
            visible = torch.ones(new, start + new, dtype=torch.bool, device=head_device)
            visible[:, start:] = torch.ones(new, new, dtype=torch.bool, device=head_device).tril()
            mask = _additive(visible, dtype)
        out, logits = head.draft_forward(ids, features, positions[None], mask, self._cache)
        self._seen = length - 1
        root_feature, root_logits = out[:, -1:], logits[0, -1]  # [1, 1, h], [V_out]
        token_map = self._token_map
        if self.mode == "chain":
            tree = self._chain(ctx, root_feature, root_logits, token_map, depth, device)
        else:
            tree = self._tree(ctx, root_feature, root_logits, token_map, depth, device)
        # Siblings are listed best first (by cumulative score), so a node's rank is its place among them.
        self._last_parents = tree.parents.tolist()
        return tree

    def _q_full(self, logits: torch.Tensor, ctx: DraftContext, token_map: torch.Tensor | None) -> torch.Tensor:
        """[m, V_out] draft logits -> [m, V] processed probabilities over the target vocabulary."""
        probs = process_logits(logits, ctx.sampling)  # [m, V_out]
        if token_map is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self._vocab_size)
        full[:, token_map] = probs
        return full

    def _feed(self, tokens: torch.Tensor, features: torch.Tensor, position: int,
              ancestors: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Run one tree level: tokens [m] (target ids) with their parents' features [m, h] at ``position``; row r
        sees the committed pairs, the cache slots ``ancestors[r]`` and itself (``ancestors=None``: one row that
        sees the whole cache, a chain's next node, with no mask to build). Returns out [m, h], logits [m, V_out]
        and the cache slot of each row."""
        past = kv.cache_length(self._cache)
        m = tokens.shape[0]
        device = features.device
        mask = None
        if ancestors is not None:
            visible = level_visibility(self._seen, past, ancestors, device)  # [m, past + m]
            mask = _additive(visible, self.head.param_dtype)
        positions = torch.full((1, m), position, dtype=torch.long, device=device)
        out, logits = self.head.draft_forward(tokens.unsqueeze(0), features.unsqueeze(0), positions, mask,
                                              self._cache)
        return out[0], logits[0], [past + r for r in range(m)]

    def _tree(self, ctx: DraftContext, root_feature: torch.Tensor, root_logits: torch.Tensor,
              token_map: torch.Tensor | None, depth: int, device: torch.device) -> DraftTree:
        k = min(self.top_k, root_logits.shape[-1])
        # Candidates, in creation order: token (target id), parent candidate (-1 = root), cumulative score.
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        slot_of: dict[int, int] = {}  # expanded candidate -> cache slot
        feature_of: dict[int, torch.Tensor] = {}  # expanded candidate -> its output feature [h]

        def add_children(expanded: list[int], logp: torch.Tensor) -> list[int]:
            """Top-k children of each expanded candidate (rows of logp [m, V_out]); one host read per level."""
            top = torch.topk(logp, k, dim=-1)
            ids = top.indices if token_map is None else token_map[top.indices]
            made = []
            for parent, row_ids, row_lp in zip(expanded, ids.tolist(), top.values.tolist()):
                base = scores[parent] if parent >= 0 else 0.0
                for tok, lp in zip(row_ids, row_lp):
                    made.append(len(tokens))
                    tokens.append(int(tok))
                    parents.append(parent)
                    scores.append(base + float(lp))
            return made

        level = add_children([-1], torch.log_softmax(root_logits.float(), -1)[None])
        parent_feature = {-1: root_feature[0, 0]}
        for d in range(1, depth):
            # Expand the top_k candidates of this depth by cumulative score (stable: earlier wins ties).
            order = sorted(level, key=lambda c: (-scores[c], c))[: self.top_k]
            order.sort()
            feats = torch.stack([parent_feature[parents[c]] if parents[c] < 0 else feature_of[parents[c]]
                                 for c in order])
            ancestors = [[slot_of[a] for a in strict_ancestors(parents, c)] for c in order]
            ids = torch.tensor([tokens[c] for c in order], dtype=torch.long, device=feats.device)
            out, logits, slots = self._feed(ids, feats, self._seen - 1 + d, ancestors)
            for r, c in enumerate(order):
                slot_of[c] = slots[r]
                feature_of[c] = out[r]
            level = add_children(order, torch.log_softmax(logits.float(), -1))  # [m, V_out]
        # Keep the best total_tokens - 1 candidates; a parent's score is >= its children's and it was created
        # first, so with ties broken by creation order every kept node's parent is kept too.
        ranked = sorted(range(len(tokens)), key=lambda c: (-scores[c], c))[: self.total_tokens - 1]
        kept = sorted(ranked)
        index = {c: i for i, c in enumerate(kept)}
        if any(parents[c] >= 0 and parents[c] not in index for c in kept):
            raise AssertionError("EAGLE tree selection kept a node without its parent")  # see the ordering above
        return DraftTree.from_lists([tokens[c] for c in kept],
                                    [index[parents[c]] if parents[c] >= 0 else -1 for c in kept],
                                    sampled=False, device=device)

    def _chain(self, ctx: DraftContext, root_feature: torch.Tensor, root_logits: torch.Tensor,
               token_map: torch.Tensor | None, depth: int, device: torch.device) -> DraftTree:
        sampled = not ctx.sampling.greedy
        feature, logits = root_feature[0, 0], root_logits
        tokens: list[torch.Tensor] = []  # [1] target ids, kept on the device (no host read while drafting)
        q_rows: list[torch.Tensor] = []
        for d in range(1, depth + 1):
            if sampled:
                q = self._q_full(logits[None], ctx, token_map)[0]  # [V]
                token = torch.multinomial(q.to(ctx.generator.device) if ctx.generator is not None else q, 1,
                                          generator=ctx.generator).to(feature.device)
                q_rows.append(q)
            else:
                best = logits.argmax().view(1)
                token = best if token_map is None else token_map[best]
            tokens.append(token)
            if d == depth:
                break
            # The cache holds the committed pairs and this chain's earlier nodes, all ancestors: no mask.
            out, out_logits, _ = self._feed(token, feature[None], self._seen - 1 + d, None)
            feature, logits = out[0], out_logits[0]
        return DraftTree.chain(torch.cat(tokens).to(device),
                               q=torch.stack(q_rows).to(device) if sampled else None, sampled=sampled)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[q, kv] bool visibility -> [1, 1, q, kv] additive mask (0 visible, the dtype's minimum elsewhere)."""
    return additive_from_visible(visible, dtype)[None, None]


# -- registry hooks: settings (eval flags, tuned.json) -> drafter ------------------------------------------------
def setting_from_flags(*, mode: str | None = None, k: int | None = None, tree_size: int | None = None,
                       top_k: int | None = None) -> dict[str, Any]:
    """``specgraft eval``'s --mode/--k/--tree-size/--eagle-top-k as an EAGLE setting (unset flags keep the drafter
    defaults)."""
    setting: dict[str, Any] = {"mode": mode or "tree"}
    for key, value in (("depth", k), ("total_tokens", tree_size), ("top_k", top_k)):
        if value is not None:
            setting[key] = int(value)
    return setting


def drafter_from_setting(head: EagleHeadBase, setting: Mapping[str, Any]) -> EagleDrafter:
    """A drafter at ``setting`` (mode, depth, top_k, total_tokens; absent keys take the drafter's defaults)."""
    kwargs: dict[str, Any] = {"mode": setting.get("mode", "tree")}
    keys = ("depth",) if kwargs["mode"] == "chain" else ("depth", "top_k", "total_tokens")
    for key in keys:
        if setting.get(key) is not None:
            kwargs[key] = int(setting[key])
    return EagleDrafter(head, **kwargs)


def describe_drafter(drafter: EagleDrafter) -> dict[str, Any]:
    return {"k": drafter.depth, "tree_size": drafter.total_tokens if drafter.mode == "tree" else drafter.depth + 1,
            "top_k": drafter.top_k}
