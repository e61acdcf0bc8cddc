"""A maintained client reads our EAGLE-3 vLLM export: the speculators package loads it on CPU and its draft layer
gives our draft's outputs (skipped when speculators is not installed)."""

from __future__ import annotations

import pytest
import torch

from specgraft.export import export_head
from specgraft.heads.layers import causal_additive_mask

from .helpers import make_head, save_tiny_target

speculators = pytest.importorskip("speculators")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculators_loads_our_eagle3_export(arch, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel

    target = save_tiny_target(tmp_path / "target", arch)
    head = make_head(target, "eagle3")
    out = export_head(head.save_pretrained(tmp_path / "head"), "vllm", tmp_path / "draft-eagle3").path
    draft = Eagle3DraftModel.from_pretrained(str(out)).eval()
    draft.config.transformer_layer_config._attn_implementation = "sdpa"
    assert draft.config.norm_before_residual is False
    assert torch.equal(draft.d2t.long(), head.d2t) and torch.equal(draft.t2d.bool(), head.t2d)

    ids = torch.randint(6, 262, (1, 12), generator=torch.Generator().manual_seed(0))
    out_t = target(ids, layers=head.required_layers(), logits=False)
    fused = torch.cat([out_t.hidden_states[i] for i in head.config.feature_layers], dim=-1)  # [1, T, 3h]
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        hidden = head.input_features(out_t.hidden_states)
        mask = causal_additive_mask(ids.shape[1], None, hidden.dtype, hidden.device)
        ours, our_logits = head.draft_forward(ids, hidden, positions, mask)
        g = draft.fc(fused)
        theirs = draft.layers[0](torch.cat([target.embed(ids), g], dim=-1), attention_mask=None,
                                 position_ids=positions, position_embeddings=draft.rotary_emb(g, positions))
        their_logits = draft.lm_head(draft.norm(theirs))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(their_logits, our_logits, rtol=1e-5, atol=1e-5)
