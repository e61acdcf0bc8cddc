"""build_dataset, its cache, pad_collate and token_frequencies."""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import pytest
import torch

from specgraft.config import DataConfig
from specgraft.data import build_dataset, pad_collate, token_frequencies
from specgraft.data import dataset as dataset_module
from specgraft.errors import SpecgraftError


def _cfg(tmp_path, path, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


def _labels(tok, row) -> str:
    return tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])


def _label_counter(ds) -> Counter:
    return Counter(i for row in ds for i, m in zip(row["input_ids"], row["loss_mask"]) if m)


@pytest.mark.parametrize("tok_name", ["tiny_tok", "tok_no_tags", "tok_plain"])
def test_loss_mask_is_exactly_the_assistant_tokens(tmp_path, sharegpt_file, conversations, tok_name, request):
    tok = request.getfixturevalue(tok_name)
    ds = build_dataset(_cfg(tmp_path, sharegpt_file), tok)
    assert list(ds) == ["train"]
    train = ds["train"]
    assert train.column_names == ["input_ids", "attention_mask", "loss_mask"]
    end = "</s>" if tok_name == "tok_plain" else "<|im_end|>"
    assert len(train) == len(conversations)
    for row, conv in zip(train, conversations):
        assert _labels(tok, row) == "".join(m["content"] + end for m in conv if m["role"] == "assistant")
        assert row["attention_mask"] == [1] * len(row["input_ids"])


