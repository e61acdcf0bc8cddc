"""Round trip on the real stories260K target (llama2.c, converted): every supported format reproduces the
head's logits exactly (skipped without ../shared/data)."""

from __future__ import annotations

import pytest
import torch

from specgraft.export import export_head, load_export, supported_formats
from specgraft.heads.base import load_head
from specgraft.target import load_target

from .helpers import export_kwargs, head_outputs, make_head, save_target_gguf

pytestmark = pytest.mark.shared


@pytest.fixture(scope="module")
def stories_target(stories260k_dir):
    return load_target(stories260k_dir)


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_stories260k_round_trip(head_type, stories_target, tmp_path):
    overrides = {}
    if head_type == "eagle3":
        # EAGLE-3's default (2, N//2, N-3) for this 5-layer target, inside the range engines capture.
        overrides = {"feature_layers": stories_target.default_eagle3_layers(), "draft_vocab_size": 256}
    head = make_head(stories_target, head_type, **overrides)
    head_dir = head.save_pretrained(tmp_path / "head")
    reference = head_outputs(load_head(stories_target, head_dir), stories_target)
    target_gguf = save_target_gguf(stories_target, tmp_path / "stories260K.gguf")
    for fmt in supported_formats()[head_type]:
        out = export_head(head_dir, fmt, tmp_path / f"stories-{fmt}", **export_kwargs(fmt, target_gguf)).path
        torch.testing.assert_close(head_outputs(load_export(out, stories_target), stories_target), reference,
                                   rtol=0, atol=0, msg=f"{head_type} via {fmt}")
