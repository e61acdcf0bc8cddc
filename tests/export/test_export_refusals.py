"""Bad input: clear one-line refusals, never a silently wrong export."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from specgraft.cli import main
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.export import export_head
from specgraft.export.exporter import export_path, vllm_method_from_path

from .helpers import make_head, save_tiny_target


@pytest.mark.parametrize("head_type,fmt,allowed", [("medusa", "sglang", "vllm, trtllm, native"),
                                                   ("eagle", "trtllm", "vllm, sglang, native")])
def test_format_that_cannot_hold_the_head_is_refused(head_type, fmt, allowed, saved_heads, tmp_path):
    with pytest.raises(SpecgraftError, match=f"cannot hold a {head_type} head; export it as one of {allowed}"):
        export_head(saved_heads[head_type], fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_refusal_is_one_error_line(saved_heads, tmp_path, capsys):
    code = main(["export", str(saved_heads["medusa"]), "--format", "sglang", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [err[0]] and err[0].startswith("error: the sglang format cannot hold a medusa head")


def test_non_empty_output_is_refused_unless_overwrite(saved_heads, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(SpecgraftError, match="is not empty.*--overwrite"):
        export_head(saved_heads["medusa"], "vllm", out)
    assert (out / "keep.txt").read_text() == "x"
    # --overwrite replaces an earlier export only, never a folder another program wrote.
    with pytest.raises(SpecgraftError, match="written by another program"):
        export_head(saved_heads["medusa"], "vllm", out, overwrite=True)
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    export_head(saved_heads["medusa"], "native", out)
    result = export_head(saved_heads["medusa"], "vllm", out, overwrite=True)
    assert result.path == out and not (out / "head.safetensors").exists() and (out / "model.safetensors").is_file()


def test_output_cannot_be_the_head_folder(saved_heads):
    with pytest.raises(SpecgraftError, match="is the input"):
        export_head(saved_heads["medusa"], "native", saved_heads["medusa"], overwrite=True)


def test_head_checkpoint_with_missing_tensors(saved_heads, tmp_path):
    import shutil

    head_dir = tmp_path / "broken"
    shutil.copytree(saved_heads["eagle3"], head_dir)
    state = load_file(str(head_dir / "head.safetensors"))
    del state["midlayer.hidden_norm.weight"]
    save_file(state, str(head_dir / "head.safetensors"))
    with pytest.raises(SpecgraftError, match=r"missing tensors \['midlayer.hidden_norm.weight'\]"):
        export_head(head_dir, "vllm", tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


def test_head_for_another_target_is_refused(saved_heads, tmp_path):
    other = save_tiny_target(tmp_path / "wide", "llama", hidden_size=96, num_attention_heads=4)
    with pytest.raises(TargetMismatchError, match="hidden_size 64 vs 96"):
        export_head(saved_heads["eagle"], "vllm", tmp_path / "out", target=other.name_or_path)


def test_unreadable_target_asks_for_target(llama_target, tmp_path):
    head = make_head(llama_target, "eagle")
    head.target_identity = type(head.target_identity)(**{**head.target_identity.to_dict(),
                                                         "name_or_path": str(tmp_path / "gone")})
    head_dir = head.save_pretrained(tmp_path / "h")
    with pytest.raises(SpecgraftError, match="pass --target PATH"):
        export_head(head_dir, "vllm", tmp_path / "out")
    assert export_head(head_dir, "vllm", tmp_path / "out", target=llama_target.name_or_path).path.is_dir()


def test_layers_the_llama_layout_cannot_hold(tmp_path):
    target = save_tiny_target(tmp_path / "qwen3", "qwen3")
    head_dir = make_head(target, "eagle3").save_pretrained(tmp_path / "h")
    with pytest.raises(SpecgraftError, match=r"cannot hold tensors \['midlayer.self_attn.k_norm.weight'.*native"):
        export_head(head_dir, "vllm", tmp_path / "out")
    assert export_head(head_dir, "native", tmp_path / "native").path.is_dir()


def test_biases_only_where_the_engine_has_them(llama_target, tmp_path):
    head_dir = make_head(llama_target, "eagle", fc_bias=True).save_pretrained(tmp_path / "h")
    with pytest.raises(SpecgraftError, match="no fc bias .*export it as one of sglang, native"):
        export_head(head_dir, "vllm", tmp_path / "out")
    out = export_head(head_dir, "sglang", tmp_path / "sg").path
    assert load_file(str(out / "model.safetensors"))["fc.bias"].abs().sum() > 0
    qwen2 = save_tiny_target(tmp_path / "qwen2", "qwen2")
    biased = make_head(qwen2, "eagle3").save_pretrained(tmp_path / "q")
    with pytest.raises(SpecgraftError, match="no attention biases.*vllm, native"):
        export_head(biased, "sglang", tmp_path / "q-out")
    fc_biased = make_head(llama_target, "eagle3", fc_bias=True).save_pretrained(tmp_path / "fb")
    with pytest.raises(SpecgraftError, match="no fc bias.*trtllm, native"):
        export_head(fc_biased, "sglang", tmp_path / "fb-out")
    trt = export_head(fc_biased, "trtllm", tmp_path / "fb-trt").path
    assert json.loads((trt / "config.json").read_text())["bias"] is True
    assert "fc.bias" in load_file(str(trt / "model.safetensors"))


def test_sglang_eagle_without_fc_bias_gets_a_zero_bias(saved_heads):
    out = export_head(saved_heads["eagle"], "sglang", saved_heads["eagle"].parent / "sg-zero").path
    bias = load_file(str(out / "model.safetensors"))["fc.bias"]
    assert bias.shape == (64,) and not bias.any()


@pytest.mark.parametrize("layers,match", [([0, 2, 3], r"\[0\] cannot be captured"),
                                          ([1, 2, 4], r"\[4\] cannot be captured"),
                                          ([1, 2], "exactly 3 fused target layers")])
def test_eagle3_layers_engines_cannot_capture(layers, match, llama_target, tmp_path):
    head_dir = make_head(llama_target, "eagle3", feature_layers=layers).save_pretrained(tmp_path / "h")
    with pytest.raises(SpecgraftError, match=match):
        export_head(head_dir, "vllm", tmp_path / "out")


def test_multi_layer_eagle3_only_where_the_layout_has_room(llama_target, tmp_path):
    head_dir = make_head(llama_target, "eagle3", num_layers=2).save_pretrained(tmp_path / "h")
    with pytest.raises(SpecgraftError, match="exactly one draft layer.*vllm or native"):
        export_head(head_dir, "sglang", tmp_path / "out")
    out = export_head(head_dir, "vllm", tmp_path / "v-eagle3").path
    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.1.input_layernorm.weight" in names and "layers.0.hidden_norm.weight" in names


def test_unknown_format_and_dtype(saved_heads, tmp_path):
    with pytest.raises(SpecgraftError, match="unknown export format 'onnx'"):
        export_head(saved_heads["medusa"], "onnx", tmp_path / "o")
    with pytest.raises(SpecgraftError, match="unknown dtype 'int8'"):
        export_head(saved_heads["medusa"], "vllm", tmp_path / "o", dtype="int8")


# -- vLLM's name-based method detection ---------------------------------------------------------------------------


def test_vllm_method_detection_rules():
    # vLLM checks "eagle-" before "eagle3", so a name with both is served as EAGLE-1.
    assert vllm_method_from_path("org/EAGLE-LLaMA3-Instruct-8B") == "eagle"
    assert vllm_method_from_path("org/llama-eagle3") == "eagle3"
    assert vllm_method_from_path("runs/my-eagle-eagle3") == "eagle"
    assert vllm_method_from_path("runs/llama-medusa") is None


def test_vllm_export_names_say_what_the_head_is(saved_heads, tmp_path):
    # A Hub id as the base model: a local target path would add its own warning.
    eagle = export_head(saved_heads["eagle"], "vllm", tmp_path / "llama", base_model="org/tiny-llama")
    eagle3 = export_head(saved_heads["eagle3"], "vllm", tmp_path / "llama", base_model="org/tiny-llama")
    assert eagle.path.name == "llama-eagle-1" and eagle.warnings == []
    assert eagle3.path.name == "llama-eagle3" and eagle3.warnings == []
    assert vllm_method_from_path(str(eagle.path)) == "eagle" and vllm_method_from_path(str(eagle3.path)) == "eagle3"
    kept = export_head(saved_heads["eagle3"], "vllm", tmp_path / "plain", keep_name=True)
    assert kept.path.name == "plain" and "lacks 'eagle3'" in kept.warnings[0]
    # Only the vllm format is renamed.
    assert export_head(saved_heads["eagle3"], "sglang", tmp_path / "sg").path.name == "sg"


def test_misleading_vllm_names_warn(saved_heads, tmp_path):
    medusa = export_head(saved_heads["medusa"], "vllm", tmp_path / "eagle3-vs-medusa")
    assert "vLLM will serve this medusa head as eagle3" in medusa.warnings[0]
    path, warnings = export_path(tmp_path / "my-eagle-draft", "eagle3", "vllm")
    assert path.name == "my-eagle-draft-eagle3" and "as EAGLE-1" in warnings[0]


def test_export_writes_nothing_on_failure(saved_heads, tmp_path, monkeypatch):
    import specgraft.export.exporter as exporter

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(exporter, "card_from_export_meta", boom)
    with pytest.raises(RuntimeError):
        export_head(saved_heads["medusa"], "vllm", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_corrupt_head_config(saved_heads, tmp_path):
    import shutil

    head_dir = tmp_path / "h"
    shutil.copytree(saved_heads["medusa"], head_dir)
    meta = json.loads((head_dir / "head_config.json").read_text())
    meta["config"]["num_heads"] = 3  # the weights hold 2 heads
    (head_dir / "head_config.json").write_text(json.dumps(meta))
    with pytest.raises(SpecgraftError, match="missing tensors.*blocks.2"):
        export_head(head_dir, "vllm", tmp_path / "out")
