"""The Drafter interface: what the speculative decoder gives a drafter each step and what it expects back.

Protocol, per prompt (batch size 1)::

    drafter.bind(target_model, tokenizer)          # once, when the SpeculativeDecoder is built
    drafter.reset()                                # before each prompt
    loop:
        tree = drafter.propose(ctx)                # ctx: DraftContext (tokens so far + new target features)
        ...target verifies every node of `tree` in ONE forward...
        drafter.accept(accepted_node_indices, bonus_token)   # only when decoding continues

Positions and the root. ``ctx.token_ids`` holds every token accepted so far (prompt + generated), ``L`` of them.
The last one, ``ctx.token_ids[-1]``, is the *root*: already emitted but not yet processed by the target; the target
has processed (holds KV and hidden states for) positions ``0 .. L-2``. The tree the drafter returns hangs below the
root: a node of depth ``d`` is a guess for the token at position ``L - 1 + d``. On the first call after
``reset()`` the root is the last prompt token.

Target features. A drafter that needs the target's hidden states (Medusa, EAGLE) lists the
``output_hidden_states`` indices it wants in :attr:`Drafter.needs_hidden_states` (0 = embedding output, ``i`` =
output of decoder layer ``i-1``, ``N`` = last layer, after the final norm in Llama-family models). Each call then
carries, in ``ctx.hidden_states[index]``, a [m, hidden] tensor for the positions the target processed since the
previous call: positions ``ctx.hidden_start .. L-2`` (``m = L - 1 - hidden_start``). The first call brings the
prompt's positions ``0 .. L-2`` (nothing when the prompt has one token); later calls bring the previous root and the
draft nodes the target accepted. Concatenating them over calls yields every position exactly once. So:

* Medusa reads ``ctx.hidden_states[N][-1]``, the target state at position ``L-2`` whose LM-head output is the root,
  and its head ``d`` predicts the token at position ``L - 1 + d`` = depth ``d`` in the tree.
* EAGLE keeps (feature, next token) pairs: the feature of position ``i`` with token ``i+1``; after each call it has
  features for positions up to ``L-2`` and tokens up to the root, so it can draft below the root right away.

A drafter with its own KV cache (EAGLE, a draft LM) rolls it back in :meth:`Drafter.accept` and appends what it has
not seen from ``ctx.token_ids`` on the next :meth:`Drafter.propose`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specgraft.decoding.tree import DraftTree
from specgraft.decoding.verify import SamplingParams


@dataclass
class DraftContext:
    """What a drafter receives each step.

    Attributes:
        token_ids: [L] int64, all accepted tokens (prompt + generated) on the target's device; the last is the root.
        prompt_length: number of prompt tokens at the start of ``token_ids``.
        hidden_start: first position covered by ``hidden_states`` (they cover ``hidden_start .. L-2``).
        hidden_states: ``{index: [L - 1 - hidden_start, hidden]}`` for every index in ``needs_hidden_states``,
            in the target's dtype and device; empty when the drafter asked for none.
        sampling: the decoder's target-side sampling settings (``sampling.greedy`` for temperature 0). A drafter
            that samples should draw from a distribution it reports as ``q`` (usually its own logits processed with
            the same settings, via :func:`specgraft.decoding.verify.process_logits`).
        generator: the decoder's seeded generator; drafters that sample should draw from it, so a seed fixes a run.
        max_depth: the deepest node worth drafting: the context limit, and ``remaining_tokens - 1`` (a step emits
            the accepted nodes plus a bonus token, so deeper nodes could never be emitted). Deeper nodes are pruned
            by the decoder; drafters should not compute them. At least 1 (with 0 the decoder skips the drafter).
        remaining_tokens: how many tokens the decoder may still emit (``max_new_tokens`` budget).
    """

    token_ids: torch.Tensor
    prompt_length: int
    hidden_start: int
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    max_depth: int = 0
    remaining_tokens: int = 0

    @property
    def length(self) -> int:
        """L, the number of accepted tokens including the root."""
        return int(self.token_ids.shape[0])

    @property
    def root_token(self) -> int:
        return int(self.token_ids[-1])


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` in eval mode, restoring training mode afterwards if it was training.

    A module already in eval mode (the usual case while decoding) is left alone: ``module.eval()`` walks the whole
    module tree, a cost comparable to a small draft forward when paid on every step.
    """
    if not module.training:
        yield
        return
    module.eval()
    try:
        yield
    finally:
        module.train(True)


class Drafter(ABC):
    """Proposes draft trees for a :class:`specgraft.decoding.decoder.SpeculativeDecoder` (batch size 1)."""

    #: output_hidden_states indices of the target this drafter needs each step (see the module docstring).
    needs_hidden_states: tuple[int, ...] = ()

    def bind(self, target: Any, tokenizer: Any = None) -> None:  # noqa: B027 - optional hook
        """Called once by the decoder with the target ``PreTrainedModel`` (and its tokenizer, if any).

        Check compatibility here (vocab size, tokenizer, hidden size) and raise SpecgraftError on a mismatch.
        """

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """The torch modules this drafter runs besides the target (its head or draft model), so a caller can set
        their kernels (:mod:`specgraft.kernels.linear`). The default finds the ``head`` / ``model`` attribute the
        built-in drafters keep them in; a drafter that keeps modules elsewhere overrides it."""
        found = (getattr(self, "head", None), getattr(self, "model", None))
        return tuple(m for m in found if isinstance(m, torch.nn.Module))

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget all per-prompt state (own KV cache, stored features). Called before each prompt."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> DraftTree:
        """Return the draft tree below ``ctx.root_token`` (:meth:`DraftTree.empty` to skip drafting this step).

        Node tokens and ``q`` are over the target vocabulary. For lossless sampling (``not ctx.sampling.greedy``)
        a tree with ``sampled=True`` must carry ``q``: node ``i`` drawn from ``q[i]``, siblings independently.
        """

    def accept(self, accepted_node_indices: Sequence[int], bonus_token: int) -> None:  # noqa: B027 - optional hook
        """The verdict on the last proposed tree: nodes accepted root-to-leaf (indices into that tree) and the
        bonus token the target emitted after them. Not called when decoding stops after the step (EOS, budget,
        context), nor after a step for which ``propose`` was not called. The next ``propose`` sees ``token_ids``
        extended by the accepted tokens and the bonus (the new root), with the target's hidden states for the old
        root and the accepted nodes."""
