"""EAGLE-3's reduced draft vocabulary: the most frequent target tokens of the training data's loss tokens.

Conventions (as the serving engines read them):

* ``d2t`` int64 [Vd]: offsets, ``target_id = draft_id + d2t[draft_id]``; draft ids are the chosen target ids in
  ascending order, so ``d2t`` is non-negative and non-decreasing. When the draft vocabulary is the whole target
  vocabulary ``d2t`` is all zeros -- that is the identity map, not an unset buffer.
* ``t2d`` bool [V]: which target ids are in the draft vocabulary.
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
    total = float(counts.double().sum())
    coverage = float(counts.double()[chosen].sum()) / total if total > 0 else 0.0
    return d2t, t2d, coverage


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target id of every draft id (``arange(Vd) + d2t``)."""
    return torch.arange(d2t.numel(), device=d2t.device, dtype=d2t.dtype) + d2t
