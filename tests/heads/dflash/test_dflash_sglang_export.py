"""DFlash SGLang export (``specgraft export --format sglang``): SGLang's exact checkpoint names and shapes, the
config keys where SGLang's DFlash parser reads them, a round trip with identical drafter logits, the refusals,
and the CLI's one-line errors.

The expected names, shapes and keys are written by hand from SGLang's source (sgl-project/sglang
``python/sglang/srt/models/dflash.py`` @003b23d7, ``DFlashDraftModel.__init__`` / ``load_weights``, and
``python/sglang/srt/speculative/dflash_utils.py`` @00731f0b, ``parse_dflash_draft_config``), not derived from
specgraft's exporter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specgraft.cli import main as cli_main
from specgraft.errors import SpecgraftError
from specgraft.export import export_head, load_export
from specgraft.export.convert import from_engine
from specgraft.heads.dflash.config import resolve_dflash_config
from specgraft.heads.dflash.drafter import DFlashDrafter
from specgraft.heads.dflash.model import DFlashHead
from specgraft.heads.registry import get_family
from specgraft.target import Target, load_target
from specgraft.testing import tiny_model, tiny_tokenizer

from .helpers import context_for

#: Checkpoint names SGLang's DFlashDecoderLayer.load_weights fills per layer (q/k/v are stacked into qkv_proj,
#: gate/up into gate_up_proj; q_norm/k_norm are Qwen3's per-head norms).
SGLANG_LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight"]
#: DFlashDraftModel's own parameters (no embed_tokens, no lm_head: SGLang uses the target's).
SGLANG_TOP = ["fc.weight", "hidden_norm.weight", "norm.weight"]
#: The tiny qwen3 target: hidden 64, 4 heads x head_dim 16, 2 kv heads, intermediate 128, vocab 320, 4 layers.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, TARGET_LAYERS = 64, 4, 2, 16, 128, 320, 4


def sglang_shapes(num_layers: int, num_features: int) -> dict[str, tuple[int, ...]]:
    """The shapes SGLang's modules give each checkpoint name (fc: ReplicatedLinear(K * hidden, hidden))."""
    per_layer = {"self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                 "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                 "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                 "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                 "self_attn.q_norm.weight": (HEAD_DIM,), "self_attn.k_norm.weight": (HEAD_DIM,),
                 "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                 "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
                 "input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,)}
    assert set(per_layer) == set(SGLANG_LAYER)
    shapes = {"fc.weight": (HIDDEN, num_features * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,)}
    for i in range(num_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def save_head(tmp_path: Path, arch: str = "qwen3", seed: int = 3, **fields) -> tuple[Path, Target, DFlashHead]:
    """A tiny ``arch`` target saved to disk and a DFlash head with perturbed weights saved beside it."""
    target_dir = tmp_path / "target"
    tiny_model(arch).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    target = load_target(target_dir)
    torch.manual_seed(seed)
    head = DFlashHead.build(target, resolve_dflash_config(target, **fields))
    with torch.no_grad():  # non-trivial weights and norms, so a dropped or swapped tensor shows in the logits
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if head.config.reduced_vocab:
        head.prepare_from_data(torch.randint(0, 40, (target.vocab_size,), generator=torch.Generator().manual_seed(1)))
    head_dir = head.eval().save_pretrained(tmp_path / "head")
    return head_dir, target, head


def test_sglang_names_shapes_and_config(tmp_path):
    head_dir, target, head = save_head(tmp_path, block_size=5, num_layers=2, aux_layer_ids=[1, 2, 3])
    out = export_head(head_dir, "sglang", tmp_path / "export", target=target).path
    tensors = load_file(str(out / "model.safetensors"))
    want = sglang_shapes(num_layers=2, num_features=3)
    assert set(tensors) == set(SGLANG_TOP) | {f"layers.{i}.{n}" for i in (0, 1) for n in SGLANG_LAYER} == set(want)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == want
    config = json.loads((out / "config.json").read_text())
    # SGLang's model registry picks DFlashDraftModel (its EntryClass) by architectures; AutoConfig needs qwen3.
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 5
    assert config["num_target_layers"] == TARGET_LAYERS
    # SGLang's ids are decoder layers whose output is taken (it captures before layer id + 1): ours minus one.
    assert config["dflash_config"] == {"mask_token_id": head.config.mask_token_id, "target_layer_ids": [0, 1, 2]}
    assert all(0 <= i < config["num_target_layers"] for i in config["dflash_config"]["target_layer_ids"])
    assert config["layer_types"] == ["full_attention", "full_attention"]  # SGLang's non-causal ENCODER_ONLY layer
    assert config["hidden_act"] == "silu" and config["attention_bias"] is False
    assert config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["intermediate_size"], config["vocab_size"]) == (
        HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB)
    assert config["rope_parameters"]["rope_theta"] == 10000.0  # SGLang's get_rope_config reads rope_parameters
    assert not {"speculators_model_type", "speculators_config", "aux_hidden_state_layer_ids", "d2t"} & set(config)
    card = (out / "README.md").read_text()
    assert "--speculative-algorithm DFLASH" in card and "--speculative-num-draft-tokens 5" in card
    assert "--speculative-eagle-topk" not in card
    meta = json.loads((out / "specgraft_export.json").read_text())
    assert any("target_layer_ids [0, 1, 2]" in note for note in meta["notes"])


@pytest.mark.parametrize(("arch", "fields"), [("qwen3", {}), ("llama", {"draft_layers": "qwen3"})])
def test_sglang_round_trip_gives_identical_logits(tmp_path, arch, fields):
    head_dir, target, head = save_head(tmp_path, arch, block_size=4, num_layers=1, **fields)
    out = export_head(head_dir, "sglang", tmp_path / "export", target=target).path
    loaded = load_export(out, target).eval()
    assert isinstance(loaded, DFlashHead) and loaded.config == head.config
    assert loaded.state_dict().keys() == head.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    tokens = torch.randint(6, 300, (12,), generator=torch.Generator().manual_seed(0))
    want = DFlashDrafter(head).block_logits(context_for(target, tokens, head.required_layers()))
    got = DFlashDrafter(loaded).block_logits(context_for(target, tokens, head.required_layers()))
    assert want.shape == (3, VOCAB)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(("arch", "fields", "message"), [
    ("qwen3", {"draft_vocab_size": 100}, "loads no lm_head or d2t.*retrain with head.draft_vocab_size: 0"),
    ("llama", {}, "Qwen3 DFlash layout SGLang loads.*head.draft_layers: qwen3"),
    ("qwen3", {"aux_layer_ids": [0, 2]}, "cannot be captured by SGLang"),
])
def test_sglang_refusals(tmp_path, arch, fields, message):
    head_dir, target, _ = save_head(tmp_path, arch, **fields)
    with pytest.raises(SpecgraftError, match=message) as info:
        export_head(head_dir, "sglang", tmp_path / "export", target=target)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "export").exists()  # nothing half-written


