"""EAGLE-3's reduced draft vocabulary: the most frequent target tokens of the training data's loss tokens.

Conventions (as the serving engines read them):

* ``d2t`` int64 [Vd]: offsets, ``target_id = draft_id + d2t[draft_id]``; draft ids are the chosen target ids in
  ascending order, so ``d2t`` is non-negative and non-decreasing. When the draft vocabulary is the whole target
  vocabulary ``d2t`` is all zeros -- that is the identity map, not an unset buffer.
* ``t2d`` bool [V]: which target ids are in the draft vocabulary.

Coverage (the fraction of target tokens a draft can propose at all) is reported on held-out rows: measured on the
labels the vocabulary was counted from it reads high (those labels chose the vocabulary), so every
``heldout_every``-th training row (:func:`heldout_rows`) is left out of the counts and the coverage is measured on
its loss tokens instead.
"""

from __future__ import annotations

import torch

from specgraft.errors import SpecgraftError

#: EAGLE-3's default draft vocabulary size (32k for Llama-3's 128k vocabulary).
DEFAULT_DRAFT_VOCAB_SIZE = 32000


def default_draft_vocab_size(target_vocab_size: int) -> int:
    """``min(32000, V)``."""
    return min(DEFAULT_DRAFT_VOCAB_SIZE, int(target_vocab_size))


def check_draft_vocab_size(draft_vocab_size: int, target_vocab_size: int) -> None:
    """Raise SpecgraftError unless ``1 <= draft_vocab_size <= target_vocab_size``."""
    if not 1 <= int(draft_vocab_size) <= int(target_vocab_size):
        raise SpecgraftError(f"draft_vocab_size {draft_vocab_size} is not within 1..{target_vocab_size} (the target "
                             f"vocabulary size); set head.draft_vocab_size to at most {target_vocab_size} or leave "
                             "it unset for min(32000, vocab)")


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Choose the ``draft_vocab_size`` most frequent target tokens.

    Args:
        token_counts: [V] counts (any numeric dtype) of each target token among the training loss tokens.
        draft_vocab_size: Vd, at most V.

    Returns:
        ``(d2t, t2d, coverage)``: d2t int64 [Vd] offsets (target_id = draft_id + d2t[draft_id]), t2d bool [V], and
        the fraction of counted tokens that fall in the draft vocabulary (0.0 when the counts are all zero).
        Ties in count are broken by the smaller token id, so the result is deterministic.
    """
    counts = torch.as_tensor(token_counts).detach().cpu()
    if counts.dim() != 1:
        raise SpecgraftError(f"token counts must be a 1-D tensor of per-token counts, got shape {tuple(counts.shape)}")
    vocab = counts.numel()
    check_draft_vocab_size(draft_vocab_size, vocab)
    if counts.is_floating_point() and not torch.isfinite(counts).all():
        raise SpecgraftError("token counts contain NaN or infinite values; recount the training data's tokens")
    if (counts < 0).any():
        raise SpecgraftError("token counts contain negative values; recount the training data's tokens")
    # A stable descending sort keeps equal counts in ascending id order: ties go to the smaller id.
    order = torch.sort(counts.double(), descending=True, stable=True).indices[: int(draft_vocab_size)]
    chosen = torch.sort(order).values.to(torch.int64)  # [Vd] target ids, ascending
    d2t = chosen - torch.arange(chosen.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d, vocab_coverage(t2d, counts)


def vocab_coverage(t2d: torch.Tensor, token_counts: torch.Tensor) -> float:
    """The fraction of the counted tokens (counts [V]) that lie in the draft vocabulary (t2d bool [V]); 0.0 when
    nothing was counted."""
    counts = torch.as_tensor(token_counts).detach().cpu().double()
    mask = torch.as_tensor(t2d).detach().cpu().bool()
    if counts.shape != mask.shape:
        raise SpecgraftError(f"token counts have shape {tuple(counts.shape)} but t2d has {tuple(mask.shape)}; count "
                             "tokens with the target's tokenizer")
    total = float(counts.sum())
    return float(counts[mask].sum()) / total if total > 0 else 0.0


def check_counts(vocab_size: int, token_counts: torch.Tensor | None,
                 heldout_counts: torch.Tensor | None = None) -> None:
    """One error naming the fix for counts [V] (training or held-out) whose shape is not the target vocabulary's."""
    for name, given in (("token counts", token_counts), ("held-out token counts", heldout_counts)):
        counts = None if given is None else torch.as_tensor(given)
        if counts is not None and (counts.dim() != 1 or counts.numel() != vocab_size):
            raise SpecgraftError(f"{name} have shape {tuple(counts.shape)} but the target vocabulary has "
                                 f"{vocab_size} entries; count tokens with the target's tokenizer "
                                 "(token_frequencies(ds, vocab))")


def assign_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor, token_counts: torch.Tensor) -> None:
    """Choose the draft vocabulary (:func:`build_draft_vocab`, of ``d2t``'s size) from ``token_counts`` [V] and
    write it into a head's ``d2t`` [Vd] / ``t2d`` [V] buffers in place (the head then re-initialises its output rows
    for it)."""
    new_d2t, new_t2d, _ = build_draft_vocab(torch.as_tensor(token_counts), d2t.numel())
    d2t.copy_(new_d2t.to(d2t.device))
    t2d.copy_(new_t2d.to(t2d.device))


def coverage_facts(t2d: torch.Tensor, token_counts: torch.Tensor,
                   heldout_counts: torch.Tensor | None = None) -> dict[str, float | int]:
    """The coverage facts a reduced draft vocabulary (t2d bool [V]) logs for the training counts [V] and, when any
    tokens were held out, for those: ``draft_vocab_size``, ``draft_vocab_train_coverage``,
    ``draft_vocab_coverage`` and ``draft_vocab_heldout_tokens``."""
    facts: dict[str, float | int] = {"draft_vocab_size": int(torch.as_tensor(t2d).sum()),
                                     "draft_vocab_train_coverage": vocab_coverage(t2d, token_counts)}
    heldout_tokens = 0 if heldout_counts is None else int(torch.as_tensor(heldout_counts).sum())
    if heldout_tokens > 0:
        facts["draft_vocab_coverage"] = vocab_coverage(t2d, heldout_counts)
        facts["draft_vocab_heldout_tokens"] = heldout_tokens
    return facts


def heldout_rows(num_rows: int, heldout_every: int) -> tuple[list[int], list[int]]:
    """Split row indices into (rows to count the vocabulary from, held-out rows to measure coverage on).

    Every ``heldout_every``-th row is held out (rows ``every-1, 2*every-1, ...``: deterministic and spread over the
    whole file, whatever its order). With ``heldout_every`` 0, or too few rows to hold one out and keep one, every
    row is counted and none is held out.
    """
    if heldout_every < 0 or heldout_every == 1:
        raise SpecgraftError(f"draft_vocab_heldout_every is {heldout_every}; use 0 (no hold-out) or 2 or more "
                             "(1 would hold out every row)")
    if heldout_every == 0 or num_rows < heldout_every:
        return list(range(num_rows)), []
    held = set(range(heldout_every - 1, num_rows, heldout_every))
    return [i for i in range(num_rows) if i not in held], sorted(held)


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target id of every draft id (``arange(Vd) + d2t``)."""
    return torch.arange(d2t.numel(), device=d2t.device, dtype=d2t.dtype) + d2t
