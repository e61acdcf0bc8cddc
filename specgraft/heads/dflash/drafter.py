"""DFlash drafting for the speculative decoder: ONE draft forward per step proposes ``block_size - 1`` tokens.

Per step (see :mod:`specgraft.decoding.drafter` for the protocol): the root (the last accepted token, at position
``L-1``) is the block's anchor, slot 0; slots ``1 .. bs-1`` hold the mask token at positions ``L .. L+bs-2`` and
their outputs are the drafts at depths ``1 .. bs-1``, verified as a chain. The block sees the context features of
positions ``0 .. L-2`` (all strictly before the anchor, exactly the training mask) and itself, bidirectionally.

Context cache: the draft layers' keys/values of the context rows depend only on the target's features
(``hidden_norm(fc(.))``, the same input for every layer), never on the drafts, so they are kept in a transformers
``DynamicCache`` across steps. Each step feeds only the newly delivered context rows plus the block, then crops the
block's rows back off: the per-step cost is one draft pass over ``new + block_size`` rows against the cached keys,
independent of the sequence length except through attention.

Chain: greedy takes each slot's argmax; sampling draws slot ``k``'s token from ``q_k`` (the slot's processed
distribution over the target vocabulary, zero outside a reduced draft vocabulary) with the decoder's generator and
returns ``q``. The slots' distributions do not depend on each other's draws, so drawing them independently is a
valid proposal for the chain verifier. ``mode="tree"``: the top-``top_k`` tokens of every slot, each as a child of
the best token of the previous slot (the chain of argmaxes is the spine); siblings are deterministic top-k
(``sampled=False``, the verifier's deterministic-sibling rule keeps it lossless).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specgraft.decoding import kv
from specgraft.decoding.acceptance import AcceptanceRecorder
from specgraft.decoding.drafter import DraftContext, Drafter, eval_mode
from specgraft.decoding.tree import DraftTree
from specgraft.decoding.verify import process_logits
from specgraft.errors import SpecgraftError
from specgraft.heads.dflash.model import DFlashHead

#: Drafting modes.
MODES = ("chain", "tree")


class DFlashDrafter(Drafter):
    """Drafts with a trained DFlash head.

    Args:
        head: the head (its ``target`` must be the model being decoded, or one with the same identity).
        mode: ``chain`` (block_size - 1 tokens, one per slot) or ``tree`` (per-slot top-k below the argmax spine).
        top_k: siblings per depth in tree mode.
        depth: draft at most this many slots (default all ``block_size - 1``): the block costs one forward either
            way, but verifying fewer tokens is cheaper where verification is compute-bound (a CPU).
        block_size: slots of the block run per step (default the trained ``block_size``; at least ``depth + 1``).
            llama.cpp runs ``--spec-draft-n-max + 1`` slots, so ``block_size=depth + 1`` drafts what it drafts;
            slots attend to each other, so a shorter block is not the first slots of the trained one.
    """

    def __init__(self, head: DFlashHead, mode: str = "chain", top_k: int = 2, depth: int | None = None,
                 block_size: int | None = None) -> None:
        if not isinstance(head, DFlashHead):
            raise SpecgraftError(f"DFlashDrafter needs a dflash head, got {type(head).__name__}; use the drafter of "
                                 "that head's family")
        if mode not in MODES:
            raise SpecgraftError(f"DFlash drafting mode must be one of {MODES}, got {mode!r}")
        if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1:
            raise SpecgraftError(f"DFlash drafter top_k must be an integer >= 1, got {top_k!r}")
        slots = head.config.block_size - 1
        if depth is not None and (isinstance(depth, bool) or int(depth) != depth or not 1 <= depth <= slots):
            raise SpecgraftError(f"DFlash drafter depth must be an integer in 1..{slots} (block_size - 1), got "
                                 f"{depth!r}")
        self.head = head
        self.mode = mode
        self.top_k = int(top_k)
        self.depth = slots if depth is None else int(depth)
        trained = head.config.block_size
        if block_size is not None and (isinstance(block_size, bool) or int(block_size) != block_size
                                       or not self.depth + 1 <= block_size <= trained):
            raise SpecgraftError(f"DFlash drafter block_size must be an integer in {self.depth + 1}..{trained} (the "
                                 f"depth plus the anchor, at most the trained block), got {block_size!r}")
        self.block_size = trained if block_size is None else int(block_size)
        self.needs_hidden_states = tuple(head.required_layers())
        self._vocab_size = head.target_identity.vocab_size
        self.acceptance = AcceptanceRecorder()
        self._last_parents: list[int] = []
        self.reset()

    # -- protocol --------------------------------------------------------------------------------------------
    def bind(self, target: Any, tokenizer: Any = None) -> None:
        """Refuse a model other than the target the head was built for (architecture, sizes, tokenizer)."""
        self.head.target_identity.require_same_model(target, tokenizer, what=f"{self.head.head_type} head")

    def reset(self) -> None:
        self._cache = kv.new_cache()
        # Draft id -> target id ([Vd] on the head's device, None for a full vocabulary): once per prompt, not per step.
        self._token_map = self.head.draft_token_ids()
        self._seen = 0  # context rows in the cache: positions 0 .. _seen-1

    def accept(self, accepted_node_indices: Sequence[int], bonus_token: int) -> None:
        self.acceptance.record(self._last_parents, accepted_node_indices)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        with eval_mode(self.head):
            return self._propose(ctx)

    # -- internals -------------------------------------------------------------------------------------------
    def block_logits(self, ctx: DraftContext) -> torch.Tensor:
        """Update the context cache with the delivered features and run the block (:attr:`block_size` slots):
        [bs - 1, V_out] logits of slots 1 .. bs-1 (depths 1 .. bs-1 below the root)."""
        head = self.head
        length = ctx.length
        start = int(ctx.hidden_start)
        if start > self._seen:
            raise SpecgraftError(f"the DFlash drafter has context features up to position {self._seen - 1} but the "
                                 f"decoder resumes at {start}; call reset() before each prompt")
        kv.crop_cache(self._cache, start)  # a rewound history: forget what lies beyond the delivered start
        self._seen = start
        device = head.param_device
        bs = self.block_size
        new = length - 1 - start
        if new > 0:
            states = {int(i): ctx.hidden_states[int(i)].to(device).unsqueeze(0) for i in self.needs_hidden_states}
            context = head.context_features(states)  # [1, new, h]
        else:
            context = torch.zeros(1, 0, head.target.hidden_size, dtype=head.param_dtype, device=device)
        slots = torch.full((1, bs), head.config.mask_token_id, dtype=torch.long, device=device)
        slots[0, 0] = ctx.token_ids[-1].to(device)
        positions = torch.arange(start, length - 1 + bs, device=device)[None]  # context rows, then the block
        hidden = head.block_forward(head.embed(slots), context, positions, None, self._cache)  # [1, bs, h]
        kv.crop_cache(self._cache, length - 1)  # keep the context rows only
        self._seen = length - 1
        return head.block_logits(hidden[0, 1:])

    def _q_full(self, logits: torch.Tensor, ctx: DraftContext, token_map: torch.Tensor | None) -> torch.Tensor:
        """[m, V_out] draft logits -> [m, V] processed probabilities over the target vocabulary."""
        probs = process_logits(logits, ctx.sampling)
        if token_map is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self._vocab_size)
        full[:, token_map] = probs
        return full

    def _propose(self, ctx: DraftContext) -> DraftTree:
        device = ctx.token_ids.device
        self._last_parents = []
        depth = min(self.depth, int(ctx.max_depth))
        if depth <= 0:
            return DraftTree.empty(device)
        logits = self.block_logits(ctx)[:depth]  # [depth, V_out]
        token_map = self._token_map
        if self.mode == "tree":
            tree = self._tree(logits, token_map, device)
        elif ctx.sampling.greedy:
            best = logits.argmax(-1)
            tree = DraftTree.chain((best if token_map is None else token_map[best]).to(device))
        else:
            q = self._q_full(logits, ctx, token_map)  # [depth, V]
            draw_on = ctx.generator.device if ctx.generator is not None else q.device
            tokens = torch.multinomial(q.to(draw_on), 1, generator=ctx.generator).view(-1)
            tree = DraftTree.chain(tokens.to(device), q=q.to(device), sampled=True)
        self._last_parents = tree.parents.tolist()
        return tree

    def _tree(self, logits: torch.Tensor, token_map: torch.Tensor | None, device: torch.device) -> DraftTree:
        """Depth d holds slot d's top-k tokens (best first), all children of depth d-1's best token."""
        k = min(self.top_k, logits.shape[-1])
        top = torch.topk(logits, k, dim=-1).indices  # [depth, k]
        ids = (top if token_map is None else token_map[top]).tolist()
        tokens: list[int] = []
        parents: list[int] = []
        spine = -1  # the previous depth's best node
        for row in ids:
            first = len(tokens)
            tokens.extend(int(t) for t in row)
            parents.extend([spine] * len(row))
            spine = first
        return DraftTree.from_lists(tokens, parents, sampled=False, device=device)


# -- registry hooks: settings (eval flags, tuned.json) -> drafter ------------------------------------------------
def setting_from_flags(*, mode: str | None = None, k: int | None = None, tree_size: int | None = None,
                       top_k: int | None = None) -> dict[str, Any]:
    """``specgraft eval``'s --mode (chain default), --k (slots drafted, at most block_size - 1) and --eagle-top-k
    (siblings per depth in tree mode) as a DFlash setting."""
    if tree_size is not None:
        raise SpecgraftError("--tree-size does not apply to dflash heads (a tree has --k depths of --eagle-top-k "
                             "siblings); use --k and --eagle-top-k")
    setting: dict[str, Any] = {"mode": mode or "chain"}
    if k is not None:
        setting["depth"] = int(k)
    if top_k is not None:
        setting["top_k"] = int(top_k)
    return setting


def drafter_from_setting(head: DFlashHead, setting: Mapping[str, Any]) -> DFlashDrafter:
    kwargs: dict[str, Any] = {"mode": setting.get("mode", "chain")}
    for key in ("depth", "top_k"):
        if setting.get(key) is not None:
            kwargs[key] = int(setting[key])
    return DFlashDrafter(head, **kwargs)


def describe_drafter(drafter: DFlashDrafter) -> dict[str, Any]:
    width = drafter.top_k if drafter.mode == "tree" else 1
    return {"k": drafter.depth, "tree_size": 1 + drafter.depth * width, "top_k": width,
            "block_size": drafter.block_size}