def test_truncation_and_rows_without_labels(tmp_path, tiny_tok, write_rows, caplog):
    rows = [
        {"messages": [{"role": "user", "content": "q" * 50}, {"role": "assistant", "content": "late"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a long reply " * 5}]},
    ]
    path = write_rows(tmp_path / "m.jsonl", rows)
    with caplog.at_level(logging.INFO):
        train = build_dataset(_cfg(tmp_path, path, max_length=32), tiny_tok)["train"]
    assert len(train) == 1  # the first reply starts beyond max_length: no label left, dropped and counted
    assert len(train[0]["input_ids"]) == 32
    assert "dropped 1 of 2 records with no label token within max_length=32" in caplog.text
    assert "1 truncated to max_length=32" in caplog.text


def test_packing_preserves_the_multiset_of_loss_tokens(tmp_path, tiny_tok, write_rows, conversations):
    path = write_rows(tmp_path / "m.jsonl", [{"messages": c} for c in conversations * 5])
    unpacked = build_dataset(_cfg(tmp_path, path, max_length=512), tiny_tok)["train"]
    packed = build_dataset(_cfg(tmp_path, path, max_length=40, packing=True), tiny_tok)["train"]
    assert len(packed) < len(unpacked) * 3
    assert all(len(r["input_ids"]) <= 40 for r in packed)
    assert _label_counter(packed) == _label_counter(unpacked)
    stream = [i for r in packed for i in r["input_ids"]]
    # Conversations are separated by EOS, so the packed stream holds one per conversation (none in the data).
    assert stream.count(tiny_tok.eos_token_id) == len(unpacked)


def test_plain_text_packing_keeps_every_token(tmp_path, tiny_tok):
    docs = [f"Story {i}: " + "la " * (3 * i + 1) for i in range(8)]
    (tmp_path / "t.txt").write_text("\n\n".join(docs), encoding="utf-8")
    packed = build_dataset(_cfg(tmp_path, tmp_path / "t.txt", max_length=16, packing=True), tiny_tok)["train"]
    stream = [i for r in packed for i in r["input_ids"]]
    expected = [i for d in docs for i in [tiny_tok.bos_token_id, *tiny_tok(d.strip())["input_ids"],
                                          tiny_tok.eos_token_id]]
    assert stream == expected
    assert all(r["loss_mask"] == [1] * len(r["input_ids"]) for r in packed)


def test_second_call_is_a_cache_hit(tmp_path, sharegpt_file, tiny_tok, monkeypatch, caplog):
    cfg = _cfg(tmp_path, sharegpt_file)
    with caplog.at_level(logging.INFO, logger="specgraft.data.dataset"):
        first = build_dataset(cfg, tiny_tok)
    assert "data cache miss" in caplog.text
    caplog.clear()

    def no_reading(*args, **kwargs):
        raise AssertionError("a cache hit must not read the source again")

    monkeypatch.setattr(dataset_module, "load_records", no_reading)
    with caplog.at_level(logging.INFO, logger="specgraft.data.dataset"):
        second = build_dataset(cfg, tiny_tok)
    assert "data cache hit" in caplog.text
    assert second["train"]["input_ids"] == first["train"]["input_ids"]
    assert second["train"]["loss_mask"] == first["train"]["loss_mask"]


def test_cache_key_follows_inputs(tmp_path, sharegpt_file, tiny_tok, tok_plain, to_sharegpt, write_rows):
    cfg = _cfg(tmp_path, sharegpt_file)
    build_dataset(cfg, tiny_tok)
    entries = lambda: sorted(p.name for p in (tmp_path / "cache" / "tokenized").iterdir())  # noqa: E731
    assert len(entries()) == 1
    build_dataset(_cfg(tmp_path, sharegpt_file, max_length=64), tiny_tok)  # a data-changing field
    build_dataset(cfg, tok_plain)  # another tokenizer
    assert len(entries()) == 3
    build_dataset(_cfg(tmp_path, sharegpt_file, num_proc=2), tiny_tok)  # num_proc does not change the data
    assert len(entries()) == 3
    write_rows(sharegpt_file, to_sharegpt()[:2])  # the source changed (size, mtime)
    assert len(build_dataset(cfg, tiny_tok)["train"]) == 2
    assert len(entries()) == 4


def test_num_samples_and_eval_split(tmp_path, tiny_tok, write_rows, conversations):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(20)]
    path = write_rows(tmp_path / "m.jsonl", rows)
    ds = build_dataset(_cfg(tmp_path, path, num_samples=10, eval_fraction=0.2, seed=3), tiny_tok)
    assert sorted(ds) == ["eval", "train"]
    assert (len(ds["train"]), len(ds["eval"])) == (8, 2)
    replies = [_labels(tiny_tok, r) for split in ("train", "eval") for r in ds[split]]
    assert len(set(replies)) == 10  # disjoint splits drawn from the 10 sampled records
    again = build_dataset(_cfg(tmp_path, path, num_samples=10, eval_fraction=0.2, seed=3, num_proc=1), tiny_tok)
    assert again["eval"]["input_ids"] == ds["eval"]["input_ids"]
    with pytest.raises(SpecgraftError, match="leaves nothing to train on"):
        build_dataset(_cfg(tmp_path, path, num_samples=1, eval_fraction=0.5), tiny_tok)


def test_all_conversations_without_assistant_turn_is_an_error(tmp_path, tiny_tok, write_rows):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    with pytest.raises(SpecgraftError) as err:
        build_dataset(_cfg(tmp_path, write_rows(tmp_path / "s.json", rows)), tiny_tok)
    message = str(err.value)
    assert "no conversation" in message and "assistant turn" in message and "row 0" in message
    assert "regenerate" in message  # the fix


def test_some_conversations_without_assistant_turn_are_dropped(tmp_path, tiny_tok, to_sharegpt, write_rows, caplog):
    rows = to_sharegpt()
    rows.insert(2, {"conversations": [{"from": "human", "value": "unanswered"}]})
    with caplog.at_level(logging.WARNING):
        train = build_dataset(_cfg(tmp_path, write_rows(tmp_path / "s.json", rows)), tiny_tok)["train"]
    assert len(train) == 3
    assert "dropped 1 of 4 conversations with no assistant turn (e.g. row 2" in caplog.text


def test_template_rejections_are_counted_and_all_rejected_is_an_error(tmp_path, tok_no_tags, sharegpt_file, caplog):
    # Like Gemma's template: a system turn raises.
    tok_no_tags.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with caplog.at_level(logging.WARNING):
        train = build_dataset(_cfg(tmp_path, sharegpt_file), tok_no_tags)["train"]
    assert len(train) == 2
    assert "dropped 1 of 3 conversations the chat template rejected (row 1: System role not supported)" in caplog.text
    with pytest.raises(SpecgraftError, match="no training sequence is left .* 3 rejected by the chat template"):
        build_dataset(_cfg(tmp_path, sharegpt_file, system_prompt="sys"), tok_no_tags)


def test_empty_after_filtering_is_an_error(tmp_path, tiny_tok, write_rows):
    rows = [{"messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y"}]}]
    with pytest.raises(SpecgraftError, match="no training sequence is left .* 1 with no label token within"):
        build_dataset(_cfg(tmp_path, write_rows(tmp_path / "m.jsonl", rows), max_length=8), tiny_tok)


