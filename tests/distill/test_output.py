"""Draft folders: plain transformers models that work as assistant_model= and with the eval module's drafter."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specgraft.decoding.decoder import SpeculativeDecoder, generate_reference
from specgraft.decoding.drafters import DraftModelDrafter
from specgraft.distill.output import DRAFT_META, draft_drafter, load_draft, read_draft_meta, save_draft
from specgraft.distill.student import student_from_target
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

PROMPT = [1, 72, 101, 108, 108, 111, 32]
NEW = 24


@pytest.fixture
def saved(tmp_path, tiny_tok):
    target = Target(tiny_model("llama", seed=1), tiny_tok, name_or_path="org/tiny-target")
    student = student_from_target(target, keep_every_k_layers=2)
    folder = save_draft(tmp_path / "draft", student.model, tiny_tok, target.identity, student=student.describe(),
                        distill={"loss": "tvd", "beta": 0.5, "temperature": 1.0, "lmbda": 0.5, "seq_kd": False},
                        metrics={"alpha_exact": 0.75, "step": 40})
    return target, student, folder


def test_folder_is_a_plain_transformers_model_with_card_and_identity(saved):
    target, student, folder = saved
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", DRAFT_META} <= names
    model = AutoModelForCausalLM.from_pretrained(folder)
    for key, value in student.model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    meta = read_draft_meta(folder)
    assert meta["target"] == target.identity.to_dict()
    assert meta["student"]["kept_layers"] == [0, 2] and meta["metrics"]["alpha_exact"] == 0.75
    card = (folder / "README.md").read_text()
    assert "# Draft model for org/tiny-target" in card and "assistant_model=draft" in card
    assert "0.7500 at step 40" in card and "base_model" not in card  # cut from the target: no separate base


def test_assistant_model_greedy_equals_plain_greedy(saved):
    target, _, folder = saved
    draft = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([PROMPT])
    plain = target.model.generate(ids, max_new_tokens=NEW, do_sample=False)
    assisted = target.model.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == plain.tolist()


def test_eval_drafter_greedy_equals_plain_greedy(saved):
    target, _, folder = saved
    drafter = draft_drafter(folder, target, k=3)
    assert isinstance(drafter, DraftModelDrafter)
    decoder = SpeculativeDecoder(target, drafter=drafter, ignore_eos=True)
    result = decoder.generate(PROMPT, NEW)
    assert result.generated_ids == generate_reference(target.model, PROMPT, NEW, ignore_eos=True)
    assert result.tau >= 1.0


def test_loading_onto_another_target_is_refused(saved):
    _, _, folder = saved
    other = Target(tiny_model("llama", vocab_size=288), tiny_tokenizer(), name_or_path="org/other")
    with pytest.raises(TargetMismatchError, match="made for target org/tiny-target"):
        load_draft(folder, other)
    with pytest.raises(SpecgraftError, match="not a draft made by `specgraft distill`"):
        read_draft_meta(folder.parent)


def test_cast_on_save_keeps_tied_weights_tied(tmp_path, tiny_tok):
    target = Target(tiny_model("llama", tie_word_embeddings=True), tiny_tok)
    student = student_from_target(target, keep_every_k_layers=2)
    folder = save_draft(tmp_path / "d", student.model, tiny_tok, target.identity, dtype=torch.bfloat16)
    model, tokenizer, meta = load_draft(folder, target, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, student.model.lm_head.weight.bfloat16())


def test_checkpoint_weights_reload_exactly_with_tied_embeddings(tmp_path, tiny_tok):
    from specgraft.distill.trainer import load_weights

    target = Target(tiny_model("llama", tie_word_embeddings=True), tiny_tok)
    trained = student_from_target(target, keep_every_k_layers=2).model
    with torch.no_grad():
        trained.get_input_embeddings().weight.add_(0.5)  # differs from a fresh cut
    folder = save_draft(tmp_path / "ckpt", trained, None, target.identity)
    fresh = student_from_target(target, keep_every_k_layers=2).model
    load_weights(fresh, folder)
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    wrong = student_from_target(target, keep_every_k_layers=1).model
    with pytest.raises(SpecgraftError, match="do not match the student"):
        load_weights(wrong, folder)
