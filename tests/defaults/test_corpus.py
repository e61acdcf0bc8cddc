"""The procedural corpus: deterministic, disjoint splits, and documents that are what they claim to be."""

from __future__ import annotations

import ast
import json
import re

import pytest

from specgraft.defaults import corpus
from specgraft.defaults.corpus import DOMAINS, demo_prompts, generate_corpus, prompt_cuts
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


def test_code_documents_are_python_whose_own_tests_pass():
    """Every code document parses, defines only functions and classes, and its generated tests (with expected
    values computed by the generator) pass when run: the code is code, not code-shaped text."""
    tests_run = 0
    for doc in generate_corpus("code", 300, 0):
        tree = ast.parse(doc)
        assert all(isinstance(node, ast.FunctionDef | ast.ClassDef) for node in tree.body)
        namespace: dict = {}
        exec(compile(tree, "<corpus>", "exec"), namespace)  # noqa: S102 (our own generated source)
        for name, value in namespace.items():
            if name.startswith("test_"):
                value()
                tests_run += 1
    assert tests_run > 50


def test_code_documents_reuse_their_names():
    """What makes code predictable: the entity's fields, once declared, recur (copied) further down."""
    for doc in generate_corpus("code", 50, 1):
        if doc.startswith("class "):
            init = re.search(r"def __init__\(self, ([\w, ]+)\):", doc)
            for field in init[1].split(", "):
                assert doc.count(field) >= 2, (field, doc)


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
    # The documents prompts are cut from are new: none of them is a training document (short prefixes of a
    # templated domain do recur, as they do in real text).
    for domain in DOMAINS:
        train = set(generate_corpus(domain, 2000, 0))
        assert not train & set(generate_corpus(domain, 50, 0, split="prompt"))


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


def test_training_prompt_cuts_are_prefixes_of_training_documents_and_not_demo_prompts():
    held_out = {p["turns"][0] for p in demo_prompts(5, seed=0)}
    assert [p["turns"][0] for p in demo_prompts(2, seed=0)[:2]] == prompt_cuts("code", 2, 0)  # the same cut
    for domain in DOMAINS:
        docs = generate_corpus(domain, 5, 1, split="train")
        cuts = prompt_cuts(domain, 5, 1, split="train")
        assert cuts == prompt_cuts(domain, 5, 1, split="train")
        assert all(doc.startswith(cut) and len(cut) < len(doc) for doc, cut in zip(docs, cuts))
        assert not held_out & set(cuts)
