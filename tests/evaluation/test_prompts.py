"""Prompt-set readers (FastChat, HumanEval, GSM8K, self-instruct, generic JSONL) and chat/raw rendering."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from specgraft.errors import SpecgraftError
from specgraft.evaluation.prompts import detect_format, file_label, load_prompts, render_turn
from specgraft.testing import tiny_tokenizer


def write_jsonl(path, rows, gz: bool = False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# -- synthetic files of every format ----------------------------------------------------------------------------------
def test_fastchat_multi_turn_and_empty_category(tmp_path):
    f = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "", "turns": ["Hi"], "reference": ["Hello"]},
    ])
    prompts = load_prompts(f)
    assert [(p.id, p.domain, p.turns) for p in prompts] == [
        ("81", "writing", ["Write a poem.", "Shorter."]),
        ("82", tmp_path.name, ["Hi"]),  # empty category -> the folder's name (the file is generically named)
    ]
    assert prompts[0].source == str(f)


def test_humaneval_gz_gsm8k_self_instruct_and_generic(tmp_path):
    he = write_jsonl(tmp_path / "HumanEval.jsonl.gz", [
        {"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"},
        {"task_id": "HumanEval/1", "prompt": "def g():\n", "entry_point": "g"},
    ], gz=True)
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "#### 2"},
                                               {"question": "2+2?", "answer": "#### 4"}])
    si = write_jsonl(tmp_path / "si.jsonl", [
        {"id": "t0", "motivation_app": "Grammarly", "instruction": "Fix it.", "instances": [{"input": "teh cat",
                                                                                             "output": "the cat"}]},
        {"id": "t1", "motivation_app": "Gmail", "instruction": "Say hi.", "instances": [{"input": "", "output": ""}]},
    ])
    gen = write_jsonl(tmp_path / "mine.jsonl", [{"id": "a", "domain": "x", "prompt": "p1"},
                                                {"id": "b", "domain": "y", "prompt": "p2"}])
    assert [(p.id, p.domain, p.turns) for p in load_prompts(he)] == [
        ("HumanEval/0", "humaneval", ["def f():\n"]), ("HumanEval/1", "humaneval", ["def g():\n"])]
    assert [(p.id, p.domain, p.turns) for p in load_prompts(gsm)] == [("1", "gsm8k", ["1+1?"]),
                                                                      ("2", "gsm8k", ["2+2?"])]
    assert [(p.id, p.domain, p.turns) for p in load_prompts(si)] == [
        ("t0", "self_instruct", ["Fix it.\n\nteh cat"]), ("t1", "self_instruct", ["Say hi."])]
    assert [p.domain for p in load_prompts(si, domain_field="motivation_app")] == ["Grammarly", "Gmail"]
    assert [(p.id, p.domain, p.turns) for p in load_prompts(gen)] == [("a", "x", ["p1"]), ("b", "y", ["p2"])]


def test_generic_with_explicit_fields(tmp_path):
    f = write_jsonl(tmp_path / "custom.jsonl", [{"body": "tell me", "lang": "en", "prompt": "ignored"},
                                                {"body": "dis-moi", "lang": "fr", "prompt": "ignored"}])
    prompts = load_prompts(f, domain_field="lang", prompt_field="body")
    assert [(p.id, p.domain, p.turns) for p in prompts] == [("1", "en", ["tell me"]), ("2", "fr", ["dis-moi"])]
    # Without a domain field the file's label is the single domain.
    g = write_jsonl(tmp_path / "plain.jsonl", [{"text": "a"}, {"text": "b"}])
    assert {p.domain for p in load_prompts(g)} == {"plain"}


def test_several_files_limit_and_id_collisions(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_jsonl(tmp_path / "a" / "question.jsonl",
                    [{"question_id": i, "category": "c1" if i < 3 else "c2", "turns": [f"a{i}"]} for i in range(5)])
    b = write_jsonl(tmp_path / "b" / "question.jsonl", [{"question_id": 0, "category": "c3", "turns": ["b0"]}])
    prompts = load_prompts([a, b], limit_per_domain=2)
    assert [(p.id, p.domain) for p in prompts] == [("a:0", "c1"), ("a:1", "c1"), ("a:3", "c2"), ("a:4", "c2"),
                                                   ("b:0", "c3")]
    assert file_label(tmp_path / "HumanEval.jsonl.gz") == "HumanEval"
    assert file_label(a) == "a"


@pytest.mark.parametrize("content, fragments", [
    ("", ["is empty"]),
    ("\n  \n", ["is empty"]),
    ('{"prompt": "ok"}\n{"prompt": \n', ["line 2", "not valid JSON"]),
    ('["a list"]\n', ["line 1", "not an object"]),
    ('{"question_id": 1, "category": "c", "turns": ["x"]}\n{"question_id": 2, "category": "c"}\n',
     ["line 2", "'turns'", "fields present: category, question_id"]),
    ('{"question_id": 1, "category": "c", "turns": ["x"]}\n{"question_id": 1, "category": "c", "turns": ["y"]}\n',
     ["line 2", "repeats prompt id 1"]),
    ('{"question_id": 1, "category": "c", "turns": ["  "]}\n', ["line 1", "empty"]),
    ('{"foo": "x", "bar": 1}\n', ["no prompt field", "fields present: bar, foo"]),
])
def test_bad_files_give_one_line_errors(tmp_path, content, fragments):
    f = tmp_path / "p.jsonl"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(SpecgraftError) as err:
        load_prompts(f)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_unknown_domain_and_prompt_fields_name_the_fields_present(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "c", "turns": ["x"]}])
    with pytest.raises(SpecgraftError, match=r"unknown domain field 'topic'.*fields present: category, question_id, "
                                             r"turns"):
        load_prompts(f, domain_field="topic")
    with pytest.raises(SpecgraftError, match=r"no prompt field 'body'.*fields present"):
        load_prompts(f, prompt_field="body")
    with pytest.raises(SpecgraftError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(SpecgraftError, match="no prompt files"):
        load_prompts([])


def test_detect_format():
    assert detect_format({"question_id": 1, "category": "c", "turns": []}) == "fastchat"
    assert detect_format({"task_id": "HumanEval/1", "prompt": "x"}) == "humaneval"
    assert detect_format({"question": "q", "answer": "a"}) == "gsm8k"
    assert detect_format({"question": "q", "answer": "a", "domain": "d"}) == "generic"
    assert detect_format({"instruction": "i", "instances": []}) == "self_instruct"


# -- the real prompt sets in ../shared/data ---------------------------------------------------------------------------
@pytest.mark.shared
def test_real_prompt_sets_load(shared_data):
    spec = load_prompts(shared_data / "spec_bench" / "question.jsonl")
    assert len(spec) == 480
    counts = Counter(p.domain for p in spec)
    assert counts["translation"] == counts["summarization"] == counts["qa"] == counts["rag"] == 80
    assert counts["math_reasoning"] == 80 and counts["writing"] == 10 and len(counts) == 13
    assert Counter(len(p.turns) for p in spec) == {1: 400, 2: 80}
    assert spec[0].id == "81" and spec[0].turns[1].startswith("Rewrite your previous response")

    mt = load_prompts(shared_data / "mt_bench" / "question.jsonl")
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt) and len({p.domain for p in mt}) == 8
    vicuna = load_prompts(shared_data / "vicuna_bench" / "question.jsonl")
    assert len(vicuna) == 80 and "fermi" in {p.domain for p in vicuna}

    he = load_prompts(shared_data / "humaneval" / "HumanEval.jsonl.gz")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and {p.domain for p in he} == {"humaneval"}
    assert he[0].turns[0].startswith("from typing import List")
    gsm = load_prompts(shared_data / "gsm8k" / "test.jsonl")
    assert len(gsm) == 1319 and gsm[0].turns[0].startswith("Janet") and {p.domain for p in gsm} == {"gsm8k"}
    si = load_prompts(shared_data / "self_instruct" / "user_oriented_instructions.jsonl")
    assert len(si) == 252 and si[0].id == "user_oriented_task_0" and "\n\nIf you have any questions" in si[0].turns[0]

    eagle = {name: load_prompts(shared_data / "eagle_eval" / name / "question.jsonl")
             for name in ("alpaca", "gsm8k", "humaneval", "qa", "sum")}
    assert {name: {p.domain for p in ps} for name, ps in eagle.items()} == {
        "alpaca": {"alpaca"}, "gsm8k": {"math"}, "humaneval": {"code"}, "qa": {"qa"}, "sum": {"summarization"}}
    assert all(len(ps) == 80 for ps in eagle.values())

    # Several real files at once: MT-bench and Spec-Bench share ids 81-160, so ids get the files' labels.
    both = load_prompts([shared_data / "mt_bench" / "question.jsonl", shared_data / "spec_bench" / "question.jsonl"],
                        limit_per_domain=1)
    assert both[0].id == "mt_bench:81" and len({p.id for p in both}) == len(both)
    assert len(both) == 13  # one per domain across both files (MT-bench categories are Spec-Bench's too)


# -- rendering -------------------------------------------------------------------------------------------------------
def test_render_chat_template_multi_turn_continues_with_the_answer():
    tok = tiny_tokenizer()
    text0, ids0 = render_turn(tok, ["Hi there", "And then?"], [])
    assert text0 == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids0) == text0 and ids0[0] == tok.convert_tokens_to_ids("<|im_start|>")
    text1, ids1 = render_turn(tok, ["Hi there", "And then?"], ["Hello!"])
    assert text1 == ("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                     "<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    assert ids1[: len(ids0)] == ids0  # the first turn's prompt is a prefix of the second's
    with pytest.raises(ValueError):
        render_turn(tok, ["only"], ["a"])


def test_render_raw_text_for_base_models():
    tok = tiny_tokenizer(chat_template=False)
    text, ids = render_turn(tok, ["Once upon a time", "The end?"], [" there was a cat."])
    assert text == "Once upon a time there was a cat.\n\nThe end?"
    assert tok.decode(ids) == text


@pytest.mark.shared
def test_render_stories260k_is_plain_text_with_bos(stories260k_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories260k_dir)
    text, ids = render_turn(tok, ["Once upon a time"], [])
    assert text == "Once upon a time" and ids == [1, 403, 407, 261, 378]  # llama2.c's own encoding (BOS first)
