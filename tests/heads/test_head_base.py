"""The DraftHead save/load contract (PEFT-style adapters), exercised with the Medusa head."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import specgraft.heads.head as head_module
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.heads.base import HEAD_CONFIG_NAME, HEAD_WEIGHTS_NAME, DraftHead, load_head, read_head_config
from specgraft.heads.medusa.model import MedusaHead
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

#: Upper bound on the safetensors JSON header for a handful of tensors (the rest of the file is raw fp32 data).
MAX_HEADER_BYTES = 16 * 1024


@pytest.fixture
def target() -> Target:
    return Target(tiny_model("llama"), tiny_tokenizer(), name_or_path="tiny-llama")


def make_head(target: Target, seed: int = 0, **overrides) -> MedusaHead:
    head = MedusaHead.build(target, MedusaHead.Config(**{"num_heads": 2, **overrides}).resolve(target))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # leave the identity init so a round trip that drops the blocks would show
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return head


def head_outputs(head: MedusaHead, target: Target) -> torch.Tensor:
    ids = torch.arange(3, 23).view(2, 10)
    hidden = target.forward(ids, layers=head.required_layers(), logits=False).hidden_states[target.num_layers]
    with torch.no_grad():
        return head(hidden)


# ----------------------------------------------------------------------------------------------------------------
# what is written


@pytest.mark.parametrize("share", [False, True])
def test_save_writes_only_head_weights(tmp_path, target, share):
    head = make_head(target, share_lm_head=share)
    head.save_pretrained(tmp_path / "head")
    files = sorted(os.listdir(tmp_path / "head"))
    assert files == [HEAD_WEIGHTS_NAME, HEAD_CONFIG_NAME]
    weights = tmp_path / "head" / HEAD_WEIGHTS_NAME
    state = load_file(str(weights))
    assert set(state) == set(head.state_dict())
    target_names = set(target.model.state_dict())
    assert not set(state) & target_names
    assert not any(name.startswith(("model.", "lm_head.")) for name in state)
    assert any(name.startswith("lm_heads.") for name in state) is not share
    numel = sum(p.numel() for p in head.parameters())
    data_bytes = os.path.getsize(weights) - 8  # an 8-byte header length, the JSON header, then raw data
    assert 4 * numel <= data_bytes <= 4 * numel + MAX_HEADER_BYTES
    with safe_open(str(weights), "pt") as fh:
        assert fh.metadata()["head_type"] == "medusa"


def test_head_config_records_target_identity(tmp_path, target):
    head = make_head(target)
    head.set_topk_accuracy(torch.full((2, 4), 0.25))
    head.save_pretrained(tmp_path / "head", extra={"note": "kept"})
    meta = json.loads((tmp_path / "head" / HEAD_CONFIG_NAME).read_text())
    assert meta["head_type"] == "medusa"
    assert meta["target"] == target.identity.to_dict()
    assert meta["target"]["tokenizer_fingerprint"] is not None
    assert meta["config"]["num_heads"] == 2 and meta["config"]["hidden_size"] == 64
    assert meta["config"]["topk_accuracy"] == [[0.25] * 4] * 2
    assert meta["num_parameters"] == sum(p.numel() for p in head.parameters())
    assert meta["note"] == "kept"
    assert read_head_config(tmp_path / "head") == meta


# ----------------------------------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize("share", [False, True])
def test_load_head_round_trips_to_identical_outputs(tmp_path, target, share):
    head = make_head(target, share_lm_head=share, num_layers=2)
    head.set_topk_accuracy([[0.5, 0.1], [0.3, 0.05]])
    head.save_pretrained(tmp_path / "head")
    loaded = load_head(target, tmp_path / "head")
    assert type(loaded) is MedusaHead
    assert loaded.config == head.config
    assert torch.equal(head_outputs(loaded, target), head_outputs(head, target))
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    assert isinstance(MedusaHead.from_pretrained(target, tmp_path / "head"), MedusaHead)
    assert isinstance(DraftHead.from_pretrained(target, tmp_path / "head"), MedusaHead)


def test_load_onto_a_copy_of_the_target_under_another_name(tmp_path, target):
    head = make_head(target)
    head.save_pretrained(tmp_path / "head")
    copy = Target(tiny_model("llama"), tiny_tokenizer(), name_or_path="/local/copy")
    assert torch.equal(head_outputs(load_head(copy, tmp_path / "head"), copy), head_outputs(head, copy))


@pytest.mark.parametrize("other,difference", [
    (lambda: Target(tiny_model("llama", hidden_size=32), tiny_tokenizer()), "hidden_size 64 vs 32"),
    (lambda: Target(tiny_model("llama", vocab_size=400), tiny_tokenizer()), "vocab_size 320 vs 400"),
    (lambda: Target(tiny_model("llama", num_hidden_layers=2), tiny_tokenizer()), "num_hidden_layers 4 vs 2"),
    (lambda: Target(tiny_model("qwen2"), tiny_tokenizer()), "architecture LlamaForCausalLM vs Qwen2ForCausalLM"),
])
def test_loading_onto_another_target_names_the_difference(tmp_path, target, other, difference):
    make_head(target).save_pretrained(tmp_path / "head")
    with pytest.raises(TargetMismatchError, match=difference):
        load_head(other(), tmp_path / "head")


def test_loading_with_another_tokenizer_raises(tmp_path, target):
    make_head(target).save_pretrained(tmp_path / "head")
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    with pytest.raises(TargetMismatchError, match="tokenizer"):
        load_head(Target(tiny_model("llama"), tokenizer), tmp_path / "head")


# ----------------------------------------------------------------------------------------------------------------
# broken folders


def test_missing_folder_config_or_weights(tmp_path, target):
    with pytest.raises(SpecgraftError, match="does not exist"):
        load_head(target, tmp_path / "nowhere")
    make_head(target).save_pretrained(tmp_path / "head")
    (tmp_path / "head" / HEAD_WEIGHTS_NAME).unlink()
    with pytest.raises(SpecgraftError, match=f"no {HEAD_WEIGHTS_NAME}"):
        load_head(target, tmp_path / "head")
    make_head(target).save_pretrained(tmp_path / "head")
    (tmp_path / "head" / HEAD_CONFIG_NAME).unlink()
    with pytest.raises(SpecgraftError, match=f"no {HEAD_CONFIG_NAME}"):
        load_head(target, tmp_path / "head")


def test_missing_tensor_raises(tmp_path, target):
    make_head(target).save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / HEAD_WEIGHTS_NAME
    state = load_file(str(weights))
    del state["blocks.1.layers.0.bias"]
    save_file(state, str(weights))
    with pytest.raises(SpecgraftError, match=r"missing \['blocks.1.layers.0.bias'\]"):
        load_head(target, tmp_path / "head")


def test_wrong_tensor_shape_raises(tmp_path, target):
    make_head(target).save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / HEAD_WEIGHTS_NAME
    state = load_file(str(weights))
    state["blocks.0.layers.0.weight"] = torch.zeros(64, 32)
    save_file(state, str(weights))
    with pytest.raises(SpecgraftError, match="blocks.0.layers.0.weight has shape"):
        load_head(target, tmp_path / "head")


@pytest.mark.parametrize("corrupt", ["truncate", "garbage"])
def test_corrupt_safetensors_raises(tmp_path, target, corrupt):
    make_head(target).save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / HEAD_WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if corrupt == "truncate" else b"not a safetensors file at all")
    with pytest.raises(SpecgraftError, match="not a readable safetensors"):
        load_head(target, tmp_path / "head")


@pytest.mark.parametrize("edit,message", [
    (lambda meta: meta["config"].update(num_heads=3), "missing"),
    (lambda meta: meta["config"].update(num_heads=0), "num_heads must be a positive integer"),
    (lambda meta: meta["config"].update(surprise=1), "unknown medusa fields"),
    (lambda meta: meta.pop("target"), "lacks 'target'"),
    (lambda meta: meta.update(head_type="nonsense"), "unknown head type"),
])
def test_edited_or_incomplete_config_raises(tmp_path, target, edit, message):
    make_head(target).save_pretrained(tmp_path / "head")
    cfg_file = tmp_path / "head" / HEAD_CONFIG_NAME
    meta = json.loads(cfg_file.read_text())
    edit(meta)
    cfg_file.write_text(json.dumps(meta))
    with pytest.raises(SpecgraftError, match=message):
        load_head(target, tmp_path / "head")


def test_invalid_json_config_raises(tmp_path, target):
    make_head(target).save_pretrained(tmp_path / "head")
    (tmp_path / "head" / HEAD_CONFIG_NAME).write_text("{ not json")
    with pytest.raises(SpecgraftError, match="not valid JSON"):
        load_head(target, tmp_path / "head")


# ----------------------------------------------------------------------------------------------------------------
# atomic save


def test_failed_save_leaves_existing_head_untouched(tmp_path, target, monkeypatch):
    path = tmp_path / "head"
    make_head(target, seed=0).save_pretrained(path)
    before = {name: (path / name).read_bytes() for name in os.listdir(path)}

    def half_write_then_fail(state, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"\x00" * 100)  # a partial file, then the disk "fills up"
        raise OSError("No space left on device")

    monkeypatch.setattr(head_module, "save_file", half_write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        make_head(target, seed=1).save_pretrained(path)
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before
    assert os.listdir(tmp_path) == ["head"]  # no temporary folder left behind
    monkeypatch.undo()
    assert torch.equal(head_outputs(load_head(target, path), target), head_outputs(make_head(target, seed=0), target))


def test_save_overwrites_an_existing_head(tmp_path, target):
    path = tmp_path / "head"
    make_head(target, seed=0).save_pretrained(path)
    newer = make_head(target, seed=1)
    newer.save_pretrained(path)
    assert torch.equal(head_outputs(load_head(target, path), target), head_outputs(newer, target))
    assert os.listdir(tmp_path) == ["head"]


def test_format_version_is_read_and_enforced(tmp_path):
    from specgraft.heads.base import FORMAT_VERSION

    target = Target(tiny_model("llama"), tiny_tokenizer())
    folder = make_head(target).save_pretrained(tmp_path / "head")
    meta = json.loads((folder / "head_config.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION
    load_head(target, folder)  # today's version loads
    for bad in (FORMAT_VERSION + 1, "1", 0):
        (folder / "head_config.json").write_text(json.dumps({**meta, "format_version": bad}))
        with pytest.raises(SpecgraftError, match="format_version .* upgrade specgraft"):
            load_head(target, folder)


def test_draft_columns_rank_only_the_draft_vocabulary():
    """A reduced draft vocabulary's columns: a token outside it is unranked, one inside is ranked in its column."""
    draft_ids = torch.tensor([5, 2, 7])  # column c drafts target id draft_ids[c]
    columns = head_module.draft_columns(draft_ids, 8)
    assert columns.tolist() == [-1, -1, 1, -1, -1, 0, -1, 2]
    logits = torch.tensor([[0.1, 0.9, 0.5]])  # column 1 (id 2) first, column 2 (id 7) second
    ranks = head_module.token_ranks(logits, torch.tensor([7]), columns)
    assert ranks.tolist() == [1]
    assert head_module.token_ranks(logits, torch.tensor([3]), columns).tolist() == [head_module.UNRANKED]
    assert head_module.draft_columns(None, 8) is None and head_module.draft_columns(torch.arange(8), 8) is None