def test_regenerate_without_a_model_is_refused(tmp_path, sharegpt_file, tiny_tok):
    with pytest.raises(SpecgraftError, match="no target model"):
        build_dataset(_cfg(tmp_path, sharegpt_file, regenerate=True), tiny_tok)


def test_missing_source_is_refused(tmp_path, tiny_tok):
    with pytest.raises(SpecgraftError, match="does not exist"):
        build_dataset(_cfg(tmp_path, tmp_path / "nope.jsonl"), tiny_tok)


def test_pad_collate_right_pads():
    rows = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "loss_mask": [0, 1, 1]},
        {"input_ids": [8], "attention_mask": [1], "loss_mask": [1], "extra": "ignored"},
    ]
    batch = pad_collate(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    wide = pad_collate(rows, pad_token_id=9, pad_to_multiple_of=4)
    assert wide["input_ids"].tolist() == [[5, 6, 7, 9], [8, 9, 9, 9]]
    assert wide["loss_mask"][:, 3].tolist() == [0, 0]


def test_pad_collate_on_a_built_dataset(tmp_path, sharegpt_file, tiny_tok):
    train = build_dataset(_cfg(tmp_path, sharegpt_file), tiny_tok)["train"]
    batch = pad_collate([train[i] for i in range(len(train))], tiny_tok.pad_token_id)
    lengths = [len(r) for r in train["input_ids"]]
    assert batch["input_ids"].shape == (len(train), max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["loss_mask"].sum().item() == sum(sum(r) for r in train["loss_mask"])


def test_token_frequencies_count_assistant_tokens(tmp_path, sharegpt_file, tiny_tok, conversations):
    ds = build_dataset(_cfg(tmp_path, sharegpt_file), tiny_tok)
    counts = token_frequencies(ds, vocab_size=320)
    assert counts.shape == (320,) and counts.dtype == torch.int64
    expected = Counter()
    for conv in conversations:
        for m in conv:
            if m["role"] == "assistant":
                expected.update(tiny_tok(m["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"])
    assert {i: int(c) for i, c in enumerate(counts.tolist()) if c} == dict(expected)
    every = token_frequencies(ds["train"], vocab_size=320, only_loss_tokens=False)
    assert int(every.sum()) == sum(len(r) for r in ds["train"]["input_ids"])
    assert np.all(every.numpy() >= counts.numpy())
    with pytest.raises(SpecgraftError, match="outside the vocabulary of size 100"):
        token_frequencies(ds, vocab_size=100)


def test_meta_records_the_drop_counts(tmp_path, sharegpt_file, tiny_tok):
    build_dataset(_cfg(tmp_path, sharegpt_file), tiny_tok)
    (entry,) = (tmp_path / "cache" / "tokenized").iterdir()
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["stats"]["train"]["records"] == 3 and meta["stats"]["train"]["sequences"] == 3
    assert meta["config"]["max_length"] == 2048


def test_worker_processes_give_the_same_data(tmp_path, tiny_tok, write_rows, conversations):
    path = write_rows(tmp_path / "m.jsonl", [{"messages": c} for c in conversations * 4])
    one = build_dataset(DataConfig(path=str(path), cache_dir=str(tmp_path / "c1"), packing=True, max_length=64),
                        tiny_tok)["train"]
    two = build_dataset(DataConfig(path=str(path), cache_dir=str(tmp_path / "c2"), packing=True, max_length=64,
                                   num_proc=2), tiny_tok)["train"]
    # Packing works per map batch, so workers may cut at other places; the labels and tokens are the same.
    assert _label_counter(two) == _label_counter(one)
    assert sorted(i for r in two for i in r["input_ids"]) == sorted(i for r in one for i in r["input_ids"])
