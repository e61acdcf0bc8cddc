"""Built-in drafters: a separate draft LM, the target drafting for itself, and random guesses.

* :class:`DraftModelDrafter` drafts with any causal LM sharing the target's vocabulary, keeping its own KV cache
  and rolling it back to the accepted path after each step. A chain of ``k`` tokens by default; ``tree_topk``
  branches the first levels (greedy: the draft's top-b tokens; sampling: b i.i.d. draws, or top-b with
  ``sibling_mode="topk"``).
* :class:`SelfDrafter` is a DraftModelDrafter whose draft is the target itself: under greedy decoding every draft is
  accepted, so tau equals ``k + 1`` exactly (a check of the whole pipeline).
* :class:`RandomDrafter` proposes uniformly random tokens (tau about 1; a check that rejections are handled).

Drafts never go deeper than ``ctx.max_depth`` (the context limit and the ``max_new_tokens`` budget), and only
sampled drafts carry ``q`` rows: deterministic ones are point masses to the verifier and to ``alpha_exact``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specgraft.decoding import kv
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.tree import DraftTree, level_visibility, strict_ancestors
from specgraft.decoding.verify import process_logits
from specgraft.errors import SpecgraftError, TargetMismatchError

#: Sibling modes for tree drafting under sampling.
SIBLING_MODES = ("iid", "topk")


def _vocab_size(model: Any) -> int:
    return int(kv.text_config(model).vocab_size)


class DraftModelDrafter(Drafter):
    """Drafts with a separate causal LM of the same vocabulary (standard speculative decoding).

    Args:
        model: the draft causal LM (``PreTrainedModel``), on the target's device or another one.
        k: draft depth (tokens per chain).
        tree_topk: branching factor of the first levels, e.g. ``(2, 2)`` gives 2 children at depths 1 and 2 and a
            single child below (so ``k=4`` drafts 2 + 4 + 4 + 4 = 14 nodes). None for a chain.
        tokenizer: the draft's tokenizer; when both it and the target's are known, their vocabularies must match.
        sibling_mode: under sampling, ``iid`` draws siblings independently from the draft distribution
            (``sampled=True``), ``topk`` takes its top tokens deterministically (``sampled=False``). Greedy decoding
            always uses top-k.
    """

    def __init__(self, model: Any, k: int = 4, tree_topk: Sequence[int] | None = None, tokenizer: Any = None,
                 sibling_mode: str = "iid") -> None:
        if int(k) != k or k < 1:
            raise SpecgraftError(f"draft length k must be a positive integer, got {k}")
        if tree_topk is not None:
            tree_topk = tuple(int(b) for b in tree_topk)
            if any(b < 1 for b in tree_topk) or len(tree_topk) > k:
                raise SpecgraftError(f"tree_topk {tree_topk} needs at most k={k} entries, each >= 1")
        if sibling_mode not in SIBLING_MODES:
            raise SpecgraftError(f"sibling_mode must be one of {SIBLING_MODES}, got {sibling_mode!r}")
        self.model = model
        self.k = int(k)
        self.tree_topk = tree_topk or ()
        self.tokenizer = tokenizer
        self.sibling_mode = sibling_mode
        self.layout: kv.AttentionLayout | None = kv.attention_layout(model) if model is not None else None
        self._cache = kv.new_cache()
        self._seen = 0  # committed tokens whose keys/values are in the cache (slots 0.._seen-1 = positions)
        self._length = 0  # L of the last proposal
        self._node_slots: dict[int, int] = {}  # node index -> cache slot, for nodes fed during the last proposal

    def bind(self, target: Any, tokenizer: Any = None) -> None:
        target_vocab, draft_vocab = _vocab_size(target), _vocab_size(self.model)
        if target_vocab != draft_vocab:
            raise TargetMismatchError(f"draft model vocab size {draft_vocab} != target vocab size {target_vocab}; "
                                      "use a draft model with the target's tokenizer and vocabulary")
        if tokenizer is not None and self.tokenizer is not None:
            from specgraft.target import tokenizer_fingerprint

            if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(self.tokenizer):
                raise TargetMismatchError("the draft model's tokenizer differs from the target's (vocabulary or "
                                          "special tokens); use a draft trained with the target's tokenizer")

    def reset(self) -> None:
        self._cache = kv.new_cache()
        self._seen = 0
        self._length = 0
        self._node_slots = {}

    def _branching(self, depth: int) -> int:
        return self.tree_topk[depth - 1] if depth <= len(self.tree_topk) else 1

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        target_device = ctx.token_ids.device
        length = ctx.length
        if self._node_slots or self._seen > length - 1 or kv.cache_length(self._cache) != self._seen:
            # No accept() since the last proposal (or a foreign history): fall back to the committed prefix.
            self._seen = min(self._seen, length - 1, self._length)
            kv.crop_cache(self._cache, self._seen)
            self._node_slots = {}
        self._length = length
        limit = getattr(kv.text_config(self.model), "max_position_embeddings", None)
        depth = min(self.k, ctx.max_depth)
        if limit is not None:
            # The root is fed at position L-1 and nodes of depth < `depth` at L-1+d: all must be < limit.
            depth = min(depth, limit - length + 1)
        if depth <= 0:
            return DraftTree.empty(target_device)
        device = kv.model_device(self.model)
        ids = ctx.token_ids.to(device)
        # Catch up on the committed tokens the draft has not seen (the root included): plain causal forward.
        out = self.model(input_ids=ids[self._seen:].unsqueeze(0), cache=self._cache, use_cache=True, logits_to_keep=1)
        self._seen = length
        frontier: list[tuple[int, torch.Tensor]] = [(-1, out.logits[0, -1])]  # (node index or -1 = root, logits)
        tokens: list[int] = []
        parents: list[int] = []
        q_rows: list[torch.Tensor] = []  # only for a sampled draft: the distribution each node was drawn from
        sampled = not ctx.sampling.greedy and self.sibling_mode == "iid"
        slot_positions = list(range(length))
        for d in range(1, depth + 1):
            branch = self._branching(d)
            level: list[int] = []
            for parent, logits in frontier:
                # Greedy drafting ranks the raw logits: processing them (a one-hot) would be wasted work per node.
                probs = None if ctx.sampling.greedy else process_logits(logits, ctx.sampling)  # [V]
                if sampled:
                    children = torch.multinomial(probs.to(ctx.generator.device if ctx.generator else probs.device),
                                                 branch, replacement=True, generator=ctx.generator).tolist()
                else:
                    # Greedy: rank by the raw logits; sampling top-k: by the processed probabilities.
                    ranking = logits if ctx.sampling.greedy else probs
                    children = torch.topk(ranking, branch).indices.tolist()
                for tok in children:
                    level.append(len(tokens))
                    tokens.append(int(tok))
                    parents.append(parent)
                    if sampled:
                        q_rows.append(probs)
            if d == depth:
                break
            past = kv.cache_length(self._cache)
            if len(level) == 1 and past == length - 1 + d:
                # Still a single chain: an ordinary causal step (cache slots are positions), no explicit mask.
                out = self.model(input_ids=torch.tensor([[tokens[level[0]]]], device=device), cache=self._cache,
                                 use_cache=True)
                self._node_slots[level[0]] = past
                slot_positions.append(past)
                frontier = [(level[0], out.logits[0, 0])]
                continue
            # Feed this level (all nodes at position L-1+d) with a tree mask to get their children's logits.
            qpos = torch.full((len(level),), length - 1 + d, dtype=torch.long, device=device)
            key_pos = torch.cat([torch.tensor(slot_positions, dtype=torch.long, device=device), qpos])
            visible = level_visibility(length, past, [[self._node_slots[a] for a in strict_ancestors(parents, node)]
                                                      for node in level])  # [m, past + m]
            out = kv.masked_forward(self.model, self.layout, self._cache,
                                    torch.tensor([[tokens[i] for i in level]], device=device), qpos, key_pos, visible)
            for row, node in enumerate(level):
                self._node_slots[node] = past + row
            slot_positions.extend([length - 1 + d] * len(level))
            frontier = [(node, out.logits[0, row]) for row, node in enumerate(level)]
        q = torch.stack(q_rows).to(target_device) if q_rows else None
        return DraftTree.from_lists(tokens, parents, q=q, sampled=sampled, device=target_device)

    def accept(self, accepted_node_indices: Sequence[int], bonus_token: int) -> None:
        # The accepted nodes that were fed sit at increasing slots at positions L, L+1, ...: keep exactly those.
        fed = [self._node_slots[a] - self._length for a in accepted_node_indices if a in self._node_slots]
        kv.keep_positions(self._cache, self._length, fed)
        self._seen = self._length + len(fed)
        self._node_slots = {}


class SelfDrafter(DraftModelDrafter):
    """The target drafting for itself (its own separate KV cache): greedy tau is exactly ``k + 1``.

    Args:
        k: draft length.
        tree_topk: optional branching of the first levels (see :class:`DraftModelDrafter`).
        model: the draft model; None (default) uses the target the decoder binds.
    """

    def __init__(self, k: int = 4, tree_topk: Sequence[int] | None = None, model: Any = None,
                 sibling_mode: str = "iid") -> None:
        super().__init__(model, k=k, tree_topk=tree_topk, sibling_mode=sibling_mode)

    def bind(self, target: Any, tokenizer: Any = None) -> None:
        if self.model is None:
            self.model = target
            self.layout = kv.attention_layout(target)
        super().bind(target, tokenizer)


class RandomDrafter(Drafter):
    """A chain of ``k`` tokens drawn uniformly from the vocabulary (``q`` uniform, ``sampled=True``).

    Every draw comes from the decoder's generator (``ctx.generator``), fresh at each call: the drafts really are
    independent uniform draws, as the reported ``q`` says, so sampling verification stays lossless, and the
    decoder's seed fixes a run. (Reseeding a private generator per prompt would repeat the same "random" drafts on
    every call with the same history: deterministic drafts labelled sampled, which biases the output.)
    """

    def __init__(self, vocab_size: int, k: int = 4) -> None:
        if int(k) != k or k < 1:
            raise SpecgraftError(f"draft length k must be a positive integer, got {k}")
        self.vocab_size = int(vocab_size)
        self.k = int(k)

    def bind(self, target: Any, tokenizer: Any = None) -> None:
        if _vocab_size(target) != self.vocab_size:
            raise TargetMismatchError(f"RandomDrafter vocab size {self.vocab_size} != target vocab size "
                                      f"{_vocab_size(target)}; build it with the target's vocab size")

    def propose(self, ctx: DraftContext) -> DraftTree:
        k = min(self.k, ctx.max_depth)
        device = ctx.token_ids.device
        if k <= 0:
            return DraftTree.empty(device)
        gen_device = ctx.generator.device if ctx.generator is not None else device
        tokens = torch.randint(0, self.vocab_size, (k,), generator=ctx.generator, device=gen_device).to(device)
        sampled = not ctx.sampling.greedy
        q = torch.full((k, self.vocab_size), 1.0 / self.vocab_size, device=device) if sampled else None
        return DraftTree.chain(tokens, q=q, sampled=sampled)
