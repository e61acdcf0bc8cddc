"""A lossless speculative decoder for stock transformers causal LMs (batch size 1).

Each step: the drafter proposes a tree below the root (the last accepted token); the target runs ONE forward over
``[root] + nodes`` with explicit ``position_ids`` (prefix length + depth) and a 4D additive tree mask on top of its
``DynamicCache``; verification (greedy, or lossless rejection sampling) picks the accepted path and a bonus token;
the cache keeps only the root's and the accepted nodes' keys/values. With ``drafter=None`` the tree is empty and the
same loop is plain autoregressive decoding, so baseline and speculative runs count tokens and forwards identically.

The loop reads the device once per step: the verdict (accepted path, bonus token) together with the draft's
tokens and its validity flags. Tree shapes, masks and position offsets come from the cached
:class:`~specgraft.decoding.tree.TreeStructure`; the KV rollback moves only the accepted rows that are out of place.

Batch size > 1 is out of scope: a batch of prompts would accept paths of different lengths per row.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specgraft.decoding import kv
from specgraft.decoding import rows as row_layout
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.tree import DraftTree, TreeStructure, prune_to_depth
from specgraft.decoding.verify import SamplingParams, greedy_verdict, process_logits, verify_greedy, verify_sampling
from specgraft.errors import SpecgraftError

#: Token slots the decoder's device-side history grows by (doubling when full).
_TOKEN_BUFFER_STEP = 256

#: Why generation stopped.
STOP_EOS, STOP_MAX_NEW_TOKENS, STOP_CONTEXT = "eos", "max_new_tokens", "context_limit"


@dataclass
class GenerationResult:
    """One prompt's generation and its speculative-decoding statistics.

    Attributes:
        prompt_ids: the prompt's token ids.
        generated_ids: new tokens (EOS included when generation stopped on it).
        text: ``generated_ids`` decoded (None without a tokenizer).
        accepted_lengths: per verification step, draft nodes accepted by the verifier (before any truncation by
            EOS or ``max_new_tokens``).
        emitted_per_step: tokens actually appended per step (accepted + bonus, after truncation).
        draft_sizes: draft nodes verified per step (after pruning to the context limit).
        depth_attempted: ``depth_attempted[d-1]`` = steps in which at least one depth-``d`` node was verified with
            its parent accepted (i.e. the accepted path reached depth ``d-1`` and the node there had children).
        depth_accepted: ``depth_accepted[d-1]`` = steps in which a depth-``d`` node was accepted.
        alpha_sum, alpha_count: sum and count of the per-position acceptance probability over verified positions
            (every accepted-path row, root included, that has children), for the row's first child: ``sum_x
            min(p, q)`` with the child's ``q`` when the draft is sampled, ``p(token)`` of the drafted token when it
            is deterministic (greedy chains, top-k trees, Medusa: q is a point mass); ``p`` is the processed
            target distribution, one-hot at temperature 0, so greedy alpha counts drafts equal to the argmax.
        num_target_forwards: target forwards, the prefill included.
        wall_time_s: wall-clock seconds for the whole generation (prefill, drafting, verification).
        draft_time_s: the part of ``wall_time_s`` spent in ``Drafter.propose`` / ``accept``.
        prefill_time_s: the part of ``wall_time_s`` spent in the prompt's prefill forward.
        verify_time_s: the part of ``wall_time_s`` spent in the verification forwards and their verdicts (from
            the forward's call to the step's one device read; the rest of a step is the decoder's bookkeeping:
            tree and mask, KV rollback, hidden-state gather). ``specgraft tune`` calibrates with these parts.
        stop_reason: ``eos``, ``max_new_tokens`` or ``context_limit``.
    """

    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    text: str | None = None
    accepted_lengths: list[int] = field(default_factory=list)
    emitted_per_step: list[int] = field(default_factory=list)
    draft_sizes: list[int] = field(default_factory=list)
    depth_attempted: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    alpha_sum: float = 0.0
    alpha_count: int = 0
    num_target_forwards: int = 0
    wall_time_s: float = 0.0
    draft_time_s: float = 0.0
    prefill_time_s: float = 0.0
    verify_time_s: float = 0.0
    stop_reason: str = STOP_MAX_NEW_TOKENS

    @property
    def num_new_tokens(self) -> int:
        return len(self.generated_ids)

    @property
    def num_steps(self) -> int:
        """Verification steps (target forwards after the prefill)."""
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean accepted length per step, bonus included (mean of ``accepted + 1``); nan without steps."""
        if not self.accepted_lengths:
            return float("nan")
        return sum(a + 1 for a in self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def alpha_exact(self) -> float:
        return self.alpha_sum / self.alpha_count if self.alpha_count else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.wall_time_s if self.wall_time_s > 0 else float("nan")

    def acceptance_by_depth(self) -> list[float]:
        """``[accepted / attempted]`` per depth 1..D (nan where never attempted)."""
        return [a / t if t else float("nan") for a, t in zip(self.depth_accepted, self.depth_attempted)]


def _eos_ids(model: Any, tokenizer: Any, eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        for source in (getattr(model, "generation_config", None), kv.text_config(model), tokenizer):
            eos_token_id = getattr(source, "eos_token_id", None) if source is not None else None
            if eos_token_id is not None:
                break
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(e) for e in eos_token_id)


def _prompt_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise SpecgraftError("a text prompt needs a tokenizer; pass tokenizer= to SpeculativeDecoder or give ids")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2:
            if prompt.shape[0] != 1:
                raise SpecgraftError(f"batch size {prompt.shape[0]} is not supported (batch size 1 only); "
                                     "decode prompts one at a time")
            prompt = prompt[0]
        ids = prompt.tolist()
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise SpecgraftError("the prompt is empty; give at least one token (e.g. BOS)")
    return [int(t) for t in ids]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _unwrap(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Accept a specgraft ``Target`` as well as a bare ``PreTrainedModel``."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(model, "identity") and hasattr(inner, "config"):
        return inner, tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    return model, tokenizer


class SpeculativeDecoder:
    """Greedy or sampled decoding of one target with an optional :class:`Drafter`; lossless by construction.

    Args:
        model: a transformers causal LM (``PreTrainedModel``) or a :class:`specgraft.target.Target`; its attention
            must be ``sdpa`` or ``eager`` (tree masks are 4D additive masks).
        tokenizer: optional; enables text prompts, ``GenerationResult.text`` and tokenizer checks by drafters.
        drafter: the draft proposer; None for plain autoregressive decoding on the same code path.
        temperature, top_k, top_p: target-side sampling (temperature 0 = greedy); plain and speculative sampling use
            the same processed distribution.
        eos_token_id: stop tokens; defaults to the model's generation config, then its config, then the tokenizer.
        ignore_eos: never stop on EOS (for fixed-length benchmarks).
        seed: seed of the decoder's generator (verification draws and, through ``DraftContext``, drafter draws).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        drafter: Drafter | None = None,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        ignore_eos: bool = False,
        seed: int = 0,
    ) -> None:
        self.model, self.tokenizer = _unwrap(model, tokenizer)
        self.sampling = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        self.layout = kv.attention_layout(self.model)
        self.exact_rows = row_layout.uses_exact_attention(self.model)
        config = kv.text_config(self.model)
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.eos_ids = frozenset() if ignore_eos else _eos_ids(self.model, self.tokenizer, eos_token_id)
        self.device = kv.model_device(self.model)
        self.dtype = kv.model_dtype(self.model)
        #: Greedy verdicts read on the host and walked in Python (:meth:`_verify_greedy_on_host`) where reads are
        #: free, i.e. on the CPU; elsewhere computed on the device, one read per step.
        self.host_verdict = self.device.type == "cpu"
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.drafter = drafter
        if drafter is not None:
            bad = [i for i in drafter.needs_hidden_states if not 0 <= int(i) <= self.num_layers]
            if bad:
                raise SpecgraftError(f"drafter asks for hidden states {bad}, outside 0..{self.num_layers} "
                                     "(output_hidden_states indices of this target)")
            drafter.bind(self.model, self.tokenizer)

    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int,
                 seed: int | None = None) -> GenerationResult:
        """Decode up to ``max_new_tokens`` tokens after ``prompt`` (text, ids, or a [1, T] / [T] tensor).

        Stops at the first EOS (kept in the output), after ``max_new_tokens`` tokens, or when the sequence fills the
        model's context (``max_position_embeddings`` tokens in all). ``seed`` reseeds the generator first.
        """
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
            raise SpecgraftError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens}")
        prompt_ids = _prompt_ids(prompt, self.tokenizer)
        if self.max_positions is not None and len(prompt_ids) > self.max_positions:
            raise SpecgraftError(f"the prompt has {len(prompt_ids)} tokens, more than the model's context of "
                                 f"{self.max_positions}; shorten the prompt")
        if seed is not None:
            self.generator.manual_seed(seed)
        result = GenerationResult(prompt_ids=list(prompt_ids))
        needs = tuple(int(i) for i in self.drafter.needs_hidden_states) if self.drafter is not None else ()
        if self.drafter is not None:
            self.drafter.reset()

        _sync(self.device)
        start = time.perf_counter()
        tokens = list(prompt_ids)
        cache = kv.new_cache()
        hidden_size = int(kv.text_config(self.model).hidden_size)
        hidden = {i: torch.zeros(0, hidden_size, dtype=self.dtype, device=self.device) for i in needs}
        hidden_start = 0
        nothing_to_do = max_new_tokens == 0 or (self.max_positions is not None and len(tokens) >= self.max_positions)
        if len(tokens) > 1 and not nothing_to_do:
            # Prefill every prompt token but the last one, which becomes the first root.
            out = self.model(input_ids=torch.tensor([tokens[:-1]], device=self.device), cache=cache, use_cache=True,
                             output_hidden_states=bool(needs), logits_to_keep=1)
            result.num_target_forwards += 1
            hidden = {i: out.hidden_states[i][0] for i in needs}  # [L-1, H] each
            _sync(self.device)  # once per generation: the prefill's time is its own, not the first step's
            result.prefill_time_s = time.perf_counter() - start
        # Accepted tokens on the device for DraftContext (written as they are accepted, read as a view).
        token_buffer = torch.tensor(tokens + [0] * min(max_new_tokens, _TOKEN_BUFFER_STEP), dtype=torch.long,
                                    device=self.device)
        alpha_total = torch.zeros((), dtype=torch.float64, device=self.device)
        stop = None
        while stop is None:
            length = len(tokens)
            remaining = max_new_tokens - len(result.generated_ids)
            if remaining <= 0:
                stop = STOP_MAX_NEW_TOKENS
                break
            if self.max_positions is not None and length >= self.max_positions:
                stop = STOP_CONTEXT
                break
            context_depth = self.max_positions - length - 1 if self.max_positions is not None else 1 << 30
            # A step emits the accepted nodes plus a bonus token: nodes deeper than remaining - 1 can never count.
            max_depth = min(context_depth, remaining - 1)
            tree, kept, structure = self._propose(result, token_buffer[:length], len(prompt_ids), hidden_start,
                                                  hidden, max_depth, remaining)
            n = structure.size
            result.draft_sizes.append(n)
            past = length - 1
            root = token_buffer[past : length]  # [1]
            node_tokens = tree.tokens.clamp(0, self.vocab_size - 1)  # out-of-range ids are flagged, not embedded
            ids = torch.cat([root, node_tokens]).unsqueeze(0)  # [1, n+1]
            exact_rows = self.exact_rows and n > 0  # a one-token step is already plain decoding's own call
            if exact_rows:
                # Row-exact attention: each row attends to its own keys in logical order through the very call
                # one-token decoding makes (the row-layout protocol, specgraft.decoding.rows); no mask is needed.
                # The tree mask is passed too, so that a model whose forward does not hand keyword arguments on to
                # its attention still verifies correctly (through sdpa), only not bit-exactly.
                pos = mask = None
                rows = row_layout.row_keys(past, structure, self.device)
                if not structure.chain:
                    positions = structure.row_depths(self.device) + past  # [n+1]
                    key_pos = torch.cat([torch.arange(past, device=self.device), positions])
                    mask = self.layout.tree_mask(structure, past, positions, key_pos, self.dtype)
                    pos = positions.unsqueeze(0)
                layout = {"attention_mask": mask, "position_ids": pos, row_layout.ROWS_KWARG: rows}
            elif n == 0:
                layout = {}  # one token: plain decoding's own step, which needs no mask
            else:
                # A chain too gets the mask built here from its structure's cached block, not the model's own causal
                # mask: the two are equal, but transformers builds its mask anew in every multi-token forward, a
                # per-step cost that matters where the forward itself is cheap (small targets, CPUs).
                pos = structure.row_depths(self.device) + past  # [n+1]
                key_pos = torch.cat([torch.arange(past, device=self.device), pos])
                mask = self.layout.tree_mask(structure, past, pos, key_pos, self.dtype)
                layout = {"attention_mask": mask, "position_ids": pos.unsqueeze(0)}
            # Verification is timed from the forward's call to the verdict's device read (GenerationResult's
            # verify_time_s); building the mask before it and walking the tree after it are the step's bookkeeping.
            verify_start = time.perf_counter()
            with row_layout.rows_one_at_a_time(self.model) if exact_rows else contextlib.nullcontext():
                out = self.model(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=bool(needs),
                                 **layout)
            result.num_target_forwards += 1
            logits = out.logits[0]  # [n+1, V]
            accepted, bonus, row_alpha = self._verify(tree, structure, node_tokens, logits, result, verify_start)

            emitted = accepted[1] + [bonus]
            accepted = accepted[0]
            keep_n = min(len(emitted), remaining)
            eos_at = next((j for j, t in enumerate(emitted[:keep_n]) if t in self.eos_ids), None)
            if eos_at is not None:
                keep_n, stop = eos_at + 1, STOP_EOS
            elif keep_n < len(emitted):
                stop = STOP_MAX_NEW_TOKENS
            kept_tokens = emitted[:keep_n]
            if length + keep_n > token_buffer.shape[0]:
                token_buffer = torch.cat([token_buffer, torch.zeros_like(token_buffer)])
            token_buffer[length : length + keep_n] = torch.tensor(kept_tokens, dtype=torch.long)
            tokens.extend(kept_tokens)
            result.generated_ids.extend(kept_tokens)
            result.accepted_lengths.append(len(accepted))
            result.emitted_per_step.append(keep_n)
            if n:
                alpha_total += self._record_depths(result, structure, accepted, row_alpha)
            if stop is not None:
                break
            # Keep the root's and the accepted nodes' keys/values; the rest of the tree is dropped.
            kv.keep_positions(cache, past + 1, accepted)
            if accepted == list(range(len(accepted))):
                hidden = {i: out.hidden_states[i][0][: len(accepted) + 1] for i in needs}  # a view, no copy
            else:
                rows = torch.tensor([0] + [a + 1 for a in accepted], device=self.device)
                hidden = {i: out.hidden_states[i][0].index_select(0, rows) for i in needs}
            hidden_start = past
            if kept is not None:
                t0 = time.perf_counter()
                self.drafter.accept([kept[a] for a in accepted], bonus)
                result.draft_time_s += time.perf_counter() - t0
        result.alpha_sum = float(alpha_total)
        _sync(self.device)
        result.wall_time_s = time.perf_counter() - start
        result.stop_reason = stop
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(result.generated_ids, skip_special_tokens=True)
        return result

    # ------------------------------------------------------------------------------------------------------------
    def _propose(self, result: GenerationResult, token_ids: torch.Tensor, prompt_length: int, hidden_start: int,
                 hidden: dict[int, torch.Tensor], max_depth: int,
                 remaining: int) -> tuple[DraftTree, list[int] | None, TreeStructure]:
        if self.drafter is None or max_depth <= 0:
            # Nothing could be verified (last token of the budget or the context): the drafter is not consulted.
            tree = DraftTree.empty(self.device)
            return tree, None, tree.get_structure()
        ctx = DraftContext(token_ids=token_ids, prompt_length=prompt_length, hidden_start=hidden_start,
                           hidden_states=hidden, sampling=self.sampling, generator=self.generator,
                           max_depth=max_depth, remaining_tokens=remaining)
        t0 = time.perf_counter()
        tree = self.drafter.propose(ctx)
        result.draft_time_s += time.perf_counter() - t0
        tree.check_shapes(self.vocab_size, need_q=not self.sampling.greedy)
        tree = DraftTree(tokens=tree.tokens.to(self.device), parents=tree.parents.to(self.device),
                         q=tree.q.to(self.device) if (tree.q is not None and tree.sampled) else None,
                         sampled=tree.sampled, structure=tree.get_structure())
        tree, kept = prune_to_depth(tree, max_depth)
        return tree, kept, tree.get_structure()

    def _verify(self, tree: DraftTree, structure: TreeStructure, node_tokens: torch.Tensor, logits: torch.Tensor,
                result: GenerationResult,
                verify_start: float) -> tuple[tuple[list[int], list[int]], int, torch.Tensor | list[float] | None]:
        """Pick the accepted path and bonus with ONE device read (which also carries the draft's validity flags);
        the time from ``verify_start`` (the forward's call) to that read is added to ``result.verify_time_s``.

        Returns ``((accepted node indices, their tokens), bonus, row_alpha)``: ``row_alpha`` [n+1] is each row's
        acceptance probability for its first child (see ``GenerationResult.alpha_sum``; rows without children hold
        0), None for an empty tree; a list for greedy decoding on the CPU (:meth:`_verify_greedy_on_host`).
        """
        n = structure.size
        sampled = tree.sampled and not self.sampling.greedy
        if self.sampling.greedy and self.host_verdict:
            return self._verify_greedy_on_host(tree, structure, logits, result, verify_start)
        if self.sampling.greedy:
            argmax = logits.argmax(-1)  # [n+1]
            verdict = greedy_verdict(structure, node_tokens, argmax)  # [2] (last node, bonus)
        else:
            probs = process_logits(logits, self.sampling)  # [n+1, V]
            q = tree.q.unsqueeze(0) if sampled and n else None
            drawn = verify_sampling(structure, node_tokens.unsqueeze(0), probs.unsqueeze(0), q, sampled,
                                    self.generator, trim=False)
            verdict = torch.cat([drawn.num_accepted, drawn.bonus, drawn.path[0]])
        if n == 0:
            values = verdict.tolist()
            result.verify_time_s += time.perf_counter() - verify_start
            return ([], []), int(values[1]), None
        flags = tree.problems(self.vocab_size, need_q=sampled)
        values = torch.cat([verdict, flags, tree.tokens]).tolist()  # the step's one device read
        result.verify_time_s += time.perf_counter() - verify_start
        width = verdict.shape[0]
        if values[width] or values[width + 1]:
            tree.raise_problems(self.vocab_size, values[width : width + 2])
        node_values = values[width + 2 :]
        if self.sampling.greedy:
            accepted = structure.path_to(int(values[0]))
        else:
            accepted = [int(a) for a in values[2 : 2 + int(values[0])]]
        bonus = int(values[1])
        # Per-row acceptance probability of the row's first child (computed on the device, read at the end).
        first_child = structure.first_children(logits.device)  # [n+1]
        child_tokens = node_tokens.index_select(0, first_child)
        if self.sampling.greedy:
            row_alpha = (argmax == child_tokens).double()
        elif sampled:
            row_alpha = torch.minimum(probs, tree.q.index_select(0, first_child).float()).sum(-1).double()
        else:
            row_alpha = probs.gather(1, child_tokens.unsqueeze(1)).squeeze(1).double()
        return (accepted, [node_values[a] for a in accepted]), bonus, row_alpha

    def _verify_greedy_on_host(self, tree: DraftTree, structure: TreeStructure, logits: torch.Tensor,
                               result: GenerationResult, verify_start: float
                               ) -> tuple[tuple[list[int], list[int]], int, list[float] | None]:
        """:meth:`_verify` for greedy decoding on the CPU, where reading a tensor costs no device sync: the argmax
        rows and the draft tokens are read in one ``tolist`` and the tree is walked in Python
        (:func:`~specgraft.decoding.verify.verify_greedy`), instead of the two dozen small tensor ops that keep the
        GPU path free of host reads (on stories260K, 1 thread, those cost about a tenth of a millisecond per step).
        ``row_alpha`` is then a list (1.0 where a row's first child is its argmax)."""
        n = structure.size
        values = torch.cat([logits.argmax(-1), tree.tokens]).tolist()  # the step's one read
        result.verify_time_s += time.perf_counter() - verify_start
        best, tokens = values[: n + 1], values[n + 1 :]
        if n == 0:
            return ([], []), best[0], None
        if any(not 0 <= t < self.vocab_size for t in tokens):
            tree.raise_problems(self.vocab_size, (1, 0))
        accepted, bonus = verify_greedy(structure, tokens, best)
        row_alpha = [float(bool(kids) and tokens[kids[0]] == best[r]) for r, kids in enumerate(structure.children)]
        return (accepted, [tokens[a] for a in accepted]), bonus, row_alpha

    @staticmethod
    def _record_depths(result: GenerationResult, structure: TreeStructure, accepted: list[int],
                       row_alpha: torch.Tensor | list[float]) -> torch.Tensor | float:
        """Per-depth attempted/accepted counts and the alpha of the accepted path's rows (a device scalar)."""
        path_rows = [0] + [a + 1 for a in accepted]
        alpha_rows = []
        for depth, row in enumerate(path_rows, start=1):
            if not structure.children[row]:
                break
            alpha_rows.append(row)
            while len(result.depth_attempted) < depth:
                result.depth_attempted.append(0)
                result.depth_accepted.append(0)
            result.depth_attempted[depth - 1] += 1
            if depth <= len(accepted):
                result.depth_accepted[depth - 1] += 1
        result.alpha_count += len(alpha_rows)
        if isinstance(row_alpha, list):
            return sum(row_alpha[r] for r in alpha_rows)
        if alpha_rows == list(range(len(alpha_rows))):  # rows 0..m-1 (always so for chains): a slice
            return row_alpha[: len(alpha_rows)].sum()
        return row_alpha.index_select(0, torch.tensor(alpha_rows, device=row_alpha.device)).sum()


@torch.no_grad()
def generate_reference(
    model: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    ignore_eos: bool = False,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Reference decoding without any cache: each step recomputes the whole sequence (slow; for tests).

    Same stopping rules and sampling distribution as :class:`SpeculativeDecoder` (sampling draws one
    ``torch.multinomial`` per token from ``generator``, like the decoder with no drafter).
    """
    model, _ = _unwrap(model, None)
    params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    eos = frozenset() if ignore_eos else _eos_ids(model, None, eos_token_id)
    max_positions = getattr(kv.text_config(model), "max_position_embeddings", None)
    tokens = _prompt_ids(prompt_ids, None)
    if max_positions is not None and len(tokens) > max_positions:
        raise SpecgraftError(f"the prompt has {len(tokens)} tokens, more than the model's context of {max_positions}; "
                             "shorten the prompt")
    device = kv.model_device(model)
    new: list[int] = []
    while len(new) < max_new_tokens and (max_positions is None or len(tokens) < max_positions):
        logits = model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0, -1]
        if params.greedy:
            token = int(logits.argmax())
        else:
            probs = process_logits(logits, params).unsqueeze(0)
            token = int(torch.multinomial(probs, 1, generator=generator)[0, 0])
        tokens.append(token)
        new.append(token)
        if token in eos:
            break
    return new
