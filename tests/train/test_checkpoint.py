"""Checkpoints: atomic, checksummed, pickle-free; corrupt ones are skipped; a full disk loses nothing."""

from __future__ import annotations

import errno
import logging
import random

import numpy as np
import pytest
import torch

from specgraft.train import checkpoint as ckpt


def _save(out, step, payload=b"weights"):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()

    def write(folder):
        (folder / "model").mkdir()
        (folder / "model" / "w.bin").write_bytes(payload)

    return ckpt.save_checkpoint(out, step, write, opt.state_dict(), {"step": step}, keep=3), opt


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    folder, opt = _save(tmp_path, 1)
    state, restored = ckpt.load_checkpoint_state(folder)
    assert state["step"] == 1
    original = opt.state_dict()
    assert restored["param_groups"] == original["param_groups"]
    for idx, values in original["state"].items():
        for name, value in values.items():
            torch.testing.assert_close(restored["state"][idx][name], value, rtol=0, atol=0)
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    fresh.load_state_dict(restored)


def test_rng_state_round_trips():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    state = ckpt.capture_rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    ckpt.restore_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]


def test_corrupt_and_partial_checkpoints_fall_back_to_the_previous_good_one(tmp_path, caplog):
    good, _ = _save(tmp_path, 1)
    newest, _ = _save(tmp_path, 2)
    assert ckpt.latest_good_checkpoint(tmp_path) == newest
    blob = newest / "model" / "w.bin"
    blob.write_bytes(b"weightz")  # same size, different content
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest_good_checkpoint(tmp_path) == good
    assert "does not match its checksum" in caplog.text and str(newest) in caplog.text

    partial = tmp_path / ckpt.CHECKPOINTS_DIR / ckpt.checkpoint_name(3)
    partial.mkdir()
    (partial / ckpt.STATE).write_text("{}")
    assert ckpt.verify_checkpoint(partial) == "no manifest (partial write)"
    assert ckpt.latest_good_checkpoint(tmp_path) == good


def test_disk_full_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    previous, _ = _save(tmp_path, 1)
    before = {p.name: p.read_bytes() for p in previous.rglob("*") if p.is_file()}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [previous.name]
    assert {p.name: p.read_bytes() for p in previous.rglob("*") if p.is_file()} == before
    assert not [p for p in (tmp_path / ckpt.CHECKPOINTS_DIR).iterdir() if p.name.startswith(".")]
    assert ckpt.latest_good_checkpoint(tmp_path) == previous


def test_rotation_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-0000005", "step-0000004", "step-0000003"]
