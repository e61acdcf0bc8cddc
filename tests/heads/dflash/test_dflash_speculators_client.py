"""A maintained client reads our DFlash export: the speculators package's DFlashDraftModel loads it on CPU (its
verifier: the tiny target saved beside it) and drafts the same block logits (skipped without speculators).

Checked on this machine with speculators 0.9.0 from PyPI installed beside the suite (``pip install --no-deps
--target DIR speculators openai hs-connectors loguru``, then ``PYTHONPATH=DIR``)."""

from __future__ import annotations

import pytest
import torch

from specgraft.heads.dflash.export import save_speculators_export
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

from .helpers import make_head

dflash_models = pytest.importorskip("speculators.models.dflash")


@pytest.mark.parametrize(("arch", "draft_vocab_size"), [("llama", 0), ("qwen3", 0), ("mistral", 100)])
def test_speculators_drafts_what_we_draft(tmp_path, arch, draft_vocab_size):
    model, tokenizer = tiny_model(arch), tiny_tokenizer()
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    target = Target(model, tokenizer)
    head = make_head(target, block_size=4, num_layers=2, draft_vocab_size=draft_vocab_size, draft_layers="qwen3")
    if draft_vocab_size:
        head.prepare_from_data(torch.randint(0, 40, (target.vocab_size,), generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():  # trained-looking norms and lm_head, so a client that re-initialises them would differ
        for name, p in head.named_parameters():
            if "norm" in name or "lm_head" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    head.eval()
    out = save_speculators_export(head, tmp_path / "export", base_model=str(tmp_path / "target"))
    draft = dflash_models.DFlashDraftModel.from_pretrained(str(out)).eval()
    for layer in draft.layers:
        layer.self_attn.config._attn_implementation = "eager"
    if draft_vocab_size:
        assert torch.equal(draft.d2t.long(), head.d2t) and torch.equal(draft.t2d.bool(), head.t2d)

    ids = torch.randint(6, 262, (1, 10), generator=torch.Generator().manual_seed(0))
    states = target(ids, layers=head.required_layers()).hidden_states
    block = torch.full((1, 4), head.config.mask_token_id)
    block[0, 0] = 77
    positions = torch.arange(14)[None]  # 10 context positions, then the block
    with torch.no_grad():
        ours = head.block_logits(head.block_forward(head.embed(block), head.context_features(states), positions,
                                                    None))
        fused = torch.cat([states[i] for i in head.config.aux_layer_ids], dim=-1)
        context = draft.hidden_norm(draft.fc(fused))
        x = target.embed(block)
        rope = draft.rotary_emb(x, positions)
        for layer in draft.layers:
            x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_ids=positions,
                      position_embeddings=rope)
        theirs = draft.lm_head(draft.norm(x))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
