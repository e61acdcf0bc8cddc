"""Students: cut from the target (every tiny architecture), or loaded with the target's tokenizer (checked)."""

from __future__ import annotations

import logging

import pytest
import torch

from specgraft.config import DistillConfig
from specgraft.distill.student import (
    build_student,
    check_student_tokenizer,
    kept_layer_indices,
    load_student,
    student_from_target,
    tokenizer_difference,
)
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

IDS = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51, 52, 53, 54, 55, 56]])


def _layer_prefix(model) -> str:
    layers = model.get_decoder().layers
    return next(name for name, m in model.named_modules() if m is layers)


def test_kept_layer_indices():
    assert kept_layer_indices(5, 2) == [0, 2, 4]
    assert kept_layer_indices(4, 4) == [0]
    assert kept_layer_indices(4, 1) == [0, 1, 2, 3]
    with pytest.raises(SpecgraftError):
        kept_layer_indices(4, 0)


def test_keeping_every_layer_reproduces_the_target(tiny_arch, tiny_tok):
    target = Target(tiny_model(tiny_arch), tiny_tok)
    student = student_from_target(target, keep_every_k_layers=1)
    student.model.eval()
    with torch.no_grad():
        want = target.model(IDS).logits
        got = student.model(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_kth_layer_keeps_its_weights(tiny_arch, tiny_tok):
    target = Target(tiny_model(tiny_arch), tiny_tok)
    student = student_from_target(target, keep_every_k_layers=2)
    assert student.kept_layers == [0, 2]
    cfg = student.model.config
    assert cfg.num_hidden_layers == 2
    if getattr(target.config, "layer_types", None) is not None:
        assert cfg.layer_types == [target.config.layer_types[i] for i in (0, 2)]
    prefix = _layer_prefix(target.model)
    t_state, s_state = target.model.state_dict(), student.model.state_dict()
    for key, value in s_state.items():
        if key.startswith(prefix + "."):
            index, rest = key[len(prefix) + 1:].split(".", 1)
            source = f"{prefix}.{[0, 2][int(index)]}.{rest}"
        else:
            source = key
        assert torch.equal(value, t_state[source]), key
    # The student is a trainable float32 causal LM that generates.
    assert all(p.requires_grad and p.dtype == torch.float32 for p in student.model.parameters())
    out = student.model.generate(IDS[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, IDS.shape[1] + 4)


def test_narrower_student_is_randomly_initialised(tiny_arch, tiny_tok):
    target = Target(tiny_model(tiny_arch), tiny_tok)
    torch.manual_seed(0)
    student = student_from_target(target, keep_every_k_layers=4, hidden_size=32)
    cfg = student.model.config
    assert cfg.hidden_size == 32 and cfg.num_hidden_layers == 1
    assert cfg.num_attention_heads == 2  # head size 16 kept
    assert cfg.intermediate_size == 64
    assert student.describe()["random_init"] is True
    logits = student.model(IDS).logits
    assert logits.shape == (2, IDS.shape[1], target.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(SpecgraftError, match="not a multiple of the target's head size 16"):
        student_from_target(target, keep_every_k_layers=4, hidden_size=40)


def test_loaded_student_with_the_targets_tokenizer(tmp_path, tiny_tok):
    target = Target(tiny_model("llama"), tiny_tok, name_or_path="tiny-target")
    folder = tmp_path / "small"
    tiny_model("qwen2", num_hidden_layers=1, seed=3).save_pretrained(folder)
    tiny_tok.save_pretrained(folder)
    student = load_student(str(folder), target)
    assert student.origin == str(folder) and student.kept_layers is None
    assert student.model.training


def test_differently_padded_vocab_with_same_tokenizer_is_resized(tmp_path, tiny_tok):
    # Like Qwen2.5-0.5B (151936 rows) drafting for Qwen2.5-32B (152064 rows): same tokenizer.
    target = Target(tiny_model("llama"), tiny_tok)
    folder = tmp_path / "small"
    tiny_model("llama", num_hidden_layers=1, vocab_size=288).save_pretrained(folder)
    tiny_tok.save_pretrained(folder)
    student = load_student(str(folder), target)
    assert student.model.config.vocab_size == 320 and student.notes["resized_vocab_from"] == 288
    assert student.model(IDS).logits.shape[-1] == 320


def test_student_with_another_tokenizer_is_refused_naming_the_difference(tmp_path, tiny_tok):
    target = Target(tiny_model("llama"), tiny_tok, name_or_path="tiny-target")
    folder = tmp_path / "other"
    tiny_model("llama", num_hidden_layers=1).save_pretrained(folder)
    other = tiny_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    other.save_pretrained(folder)
    with pytest.raises(TargetMismatchError) as err:
        load_student(str(folder), target)
    message = str(err.value)
    assert "does not use the target's tokenizer" in message and "263 vs 262 tokens" in message
    assert "\n" not in message


def test_tokenizer_difference_names_special_tokens_and_tokens(tiny_tok):
    assert tokenizer_difference(tiny_tok, tiny_tokenizer()) is None
    other = tiny_tokenizer()
    other.eos_token = "<|im_end|>"
    assert tokenizer_difference(other, tiny_tok) == "eos token id 5 vs 2"
    with pytest.raises(TargetMismatchError, match="model vocab sizes 300 vs 320"):
        check_student_tokenizer(other, tiny_tok, "s", "t", 300, 320)
    with pytest.raises(TargetMismatchError, match="has 100 vocabulary rows but the shared tokenizer has 262"):
        check_student_tokenizer(tiny_tok, tiny_tokenizer(), "s", "t", 100, 320)


def test_student_larger_than_the_target_warns(tmp_path, tiny_tok, caplog):
    target = Target(tiny_model("llama", num_hidden_layers=1), tiny_tok)
    folder = tmp_path / "big"
    tiny_model("llama", num_hidden_layers=3).save_pretrained(folder)
    tiny_tok.save_pretrained(folder)
    with caplog.at_level(logging.WARNING, logger="specgraft.distill.student"):
        student = build_student(target, DistillConfig(student=str(folder)))
    assert student.model.config.num_hidden_layers == 3  # warned, not refused
    assert any("more than the target's" in r.getMessage() for r in caplog.records)


def test_missing_student_path_is_a_clear_error(tmp_path, tiny_tok):
    target = Target(tiny_model("llama"), tiny_tok)
    with pytest.raises(SpecgraftError, match="does not exist"):
        load_student(str(tmp_path / "nope"), target)
