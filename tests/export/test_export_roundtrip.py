"""Every supported (head, format) pair: the exact engine weight names, configs equal to the target's, and a
round trip back into specgraft that reproduces the original head's logits exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specgraft.export import export_head, load_export, read_export_meta, supported_formats
from specgraft.export.target_info import rope_fields
from specgraft.heads.base import load_head

from .helpers import HEAD_CONFIGS, export_kwargs, head_outputs, make_head, save_tiny_target

PAIRS = [(head, fmt) for head, fmts in supported_formats().items() if head in HEAD_CONFIGS for fmt in fmts]

_LLAMA = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"]
_MID = [f"{{p}}.{n}" for n in _LLAMA] + ["{p}.input_layernorm.weight", "{p}.hidden_norm.weight"]

#: The literal weight names each engine reads for the conftest head configs (written out by hand, independent
#: of the layout tables, from the engines' loaders).
EXPECTED_NAMES = {
    ("medusa", "vllm"): {"blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "blocks.1.layers.0.weight",
                         "blocks.1.layers.0.bias", "lm_heads.0.weight", "lm_heads.1.weight"},
    ("medusa", "trtllm"): {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.0.linear.weight",
                           "1.0.linear.bias", "1.1.weight"},
    ("eagle", "vllm"): {"fc.weight", *[f"layers.0.{n}" for n in _LLAMA]},
    ("eagle", "sglang"): {"fc.weight", "fc.bias", *[f"layers.0.{n}" for n in _LLAMA]},
    ("eagle3", "vllm"): {"fc.weight", *[n.format(p="layers.0") for n in _MID], "norm.weight", "lm_head.weight",
                         "d2t", "t2d"},
    ("eagle3", "sglang"): {"fc.weight", *[n.format(p="midlayer") for n in _MID], "norm.weight", "lm_head.weight",
                           "d2t", "t2d"},
    ("eagle3", "trtllm"): {"fc.weight", *[n.format(p="midlayer") for n in _MID], "norm.weight", "lm_head.weight",
                           "d2t"},
    # llama.cpp's eagle3 tensors (src/models/eagle3.cpp): no t2d, no embeddings.
    ("eagle3", "llamacpp"): {"fc.weight", *[f"blk.0.{n}.weight" for n in (
        "attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
        "ffn_down")], "output_norm.weight", "output.weight", "d2t"},
    ("medusa", "native"): {"blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "blocks.1.layers.0.weight",
                           "blocks.1.layers.0.bias", "lm_heads.0.weight", "lm_heads.1.weight"},
}


def _weight_names(folder):
    from specgraft.export.llamacpp import read_gguf

    names = {name for file in folder.glob("*.gguf") for name in read_gguf(file)[1]}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as fh:
            names.update(fh.keys())
    return names


@pytest.mark.parametrize("head_type,fmt", PAIRS)
def test_export_names_config_and_round_trip(head_type, fmt, llama_target, llama_target_gguf, saved_heads, tmp_path):
    head_dir = saved_heads[head_type]
    result = export_head(head_dir, fmt, tmp_path / f"tiny-{head_type}-{fmt}", **export_kwargs(fmt, llama_target_gguf))
    out = result.path
    assert (out / "README.md").is_file() and (out / "specgraft_export.json").is_file()
    assert read_export_meta(out)["format"] == fmt
    if (head_type, fmt) in EXPECTED_NAMES:
        assert _weight_names(out) == EXPECTED_NAMES[(head_type, fmt)]
    assert not list(out.glob("*.pt")) and not list(out.glob("*.bin"))  # safetensors only

    original = load_head(llama_target, head_dir)
    reloaded = load_export(out, llama_target)
    assert type(reloaded) is type(original)
    torch.testing.assert_close(head_outputs(reloaded, llama_target), head_outputs(original, llama_target),
                               rtol=0, atol=0)


@pytest.mark.parametrize("head_type,fmt", [p for p in PAIRS if p[0] != "medusa" and p[1] not in ("native", "llamacpp")])
def test_eagle_configs_match_the_target(head_type, fmt, llama_target, saved_heads, tmp_path):
    out = export_head(saved_heads[head_type], fmt, tmp_path / "x", base_model="org/tiny-llama").path
    config = json.loads((out / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    tc = llama_target.text_config
    for key in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id"):
        assert layer[key] == getattr(tc, key), key
    assert layer["rope_theta"] == rope_fields(tc)["rope_theta"] == 10000.0
    assert layer["rope_scaling"] is None
    assert layer["tie_word_embeddings"] is False
    assert layer["num_hidden_layers"] == 1
    assert layer["torch_dtype"] == "float32"
    if head_type == "eagle3":
        ids = (config.get("eagle_aux_hidden_state_layer_ids")
               or config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        # vLLM/speculators number the residual stream entering layer i; SGLang/TRT-LLM the layer whose output it is.
        assert ids == ([1, 2, 3] if fmt == "vllm" else [0, 1, 2])
        assert config["draft_vocab_size"] == 100
    if fmt == "vllm" and head_type == "eagle3":
        spec = config["speculators_config"]
        assert config["speculators_model_type"] == "eagle3" and spec["algorithm"] == "eagle3"
        assert spec["default_proposal_method"] == "greedy" and spec["proposal_methods"][0]["proposal_type"] == "greedy"
        assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
        assert config["norm_before_residual"] is False and config["target_hidden_size"] == tc.hidden_size
    expected_arch = {("eagle", "vllm"): "LlamaForCausalLM", ("eagle", "sglang"): "LlamaForCausalLMEagle",
                     ("eagle3", "vllm"): "Eagle3Speculator"}.get((head_type, fmt), "LlamaForCausalLMEagle3")
    assert config["architectures"] == [expected_arch]


def test_medusa_configs(saved_heads, tmp_path):
    vllm = json.loads((export_head(saved_heads["medusa"], "vllm", tmp_path / "v").path / "config.json").read_text())
    assert vllm == {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": 64, "vocab_size": 320,
                    "num_heads": 2, "num_hidden_layers": 1, "truncated_vocab_size": 320, "medusa_fc_bias": True,
                    "original_lm_head": False, "torch_dtype": "float32"}
    # vLLM renames every key holding "num" and "heads"/"layers" to num_heads/num_hidden_layers: no other such key.
    assert [k for k in vllm if "num" in k] == ["num_heads", "num_hidden_layers"]
    trt = json.loads((export_head(saved_heads["medusa"], "trtllm", tmp_path / "t",
                                  base_model="org/tiny").path / "config.json").read_text())
    assert trt["medusa_num_heads"] == 2 and trt["medusa_num_layers"] == 1
    assert trt["base_model_name_or_path"] == "org/tiny"


@pytest.mark.parametrize("fmt", ["vllm", "trtllm"])
def test_medusa_shared_lm_head(fmt, llama_target, tmp_path):
    head = make_head(llama_target, "medusa", share_lm_head=True)
    head_dir = head.save_pretrained(tmp_path / "head")
    # The target passed as a folder: its lm_head is read from the safetensors file, not from a loaded model.
    out = export_head(head_dir, fmt, tmp_path / "out", target=llama_target.name_or_path).path
    lm = llama_target.output_head.weight.detach()
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as fh:
        names = set(fh.keys())
        copies = [fh.get_tensor(n) for n in sorted(names) if n.startswith("lm_heads") or n.endswith(".1.weight")]
    if fmt == "vllm":
        assert json.loads((out / "config.json").read_text())["original_lm_head"] is True
        assert {n for n in names if n.startswith("lm_heads")} == {"lm_heads.0.weight"}
    assert copies and all(torch.equal(c, lm) for c in copies)
    torch.testing.assert_close(head_outputs(load_export(out, llama_target), llama_target),
                               head_outputs(head, llama_target), rtol=0, atol=0)


@pytest.mark.parametrize("arch,head_type", [("phi3", "eagle"), ("phi3", "eagle3"), ("qwen2", "eagle"),
                                            ("qwen2", "eagle3"), ("mistral", "eagle3")])
def test_llama_like_families_round_trip_through_vllm(arch, head_type, tmp_path):
    """Phi-3's fused projections are split (and fused back); Qwen2's q/k/v biases become Llama attention biases
    with a zero o_proj bias."""
    target = save_tiny_target(tmp_path / arch, arch)
    head = make_head(target, head_type)
    out = export_head(head.save_pretrained(tmp_path / "head"), "vllm", tmp_path / "out").path
    names = _weight_names(out)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    config = json.loads((out / "config.json").read_text())
    assert config.get("transformer_layer_config", config)["attention_bias"] is (arch == "qwen2")
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        o_bias = [fh.get_tensor(n) for n in names if n.endswith("o_proj.bias")]
    assert (len(o_bias) == 1 and not o_bias[0].any()) if arch == "qwen2" else not o_bias
    torch.testing.assert_close(head_outputs(load_export(out, target), target), head_outputs(head, target),
                               rtol=0, atol=0)


def test_rope_scaling_and_dtype_are_written_as_engines_read_them(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    target = save_tiny_target(tmp_path / "t", "llama", rope_parameters=rope)
    head = make_head(target, "eagle3")
    out = export_head(head.save_pretrained(tmp_path / "h"), "sglang", tmp_path / "o", dtype="bfloat16").path
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 5000.0
    assert config["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": 2.0}
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert fh.get_tensor("fc.weight").dtype == torch.bfloat16
        assert fh.get_tensor("d2t").dtype == torch.int64 and fh.get_tensor("t2d").dtype == torch.bool
    # Reloaded into fp32 the head equals the original rounded to bf16.
    rounded = make_head(target, "eagle3")
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    torch.testing.assert_close(head_outputs(load_export(out, target), target), head_outputs(rounded, target),
                               rtol=0, atol=0)


def test_native_keeps_the_head_folder(saved_heads, llama_target, tmp_path):
    out = export_head(saved_heads["eagle3"], "native", tmp_path / "n").path
    assert {"head.safetensors", "head_config.json"} <= {p.name for p in out.iterdir()}
    assert (out / "head.safetensors").read_bytes() == (saved_heads["eagle3"] / "head.safetensors").read_bytes()
    torch.testing.assert_close(head_outputs(load_head(llama_target, out), llama_target),
                               head_outputs(load_head(llama_target, saved_heads["eagle3"]), llama_target),
                               rtol=0, atol=0)


def test_cli_export(saved_heads, llama_target, tmp_path, capsys):
    from specgraft.cli import main

    code = main(["export", str(saved_heads["eagle"]), "--format", "vllm", "--out", str(tmp_path / "tiny"),
                 "--target", llama_target.name_or_path, "--base-model", "org/tiny", "--repo-id", "org/tiny-eagle-1"])
    out = capsys.readouterr().out
    assert code == 0 and f"to {tmp_path / 'tiny-eagle-1'}" in out and "  model.safetensors" in out
    card = (tmp_path / "tiny-eagle-1" / "README.md").read_text()
    assert 'base_model: "org/tiny"' in card and '"model": "org/tiny-eagle-1", "method": "eagle"' in card


def test_native_casts_and_names_the_base_model(saved_heads, llama_target, tmp_path):
    """A native export for publishing: --dtype casts the floating-point weights (the head then loads as the bf16
    rounding of the trained one), integer buffers are kept, and --base-model replaces the local target path."""
    source = saved_heads["eagle3"]
    out = export_head(source, "native", tmp_path / "n", dtype="bfloat16", base_model="org/tiny").path
    written, original = load_file(str(out / "head.safetensors")), load_file(str(source / "head.safetensors"))
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert written[name].dtype == expected.dtype and torch.equal(written[name], expected), name
    assert any(not t.is_floating_point() for t in original.values())  # the draft vocabulary map is there, uncast
    config = json.loads((out / "head_config.json").read_text())
    assert config["target"]["name_or_path"] == "org/tiny"
    rounded = make_head(llama_target, "eagle3")
    rounded.load_state_dict(original)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    torch.testing.assert_close(head_outputs(load_head(llama_target, out), llama_target),
                               head_outputs(rounded, llama_target), rtol=0, atol=0)
