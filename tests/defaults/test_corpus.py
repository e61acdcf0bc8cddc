"""The procedural corpus: deterministic, disjoint splits, and documents that are what they claim to be."""

from __future__ import annotations

import ast
import json
import re

import pytest

from specgraft.defaults import corpus
from specgraft.defaults.corpus import DOMAINS, code_pool, code_split_of, demo_prompts, generate_corpus
from specgraft.errors import SpecgraftError

SUM_LINE = re.compile(r"^(\d+) \+ (\d+) = (\d+)$")
TABLE_LINE = re.compile(r"^(\d+) x (\d+) = (\d+)$")


@pytest.mark.parametrize("domain", DOMAINS)
def test_same_seed_same_documents_and_other_seeds_differ(domain):
    first = generate_corpus(domain, 6, 3)
    assert first == generate_corpus(domain, 6, 3)
    assert first != generate_corpus(domain, 6, 4)
    assert len(first) == 6 and all(isinstance(d, str) and d.strip() for d in first)
    # A longer request extends a shorter one, and the splits are different streams.
    assert generate_corpus(domain, 10, 3)[:6] == first
    assert generate_corpus(domain, 6, 3, split="heldout") != first


def test_code_pool_splits_are_disjoint_and_assigned_by_content():
    pool = code_pool()
    train, heldout, prompt = (set(pool[s]) for s in ("train", "heldout", "prompt"))
    assert train and heldout and prompt
    assert not train & heldout and not train & prompt and not heldout & prompt
    for split, chunks in pool.items():
        assert all(code_split_of(c) == split for c in chunks)
    # Documents of a split only ever come from its pool, and a request larger than the pool cycles through it.
    docs = generate_corpus("code", len(pool["heldout"]) + 3, 0, split="heldout")
    assert set(docs) == heldout


def test_code_chunks_are_valid_python_without_docstrings():
    for chunk in generate_corpus("code", 40, 0):
        tree = ast.parse(chunk)  # long chunks keep whole leading statements, so every chunk parses
        node = tree.body[0]
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        assert ast.get_docstring(node) is None
        assert corpus.CODE_MIN_CHARS <= len(chunk) <= corpus.CODE_MAX_CHARS


def test_arithmetic_is_always_right():
    checked = 0
    for doc in generate_corpus("arithmetic", 50, 0):
        for line in doc.splitlines():
            if m := SUM_LINE.match(line):
                assert int(m[1]) + int(m[2]) == int(m[3]), line
                checked += 1
            elif m := TABLE_LINE.match(line):
                assert int(m[1]) * int(m[2]) == int(m[3]), line
                checked += 1
            elif line.startswith("Count by "):
                step = int(line.split()[2])
                values = [int(v) for v in line.split(": ")[1].rstrip(".").split(", ")]
                assert all(b - a == step for a, b in zip(values, values[1:])), line
                checked += 1
    assert checked > 200


def test_records_follow_their_schemas():
    seen = set()
    for doc in generate_corpus("records", 60, 0):
        lines = doc.splitlines()
        if doc.startswith("{"):
            rows = [json.loads(line) for line in lines]
            assert [r["id"] for r in rows] == list(range(rows[0]["id"], rows[0]["id"] + len(rows)))
            for r in rows:  # the e-mail is derived from the name
                assert r["email"] == r["name"].lower().replace(" ", ".") + "@example.org"
            seen.add("people")
        elif doc.startswith("sku,"):
            for line in lines[1:]:
                sku, item, category, price, stock = line.split(",")
                assert corpus.ITEMS[item] == category and sku.startswith("SKU-") and float(price) > 0
            seen.add("inventory")
        elif doc.startswith("["):
            assert all(re.match(r"^(\[\w+\]|\w+ = \S+|)$", line) for line in lines)
            seen.add("ini")
        else:
            stamps = [line[:19] for line in lines]
            assert stamps == sorted(stamps)  # log lines are in time order
            seen.add("log")
    assert seen == {"people", "inventory", "ini", "log"}


def test_demo_prompts_are_fastchat_questions_from_the_prompt_stream():
    prompts = demo_prompts(3, seed=0)
    assert [p["category"] for p in prompts] == [d for d in DOMAINS for _ in range(3)]
    assert len({p["question_id"] for p in prompts}) == len(prompts)
    assert prompts == demo_prompts(3, seed=0)
    for p in prompts:
        assert set(p) == {"question_id", "category", "turns"} and len(p["turns"]) == 1
        text = p["turns"][0]
        source = generate_corpus(p["category"], 3, 0, split="prompt")
        assert any(doc.startswith(text) and len(text) < len(doc) for doc in source)
        assert not text.endswith((" \n", "\n"))  # ends where training text's tokenisation ends too
        if p["category"] == "arithmetic":
            assert text.endswith("= ")
    train = set(generate_corpus("code", 400, 0))
    assert not any(p["turns"][0] in doc for doc in train for p in prompts if p["category"] == "code")


def test_bad_arguments_raise_one_line_errors():
    with pytest.raises(SpecgraftError, match="unknown corpus domain 'poetry'"):
        generate_corpus("poetry", 1, 0)
    with pytest.raises(SpecgraftError, match="unknown corpus split"):
        generate_corpus("code", 1, 0, split="test")
    assert generate_corpus("prose", 0, 0) == []


def test_sums_are_two_digit_and_mostly_carry_free():
    """The shape that makes sums learnable: two-digit operands, units that mostly do not carry."""
    pairs = [(int(m[1]), int(m[2])) for doc in generate_corpus("arithmetic", 200, 0)
             for line in doc.splitlines() if (m := SUM_LINE.match(line)) and int(m[1]) < 100]
    assert len(pairs) > 500
    assert all(corpus.SUM_MIN <= a <= corpus.SUM_MAX and corpus.SUM_MIN <= b <= corpus.SUM_MAX for a, b in pairs)
    carry_share = sum(a % 10 + b % 10 >= 10 for a, b in pairs) / len(pairs)
    assert 0.02 < carry_share < corpus.CARRY_SHARE
