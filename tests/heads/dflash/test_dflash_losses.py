"""DFlash pure functions: anchors, the block attention mask (enumerated by hand), slot weights, the loss."""

from __future__ import annotations

import math

import pytest
import torch

from specgraft.heads.dflash.losses import (
    block_attention_mask,
    block_label_mask,
    block_positions,
    dflash_loss,
    dflash_position_weights,
    select_anchors,
)


def test_anchors_are_distinct_sorted_labelled_and_fit_their_block():
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1, 1, 1],
                              [0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
                              [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]])
    block = 3
    anchors, valid = select_anchors(loss_mask, block, max_anchors=4, generator=torch.Generator().manual_seed(0))
    # Valid anchors: a label at a and a + 3 <= 10. Row 0: {1, 2, 4, 5, 6, 7}; row 1: {6, 7}; row 2: none (9 > 7).
    allowed = [{1, 2, 4, 5, 6, 7}, {6, 7}, set()]
    assert anchors.shape == valid.shape == (3, 4)
    assert valid.sum(1).tolist() == [4, 2, 0]
    for row, ok in enumerate(allowed):
        chosen = anchors[row][valid[row]].tolist()
        assert chosen == sorted(set(chosen)) and set(chosen) <= ok
    assert anchors[1][valid[1]].tolist() == [6, 7]  # fewer valid positions than max_anchors: all of them
    # The same generator seed gives the same anchors; the sample covers every valid position over seeds.
    again, _ = select_anchors(loss_mask, block, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    seen = set()
    for seed in range(40):
        a, v = select_anchors(loss_mask, block, 2, generator=torch.Generator().manual_seed(seed))
        seen |= set(a[0][v[0]].tolist())
    assert seen == allowed[0]


def test_no_valid_anchor_gives_an_empty_selection():
    anchors, valid = select_anchors(torch.zeros(2, 5, dtype=torch.long), 2, 8)
    assert anchors.shape == (2, 0) and valid.shape == (2, 0)


def test_block_mask_gives_each_query_exactly_its_keys():
    # T = 5 context positions, block size 2, anchors 1 and 3 -> keys [c0 c1 c2 c3 c4 | b0s0 b0s1 b1s0 b1s1].
    visible = block_attention_mask(torch.tensor([[1, 3]]), block_size=2, context_length=5)
    expected_keys = {
        0: {"c0", "b0s0", "b0s1"},  # block 0 (anchor 1): context strictly before the anchor, and its own block
        1: {"c0", "b0s0", "b0s1"},
        2: {"c0", "c1", "c2", "b1s0", "b1s1"},  # block 1 (anchor 3)
        3: {"c0", "c1", "c2", "b1s0", "b1s1"},
    }
    names = [f"c{t}" for t in range(5)] + ["b0s0", "b0s1", "b1s0", "b1s1"]
    assert visible.shape == (1, 4, 9)
    for query, keys in expected_keys.items():
        assert {names[j] for j in range(9) if visible[0, query, j]} == keys
    # Padding keys are hidden.
    padded = block_attention_mask(torch.tensor([[3]]), 2, 5, context_valid=torch.tensor([[0, 1, 1, 1, 1]]))
    assert padded[0, 0].tolist() == [False, True, True, False, False, True, True]


def test_slot_positions_and_label_mask():
    anchors = torch.tensor([[1, 4]])
    assert block_positions(anchors, 3).tolist() == [[1, 2, 3, 4, 5, 6]]
    loss_mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0]])
    mask = block_label_mask(loss_mask, anchors, torch.tensor([[True, False]]), 3)
    # Slot 0 is never scored; slot k is scored when x_{a+k} is a label and the anchor is valid.
    assert mask.tolist() == [[[False, False, True], [False, False, False]]]


def test_position_weights():
    w = dflash_position_weights(5, gamma=4.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)])


def test_loss_equals_a_loop_reference():
    g = torch.Generator().manual_seed(0)
    batch, blocks, bs, vocab = 2, 3, 4, 7
    logits = torch.randn(batch, blocks, bs, vocab, generator=g)
    probs = torch.softmax(torch.randn(batch, blocks, bs, vocab, generator=g), -1)
    mask = torch.rand(batch, blocks, bs, generator=g) > 0.3
    mask[..., 0] = False
    weights = dflash_position_weights(bs, 2.0)
    total, count = 0.0, 0
    for b in range(batch):
        for j in range(blocks):
            for k in range(bs):
                if mask[b, j, k]:
                    log_q = torch.log_softmax(logits[b, j, k].double(), -1)
                    total += math.exp(-(k - 1) / 2.0) * float(-(probs[b, j, k].double() * log_q).sum())
                    count += 1
    assert dflash_loss(logits, probs, mask, weights).item() == pytest.approx(total / count, rel=1e-5)
    assert dflash_loss(logits, probs, torch.zeros_like(mask), weights).item() == 0.0
