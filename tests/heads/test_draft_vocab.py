"""EAGLE-3 draft vocabulary: top-frequency selection, offsets convention, coverage, bad input."""

from __future__ import annotations

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.heads.draft_vocab import build_draft_vocab, default_draft_vocab_size, draft_to_target_ids


def test_most_frequent_tokens_with_offsets_convention():
    counts = torch.tensor([5, 0, 9, 1, 9, 3, 0, 7])
    d2t, t2d, coverage = build_draft_vocab(counts, 4)
    # Top 4 by count: ids 2 (9), 4 (9), 7 (7), 0 (5); draft ids follow ascending target ids.
    chosen = [0, 2, 4, 7]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [c - i for i, c in enumerate(chosen)]
    assert [i + int(d2t[i]) for i in range(4)] == chosen  # target_id = draft_id + d2t[draft_id]
    assert draft_to_target_ids(d2t).tolist() == chosen
    assert t2d.nonzero().flatten().tolist() == chosen
    assert coverage == pytest.approx((5 + 9 + 9 + 7) / counts.sum().item())


def test_ties_are_broken_by_smaller_token_id():
    counts = torch.tensor([1, 4, 4, 4, 4, 2])
    d2t, t2d, _ = build_draft_vocab(counts, 3)
    assert draft_to_target_ids(d2t).tolist() == [1, 2, 3]
    # Same result however often it runs (deterministic) and for float counts.
    d2t_f, t2d_f, _ = build_draft_vocab(counts.double(), 3)
    assert torch.equal(d2t, d2t_f) and torch.equal(t2d, t2d_f)


def test_full_vocabulary_gives_zero_offsets():
    counts = torch.tensor([3, 0, 2, 1])
    d2t, t2d, coverage = build_draft_vocab(counts, 4)
    assert d2t.tolist() == [0, 0, 0, 0]  # the identity map, not an unset buffer
    assert t2d.all()
    assert coverage == 1.0


def test_empty_counts_take_the_first_ids_with_zero_coverage():
    d2t, t2d, coverage = build_draft_vocab(torch.zeros(6, dtype=torch.long), 2)
    assert draft_to_target_ids(d2t).tolist() == [0, 1]
    assert coverage == 0.0


def test_default_size_is_32k_or_the_vocab():
    assert default_draft_vocab_size(128256) == 32000
    assert default_draft_vocab_size(320) == 320


@pytest.mark.parametrize("size", [0, 9])
def test_bad_draft_vocab_size(size):
    with pytest.raises(SpecgraftError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(8), size)


@pytest.mark.parametrize("counts", [torch.ones(2, 4), torch.tensor([1.0, -1.0, 2.0]),
                                    torch.tensor([1.0, float("nan"), 2.0])])
def test_bad_counts(counts):
    with pytest.raises(SpecgraftError):
        build_draft_vocab(counts, 1)