def test_sglang_export_and_eagle3_cross_reads_are_refused(tmp_path):
    head_dir, target, _ = save_head(tmp_path)
    out = export_head(head_dir, "sglang", tmp_path / "export", target=target).path
    config = json.loads((out / "config.json").read_text())
    with pytest.raises(SpecgraftError, match=r"is a DFlash draft \(architectures \['DFlashDraftModel'\]\), "
                                             r"not EAGLE-3") as info:
        from_engine("eagle3", "sglang", {}, config, {"num_layers": 1, "draft_vocab_size": 8}, {})
    assert "\n" not in str(info.value)
    eagle3 = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 100,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    with pytest.raises(SpecgraftError, match="holds a LlamaForCausalLMEagle3 draft, not DFlash"):
        from_engine("dflash", "sglang", {}, eagle3, {}, {})


def test_sglang_export_through_the_cli(tmp_path, capsys):
    head_dir, target, head = save_head(tmp_path, block_size=4)
    out = tmp_path / "export"
    assert cli_main(["export", str(head_dir), "--format", "sglang", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    back = load_export(out, target)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), head.state_dict().values()))
    assert get_family("dflash").formats == ("vllm", "sglang", "llamacpp", "native")
    capsys.readouterr()
    # An existing folder, then a head SGLang cannot serve: exit 2 and one error line each.
    assert cli_main(["export", str(head_dir), "--format", "sglang", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "exists" in err
    reduced_dir, _, _ = save_head(tmp_path / "reduced", draft_vocab_size=100)
    capsys.readouterr()  # saving the tiny target writes progress bars to stderr
    assert cli_main(["export", str(reduced_dir), "--format", "sglang", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "head.draft_vocab_size: 0" in err
    assert not (tmp_path / "no").exists()


def test_sglang_export_rejects_a_tampered_checkpoint(tmp_path):
    head_dir, target, _ = save_head(tmp_path)
    out = export_head(head_dir, "sglang", tmp_path / "export", target=target).path
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN)  # SGLang would skip it silently; our loader refuses
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(SpecgraftError, match=r"lm_head\.weight"):
        load_export(out, target)
