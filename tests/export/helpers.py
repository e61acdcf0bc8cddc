"""Helpers for export tests: tiny targets saved to disk (export reads the target's config from its folder) and
heads with non-trivial weights (a fresh Medusa head is the identity, which would hide a wrong mapping)."""

from __future__ import annotations

from pathlib import Path

import torch

from specgraft.heads.base import head_class
from specgraft.heads.layers import causal_additive_mask
from specgraft.target import Target, load_target
from specgraft.testing import tiny_model, tiny_tokenizer

#: Small head configs per type; EAGLE-3 fuses output_hidden_states 1..3 of a 4-layer target.
HEAD_CONFIGS = {
    "medusa": dict(num_heads=2, num_layers=1, hidden_size=64, vocab_size=320),
    "eagle": dict(num_layers=1),
    "eagle3": dict(feature_layers=[1, 2, 3], draft_vocab_size=100, num_layers=1),
}


def save_tiny_target(folder: Path, arch: str = "llama", **overrides) -> Target:
    """A tiny ``arch`` target saved to ``folder`` (model + tokenizer) and loaded back from there."""
    tiny_model(arch, **overrides).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return load_target(folder)


def save_target_gguf(target: Target, path: Path) -> Path:
    """``target`` as llama.cpp's ``llama`` GGUF with its tokenizer's token strings (what ``--target-gguf`` reads)."""
    from specgraft.export.llamacpp import write_target_gguf

    tokens = target.tokenizer.convert_ids_to_tokens(list(range(len(target.tokenizer))))
    return write_target_gguf(target.model, tokens, path)


def export_kwargs(fmt: str, target_gguf: Path) -> dict:
    """What ``export_head`` needs besides the format: the target GGUF for llama.cpp."""
    return {"target_gguf": target_gguf} if fmt == "llamacpp" else {}


def make_head(target: Target, head_type: str, seed: int = 0, **overrides):
    """A head of ``head_type`` on ``target`` with every weight perturbed (and a data-chosen EAGLE-3 vocab)."""
    cls = head_class(head_type)
    cfg = dict(HEAD_CONFIGS[head_type], **overrides)
    if head_type == "medusa":
        cfg.update(hidden_size=target.hidden_size, vocab_size=target.vocab_size)
    config = cls.Config(**cfg)
    torch.manual_seed(seed)
    head = cls.build(target, config)
    if head_type == "eagle3":
        head.prepare_from_data(torch.randint(0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


def head_outputs(head, target: Target, seed: int = 0) -> torch.Tensor:
    """The head's logits on fixed inputs: Medusa [K, B, T, V]; EAGLE draft logits [B, T, V or Vd]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 262, (2, 10), generator=g)
    out = target(ids, layers=head.required_layers(), logits=False)
    with torch.no_grad():
        if head.head_type == "medusa":
            return head(out.hidden_states[target.num_layers])
        hidden = head.input_features(out.hidden_states)
        positions = torch.arange(ids.shape[1])[None]
        mask = causal_additive_mask(ids.shape[1], None, hidden.dtype, hidden.device)
        _, logits = head.draft_forward(ids, hidden, positions, mask)
        return logits
