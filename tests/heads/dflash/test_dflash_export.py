"""DFlash speculators/vLLM export: exact names, config keys, a round trip with identical logits, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specgraft.errors import SpecgraftError
from specgraft.heads.dflash.config import resolve_dflash_config
from specgraft.heads.dflash.drafter import DFlashDrafter
from specgraft.heads.dflash.export import (
    CONFIG_KEYS,
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_is_dflash,
    expected_speculators_names,
    load_speculators_export,
    save_speculators_export,
    speculators_config,
    speculators_state_dict,
)
from specgraft.heads.dflash.model import DFlashHead
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

from .helpers import context_for

#: The names written by hand from speculators' Qwen3DFlashDecoderLayer / DFlashDraftModel for 2 layers.
LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
TWO_LAYERS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in (0, 1) for n in LAYER}


def make_head(arch: str = "qwen3", seed: int = 2, **fields) -> DFlashHead:
    target = Target(tiny_model(arch), tiny_tokenizer())
    torch.manual_seed(seed)
    head = DFlashHead.build(target, resolve_dflash_config(target, **fields))
    with torch.no_grad():  # non-trivial norms, so a dropped or swapped norm shows in the logits
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    return head.eval()


@pytest.mark.parametrize(("arch", "fields"), [("qwen3", {}), ("llama", {"draft_layers": "qwen3"}),
                                              ("mistral", {"draft_layers": "qwen3", "draft_vocab_size": 100})])
def test_names_config_and_round_trip(tmp_path, arch, fields):
    head = make_head(arch, block_size=5, num_layers=2, **fields)
    if head.config.reduced_vocab:
        head.prepare_from_data(torch.randint(0, 40, (head.target.vocab_size,),
                                             generator=torch.Generator().manual_seed(1)))
    out = save_speculators_export(head, tmp_path / "export", base_model="org/tiny")
    config = json.loads((out / CONFIG_NAME).read_text())
    tensors = load_file(str(out / WEIGHTS_NAME))
    reduced = {"lm_head.weight", "d2t", "t2d"} if head.config.reduced_vocab else set()
    assert set(tensors) == TWO_LAYERS | reduced == expected_speculators_names(config)
    assert set(config) == CONFIG_KEYS
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["block_size"] == 5 and config["sample_from_anchor"] is False
    assert config["aux_hidden_state_layer_ids"] == head.config.aux_layer_ids
    assert config["mask_token_id"] == head.config.mask_token_id == 262
    assert config["target_hidden_size"] == 64
    assert config["draft_vocab_size"] == (100 if reduced else 320)
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    loaded = load_speculators_export(head.target, out).eval()
    assert loaded.config == head.config
    # Identical drafts: the same block logits for the same context.
    tokens = torch.randint(6, 300, (12,), generator=torch.Generator().manual_seed(0))
    want = DFlashDrafter(head).block_logits(context_for(head.target, tokens, head.required_layers()))
    got = DFlashDrafter(loaded).block_logits(context_for(head.target, tokens, head.required_layers()))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(loaded.draft_token_ids(), head.draft_token_ids()) if reduced else loaded.d2t is None


def test_dflash_export_read_as_eagle3_is_refused(tmp_path):
    head = make_head()
    config = speculators_config(head)
    with pytest.raises(SpecgraftError, match="is a DFlash draft.*not EAGLE-3") as info:
        check_is_dflash(config)
    assert "\n" not in str(info.value)
    check_is_dflash({"speculators_model_type": "eagle3", "speculators_config": {"algorithm": "eagle3"}})  # passes
    # And the DFlash loader refuses an EAGLE-3 export.
    folder = tmp_path / "eagle3"
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(json.dumps({"speculators_model_type": "eagle3", "draft_vocab_size": 320,
                                                  "transformer_layer_config": {"num_hidden_layers": 1}}))
    (folder / WEIGHTS_NAME).write_bytes(b"")
    with pytest.raises(SpecgraftError, match="holds a eagle3 draft, not DFlash"):
        load_speculators_export(head.target, folder)


def test_export_refusals(tmp_path):
    llama_layers = make_head("llama")  # LlamaDecoderLayer: no q_norm/k_norm
    with pytest.raises(SpecgraftError, match="draft_layers: qwen3"):
        speculators_state_dict(llama_layers)
    with pytest.raises(SpecgraftError, match="cannot be captured by vLLM"):
        speculators_state_dict(make_head(aux_layer_ids=[0, 2]))
    with pytest.raises(SpecgraftError, match="scales its input embeddings"):
        speculators_state_dict(make_head("gemma2", draft_layers="qwen3"))
    head = make_head()
    save_speculators_export(head, tmp_path / "e")
    with pytest.raises(SpecgraftError, match="already exists"):
        save_speculators_export(head, tmp_path / "e")
    other = Target(tiny_model("qwen3", hidden_size=32, num_attention_heads=2, head_dim=16), tiny_tokenizer())
    with pytest.raises(SpecgraftError, match="target_hidden_size 64"):
        load_speculators_export(other, tmp_path / "e")
    tensors = load_file(str(tmp_path / "e" / WEIGHTS_NAME))
    del tensors["hidden_norm.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "e" / WEIGHTS_NAME))
    with pytest.raises(SpecgraftError, match=r"missing \['hidden_norm.weight'\]"):
        load_speculators_export(head.target, tmp_path / "e")
