"""The drafter protocol's helpers."""

from __future__ import annotations

import pytest
import torch

from specgraft.decoding.drafter import eval_mode


def test_eval_mode_restores_training_and_leaves_an_eval_module_untouched(monkeypatch):
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with eval_mode(module):
        assert not module.training and not module[1].training
    assert module.training and module[1].training
    with pytest.raises(RuntimeError), eval_mode(module):
        raise RuntimeError("a failing draft step")
    assert module.training and module[1].training  # restored on an error too

    module.eval()
    walked: list[bool] = []
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: walked.append(mode))
    with eval_mode(module):
        pass
    assert walked == []  # already in eval mode: the module tree is not walked every draft step
