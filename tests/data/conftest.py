"""Fixtures of the data tests: sample conversations written in every supported format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgraft.testing import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

#: Normalised conversations (system / multi-turn / unicode) that every reader must reproduce exactly.
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3, in words?"},
        {"role": "assistant", "content": "six — easy"},
    ],
    [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "old pond\nfrog jumps in\nsplash"}],
]

SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}

#: The tiny ChatML template with its {% generation %} markers removed: the case of Llama-3 / Qwen templates.
NO_TAG_TEMPLATE = TINY_CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def sharegpt_rows(convs=CONVERSATIONS) -> list[dict]:
    return [
        {"id": f"conv-{i}", "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in c]}
        for i, c in enumerate(convs)
    ]


def messages_rows(convs=CONVERSATIONS) -> list[dict]:
    return [{"messages": c, "source": "test"} for c in convs]


def write_json(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def tok_no_tags():
    tok = tiny_tokenizer()
    tok.chat_template = NO_TAG_TEMPLATE
    return tok


@pytest.fixture
def tok_plain():
    return tiny_tokenizer(chat_template=False)


@pytest.fixture
def gen_model():
    """A tiny llama whose vocabulary is exactly the tiny tokenizer's, so every generated id decodes."""
    return tiny_model("llama", vocab_size=len(tiny_tokenizer()))


@pytest.fixture
def sharegpt_file(tmp_path) -> Path:
    return write_json(tmp_path / "sharegpt.json", sharegpt_rows())


@pytest.fixture
def conversations() -> list[list[dict]]:
    return json.loads(json.dumps(CONVERSATIONS))


@pytest.fixture
def to_sharegpt():
    return sharegpt_rows


@pytest.fixture
def to_messages():
    return messages_rows


@pytest.fixture
def write_rows():
    """write_rows(path, rows): a JSON array for .json, JSON lines for .jsonl."""

    def write(path: Path, rows: list[dict]) -> Path:
        return write_json(path, rows) if path.suffix == ".json" else write_jsonl(path, rows)

    return write
