"""Heads draft in the target's dtype at decode time (as vLLM and SGLang serve a draft), keep fp32 on disk and in
training, and stay lossless: a bf16 target with a bf16 draft emits exactly what plain bf16 greedy decoding does."""

from __future__ import annotations

import pytest
import torch

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.heads.base import load_head, load_head_for_decoding
from specgraft.heads.dflash.config import resolve_dflash_config
from specgraft.heads.dflash.model import DFlashHead
from specgraft.heads.registry import family_of
from specgraft.target import load_target

from ..export.helpers import make_head, save_tiny_target


def _head(target, head_type: str):
    if head_type == "dflash":
        torch.manual_seed(0)
        return DFlashHead.build(target, resolve_dflash_config(target, block_size=4, draft_vocab_size=100))
    return make_head(target, head_type)


def _floating_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters() if p.is_floating_point()}


@pytest.mark.parametrize("head_type", ["medusa", "eagle3", "dflash"])
def test_a_bf16_target_drafts_with_a_bf16_head_and_stays_lossless(tmp_path, head_type):
    fp32_target = save_tiny_target(tmp_path / "target")
    head_dir = _head(fp32_target, head_type).save_pretrained(tmp_path / "head")

    target = load_target(tmp_path / "target", dtype="bfloat16")
    assert _floating_dtypes(load_head(target, head_dir)) == {torch.float32}  # as saved and trained
    head = load_head_for_decoding(target, head_dir)
    assert _floating_dtypes(head) == {torch.bfloat16}
    if head_type != "medusa":
        assert head.d2t.dtype == torch.int64  # integer buffers (the draft vocabulary map) keep their dtype

    family = family_of(head)
    drafter = family.drafter(head, family.setting_from_flags())
    prompt = torch.randint(6, 300, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = SpeculativeDecoder(target, ignore_eos=True).generate(prompt, 16)
    spec = SpeculativeDecoder(target, drafter=drafter, ignore_eos=True).generate(prompt, 16)
    assert spec.generated_ids == plain.generated_ids
    assert spec.num_steps <= plain.num_steps


def test_an_fp32_target_leaves_the_head_in_fp32(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    head_dir = make_head(target, "eagle3").save_pretrained(tmp_path / "head")
    assert _floating_dtypes(load_head_for_decoding(target, head_dir)) == {torch.float32}
