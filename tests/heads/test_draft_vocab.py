"""EAGLE-3 draft vocabulary: top-frequency selection, offsets convention, coverage, bad input."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.heads.draft_vocab import (
    build_draft_vocab,
    default_draft_vocab_size,
    draft_to_target_ids,
    heldout_rows,
    vocab_coverage,
)


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


def test_vocab_coverage_is_the_counted_share_inside_the_vocab():
    t2d = torch.tensor([True, False, True, False])
    assert vocab_coverage(t2d, torch.tensor([3, 5, 1, 1])) == pytest.approx(4 / 10)
    assert vocab_coverage(t2d, torch.zeros(4)) == 0.0
    with pytest.raises(SpecgraftError, match="shape"):
        vocab_coverage(t2d, torch.ones(5))


def test_heldout_rows_take_every_nth_row():
    counted, held = heldout_rows(45, 20)
    assert held == [19, 39] and counted == [i for i in range(45) if i not in (19, 39)]
    assert heldout_rows(19, 20) == (list(range(19)), [])  # too few rows to hold one out: count them all
    assert heldout_rows(7, 0) == (list(range(7)), [])  # 0 = no hold-out
    with pytest.raises(SpecgraftError, match="draft_vocab_heldout_every"):
        heldout_rows(10, 1)


def test_trainer_reports_coverage_on_heldout_rows(tiny_llama, tmp_path):
    """Reference: a Zipf-like token stream in rows; the vocabulary is counted on the rows that are not every 4th,
    coverage is measured on every 4th row's loss tokens (and the training coverage on the counted rows)."""
    import datasets

    from specgraft.config import DataConfig, ModelConfig, OutputConfig, Recipe
    from specgraft.heads.eagle3.config import Eagle3Config
    from specgraft.target import Target
    from specgraft.train.trainer import HeadTrainer

    vocab, vd, every = tiny_llama.config.vocab_size, 40, 4
    gen = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.double)  # heavy tail: held-out rows meet unseen tokens
    rows = [torch.multinomial(zipf, 24, replacement=True, generator=gen).tolist() for _ in range(40)]
    masks = [[int(t % 3 != 0) for t in range(24)] for _ in rows]  # prompt tokens (mask 0) are never counted
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": masks})

    def loss_counts(indices):
        return Counter(t for i in indices for t, m in zip(rows[i], masks[i]) if m)

    counted = loss_counts([i for i in range(40) if i % every != every - 1])
    held = loss_counts(range(every - 1, 40, every))
    chosen = set(sorted(counted, key=lambda t: (-counted[t], t))[:vd])
    expected_heldout = sum(n for t, n in held.items() if t in chosen) / sum(held.values())
    expected_train = sum(n for t, n in counted.items() if t in chosen) / sum(counted.values())

    recipe = Recipe(model=ModelConfig("tiny"), data=DataConfig("unused"), output=OutputConfig(str(tmp_path / "o")),
                    head=Eagle3Config(draft_vocab_size=vd, draft_vocab_heldout_every=every))
    target = Target(tiny_llama)
    trainer = HeadTrainer(recipe, target=target, dataset=ds, show_progress=False)
    trainer.build_model(target)
    facts = trainer.data_facts
    assert set(draft_to_target_ids(trainer.head.d2t).tolist()) == chosen
    assert facts["draft_vocab_coverage"] == pytest.approx(expected_heldout)
    assert facts["draft_vocab_train_coverage"] == pytest.approx(expected_train)
    assert facts["draft_vocab_heldout_tokens"] == sum(held.values())
    assert facts["draft_vocab_coverage"] < facts["draft_vocab_train_coverage"]  # what the hold-out is for

    # Negative control: with no hold-out the vocabulary is counted on every row and only the training coverage is
    # reported.
    recipe.head.draft_vocab_heldout_every = 0
    trainer = HeadTrainer(recipe, target=target, dataset=ds, show_progress=False)
    trainer.build_model(target)
    every_row = loss_counts(range(40))
    chosen_all = set(sorted(every_row, key=lambda t: (-every_row[t], t))[:vd])
    assert set(draft_to_target_ids(trainer.head.d2t).tolist()) == chosen_all
    assert "draft_vocab_coverage" not in trainer.data_facts
    assert trainer.data_facts["draft_vocab_train_coverage"] == pytest.approx(
        sum(n for t, n in every_row.items() if t in chosen_all) / sum(every_row.values()))
