"""specgraft regenerate: same replies as one-by-one generation, resumable, shardable across processes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specgraft.cli import main as cli_main
from specgraft.commands import regenerate as regenerate_command
from specgraft.config import DataConfig
from specgraft.data import build_dataset, load_records
from specgraft.data import regenerate as regen_module
from specgraft.data.regenerate import regenerate
from specgraft.data.tokenize import prompt_ids, stop_token_ids
from specgraft.errors import SpecgraftError
from specgraft.testing import run_torchrun, tiny_tokenizer

MAX_NEW = 6
REPO = Path(__file__).resolve().parents[2]

LAUNCHER = '''
"""Runs `specgraft regenerate` on a tiny saved model; REGEN_TEST_DELAY slows each generate call (to be killed)."""
import os
import sys
import time
from pathlib import Path

model_dir = Path(sys.argv[1])
if not (model_dir / "config.json").exists():
    from specgraft.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
delay = float(os.environ.get("REGEN_TEST_DELAY", "0"))
if delay:
    from specgraft.data import regenerate as module

    original = module._Generator.generate

    def slow(self, *args, **kwargs):
        time.sleep(delay)
        return original(self, *args, **kwargs)

    module._Generator.generate = slow
from specgraft.cli import main

sys.exit(main(["regenerate", "--model", str(model_dir), *sys.argv[2:]]))
'''


@pytest.fixture
def stopping_model(gen_model):
    """The tiny model made to emit <|im_end|> where it would emit one common token, so some replies end early."""
    with torch.no_grad():
        gen_model.lm_head.weight[5] = gen_model.lm_head.weight[234] * 1.05
    return gen_model


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """Keep the default dataset cache (used by the CLI) inside the test folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "xdg"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _reference(model, tok, conv: list[dict], max_new_tokens: int = MAX_NEW) -> list[dict]:
    """Regenerate one conversation with plain, unbatched model.generate calls."""
    stops = stop_token_ids(tok, model.generation_config)
    msgs = [dict(m) for m in conv]
    slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if msgs[-1]["role"] == "user":
        slots.append(len(msgs))
    for slot in slots:
        ids = torch.tensor([prompt_ids(tok, msgs[:slot])])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=stops, pad_token_id=tok.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        new = new[: next((k for k, t in enumerate(new) if t in stops), len(new))]
        turn = {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)}
        if slot == len(msgs):
            msgs.append(turn)
        else:
            msgs[slot] = turn
    return msgs


def _convs(conversations) -> list[list[dict]]:
    # A trailing user turn gets a reply too; the second conversation has two replies that depend on each other.
    return [*conversations, [{"role": "user", "content": "unanswered question"}]]


def test_greedy_output_equals_one_by_one_generate(tmp_path, stopping_model, tiny_tok, conversations):
    convs = _convs(conversations)
    out = tmp_path / "regen.jsonl"
    stats = regenerate(stopping_model, tiny_tok, [{"messages": c} for c in convs], out, batch_size=3,
                       max_new_tokens=MAX_NEW, show_progress=False)
    rows = _read(out)
    assert [r["id"] for r in rows] == list(range(len(convs)))
    for row, conv in zip(rows, convs):
        assert row["messages"] == _reference(stopping_model, tiny_tok, conv)
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in conv] + (
            ["assistant"] if conv[-1]["role"] == "user" else []
        )
    assert stats.rows == 4 and stats.replies == 5 and stats.skipped == 0
    assert 0 < stats.truncated_replies < stats.replies  # some replies stopped at <|im_end|>, some ran out
    assert stats.new_tokens <= stats.replies * MAX_NEW and stats.tokens_per_s > 0 and stats.rows_per_s > 0
    assert not out.with_name(out.name + ".parts").exists()


def test_regenerated_file_is_training_data(tmp_path, stopping_model, tiny_tok, conversations):
    out = tmp_path / "regen.jsonl"
    regenerate(stopping_model, tiny_tok, [{"messages": c} for c in conversations], out, max_new_tokens=MAX_NEW,
               show_progress=False)
    records = load_records(out, cache_dir=tmp_path / "cache")
    assert [len(m) for m in records["messages"]] == [len(c) for c in conversations]


def test_system_prompt_is_used_and_written(tmp_path, gen_model, tiny_tok, conversations):
    out = tmp_path / "regen.jsonl"
    regenerate(gen_model, tiny_tok, [{"messages": conversations[0]}], out, max_new_tokens=3,
               system_prompt="Be brief.", show_progress=False)
    (row,) = _read(out)
    assert row["messages"][0] == {"role": "system", "content": "Be brief."}
    with_system = [{"role": "system", "content": "Be brief."}, *conversations[0]]
    assert row["messages"] == _reference(gen_model, tiny_tok, with_system, max_new_tokens=3)


def test_sampling_is_seeded(tmp_path, gen_model, tiny_tok, conversations):
    records = [{"messages": c} for c in conversations]

    def run(seed, name):
        regenerate(gen_model, tiny_tok, records, tmp_path / name, max_new_tokens=8, temperature=1.0, top_p=0.95,
                   seed=seed, show_progress=False)
        return _read(tmp_path / name)

    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = run(1, "a.jsonl")
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is left alone
    assert run(1, "b.jsonl") == first
    assert run(2, "c.jsonl") != first


def test_conversations_past_the_context_are_cut(tmp_path, gen_model, tiny_tok):
    long_question = "x" * 500  # + max_new_tokens exceeds the tiny model's 512 positions
    conv = [{"role": "user", "content": "short"}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": long_question}, {"role": "assistant", "content": "old"}]
    out = tmp_path / "regen.jsonl"
    stats = regenerate(gen_model, tiny_tok, [{"messages": conv}], out, max_new_tokens=MAX_NEW, show_progress=False)
    (row,) = _read(out)
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["messages"] == _reference(gen_model, tiny_tok, conv[:1])
    assert stats.cut_conversations == 1


def test_resume_after_an_interruption(tmp_path, stopping_model, tiny_tok, conversations, monkeypatch):
    convs = _convs(conversations) * 2
    records = [{"messages": c, "row": 10 + i} for i, c in enumerate(convs)]
    reference = tmp_path / "reference.jsonl"
    regenerate(stopping_model, tiny_tok, records, reference, batch_size=2, max_new_tokens=MAX_NEW,
               show_progress=False)

    out = tmp_path / "out.jsonl"
    original = regen_module._Generator.conversations
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(regen_module._Generator, "conversations", failing)
    with pytest.raises(KeyboardInterrupt):
        regenerate(stopping_model, tiny_tok, records, out, batch_size=2, max_new_tokens=MAX_NEW, show_progress=False)
    monkeypatch.setattr(regen_module._Generator, "conversations", original)
    (part,) = (out.with_name(out.name + ".parts")).glob("rank*.jsonl")
    assert len(part.read_text().splitlines()) == 4 and not out.exists()
    with open(part, "a", encoding="utf-8") as fh:
        fh.write('{"id": 15, "messages": [{"role": "us')  # a line torn by a kill mid-write

    stats = regenerate(stopping_model, tiny_tok, records, out, batch_size=2, max_new_tokens=MAX_NEW,
                       show_progress=False)
    assert stats.skipped == 4 and stats.rows == len(convs) - 4
    assert out.read_text() == reference.read_text()
    assert [r["id"] for r in _read(out)] == list(range(10, 10 + len(convs)))
    # Finished: a rerun has nothing to do.
    assert regenerate(stopping_model, tiny_tok, records, out, show_progress=False).rows == 0


def test_resume_with_other_settings_is_refused(tmp_path, gen_model, tiny_tok, conversations):
    out = tmp_path / "out.jsonl"
    parts = out.with_name(out.name + ".parts")
    parts.mkdir()
    (parts / "meta.json").write_text(json.dumps({"max_new_tokens": 99}))
    with pytest.raises(SpecgraftError, match="other settings .*max_new_tokens.* delete"):
        regenerate(gen_model, tiny_tok, [{"messages": conversations[0]}], out, max_new_tokens=3, show_progress=False)


def test_duplicate_ids_are_refused(tmp_path, gen_model, tiny_tok, conversations):
    records = [{"messages": conversations[0], "row": 1}, {"messages": conversations[1], "row": 1}]
    with pytest.raises(SpecgraftError, match="duplicate ids"):
        regenerate(gen_model, tiny_tok, records, tmp_path / "o.jsonl", show_progress=False)


def test_build_dataset_trains_on_the_regenerated_replies(tmp_path, stopping_model, tiny_tok, sharegpt_file,
                                                         conversations, caplog):
    cfg = DataConfig(path=str(sharegpt_file), cache_dir=str(tmp_path / "cache"), regenerate=True,
                     regenerate_max_new_tokens=MAX_NEW)
    train = build_dataset(cfg, tiny_tok, model=stopping_model)["train"]
    (regen_file,) = (tmp_path / "cache" / "regenerated").glob("*.jsonl")
    rows = _read(regen_file)
    for row, conv in zip(rows, conversations):
        assert row["messages"] == _reference(stopping_model, tiny_tok, conv)
    labelled = [tiny_tok.decode([i for i, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in train]
    expected = ["".join(m["content"] + "<|im_end|>" for m in r["messages"] if m["role"] == "assistant") for r in rows]
    assert sorted(labelled) == sorted(expected)
    with caplog.at_level(logging.INFO, logger="specgraft.data.dataset"):
        build_dataset(cfg, tiny_tok, model=stopping_model)
    assert "data cache hit" in caplog.text


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    regenerate_command.add_arguments(parser)
    argv = []
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return parser.parse_args(argv)


def test_cli_refuses_a_missing_model(tmp_path, sharegpt_file, capsys, isolated_cache):
    with pytest.raises(SpecgraftError, match="model path .* does not exist"):
        regenerate_command.run(_args(model=tmp_path / "nope", data=sharegpt_file, out=tmp_path / "o.jsonl"))
    rc = cli_main(["regenerate", "--model", str(tmp_path / "nope"), "--data", str(sharegpt_file),
                   "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: model path") and len(err.strip().splitlines()) == 1


def test_cli_end_to_end(tmp_path, gen_model, sharegpt_file, capsys, isolated_cache, conversations):
    model_dir = tmp_path / "model"
    gen_model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "o.jsonl"
    rc = cli_main(["regenerate", "--model", str(model_dir), "--data", str(sharegpt_file), "--out", str(out),
                   "--max-new-tokens", str(MAX_NEW), "--num-samples", "2", "--seed", "4", "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert rc == 0 and "rows/s" in printed and "tokens/s" in printed
    rows = _read(out)
    assert len(rows) == 2
    tok = tiny_tokenizer()
    for row in rows:
        assert row["messages"] == _reference(gen_model, tok, conversations[row["id"]])
    assert (isolated_cache / "specgraft" / "datasets").is_dir()


def _subprocess_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _many_conversations(tmp_path: Path, n: int) -> Path:
    rows = [{"conversations": [{"from": "human", "value": f"question number {i}"},
                               {"from": "gpt", "value": "old"}]} for i in range(n)]
    path = tmp_path / "many.json"
    path.write_text(json.dumps(rows))
    return path


def _saved_model(tmp_path: Path):
    tok = tiny_tokenizer()
    from specgraft.testing import tiny_model

    model = tiny_model("llama", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return model, tok


@pytest.mark.slow
def test_sigkill_and_resume_gives_the_uninterrupted_result(tmp_path):
    model, tok = _saved_model(tmp_path)
    data = _many_conversations(tmp_path, 24)
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, str(launcher), str(tmp_path / "model"), "--data", str(data), "--out", str(out),
            "--batch-size", "2", "--max-new-tokens", str(MAX_NEW)]
    env = _subprocess_env(tmp_path)
    proc = subprocess.Popen(args, env={**env, "REGEN_TEST_DELAY": "0.3"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    part = out.with_name(out.name + ".parts") / "rank00000-of-00001.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if part.exists() and part.read_text().count("\n") >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = part.read_text().count("\n")
    assert 4 <= done_before < 24 and not out.exists()
    with open(part, "a", encoding="utf-8") as fh:
        fh.write('{"id": 23, "messages": [{"ro')  # what a kill in the middle of a write leaves

    resumed = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{done_before} done earlier" in resumed.stdout

    reference = tmp_path / "reference.jsonl"
    records = load_records(data, cache_dir=tmp_path / "cache")
    regenerate(model, tok, records, reference, batch_size=5, max_new_tokens=MAX_NEW, show_progress=False)
    rows = _read(out)
    assert [r["id"] for r in rows] == list(range(24))  # no duplicate, no missing id
    assert out.read_text() == reference.read_text()


@pytest.mark.slow
def test_two_processes_give_the_same_rows_as_one(tmp_path):
    model, tok = _saved_model(tmp_path)
    data = _many_conversations(tmp_path, 10)
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    out = tmp_path / "two.jsonl"
    done = run_torchrun([str(launcher), str(tmp_path / "model"), "--data", str(data), "--out", str(out),
                         "--batch-size", "3", "--max-new-tokens", str(MAX_NEW)], env=_subprocess_env(tmp_path),
                        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Each process regenerated its own half; the summary counts both.
    assert "regenerated 10 conversations" in done.stdout
    assert done.stdout.count("rows/s") == 1  # only the main process reports

    single = tmp_path / "one.jsonl"
    regenerate(model, tok, load_records(data, cache_dir=tmp_path / "cache"), single, batch_size=3,
               max_new_tokens=MAX_NEW, show_progress=False)
    assert out.read_text() == single.read_text()
    assert not out.with_name(out.name + ".parts").exists()


def test_first_reply_only_rewrites_one_reply_per_conversation(tmp_path, stopping_model, tiny_tok, conversations,
                                                             caplog):
    convs = _convs(conversations)  # 4 conversations holding 5 reply slots (one has two dependent replies)
    full = regenerate(stopping_model, tiny_tok, [{"messages": c} for c in convs], tmp_path / "full.jsonl",
                      batch_size=3, max_new_tokens=MAX_NEW, show_progress=False)
    out = tmp_path / "first.jsonl"
    with caplog.at_level(logging.DEBUG, logger="specgraft.data.regenerate"):
        first = regenerate(stopping_model, tiny_tok, [{"messages": c} for c in convs], out, batch_size=3,
                           max_new_tokens=MAX_NEW, first_reply_only=True, show_progress=False)
    assert full.replies == 5 and first.replies == 4 and first.rows == 4
    for row, conv in zip(_read(out), convs):
        roles = [m["role"] for m in conv]
        through_first = conv[: roles.index("assistant") + 1] if "assistant" in roles else conv
        assert row["messages"] == _reference(stopping_model, tiny_tok, through_first)
        assert sum(m["role"] == "assistant" for m in row["messages"]) == 1
    # The two-reply conversation ends at its first reply: the later question followed from the old answer.
    assert [m["role"] for m in _read(out)[1]["messages"]] == ["system", "user", "assistant"]
    # One timing line per batch (4 conversations in batches of 3), adding up to the run's totals.
    batches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch of ")]
    assert [b.split(" conversations")[0] for b in batches] == ["batch of 3", "batch of 1"]
    assert sum(int(b.split(" new tokens")[0].rsplit(" ", 1)[1]) for b in batches) == first.new_tokens
    assert all("tokens/s)" in b for b in batches)


def test_resume_with_another_first_reply_only_is_refused(tmp_path, gen_model, tiny_tok, conversations,
                                                         monkeypatch):
    records = [{"messages": c} for c in conversations]
    out = tmp_path / "out.jsonl"

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(regen_module._Generator, "conversations", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regenerate(gen_model, tiny_tok, records, out, max_new_tokens=3, first_reply_only=True, show_progress=False)
    monkeypatch.undo()
    meta = json.loads((out.with_name(out.name + ".parts") / "meta.json").read_text())
    assert meta["first_reply_only"] is True
    with pytest.raises(SpecgraftError, match=r"other settings \(first_reply_only differ\)"):
        regenerate(gen_model, tiny_tok, records, out, max_new_tokens=3, show_progress=False)
    stats = regenerate(gen_model, tiny_tok, records, out, max_new_tokens=3, first_reply_only=True,
                       show_progress=False)
    assert stats.rows == len(conversations) and stats.replies == len(conversations)


def test_cli_first_reply_only_and_threads(tmp_path, gen_model, sharegpt_file, capsys, isolated_cache, conversations,
                                          monkeypatch):
    model_dir = tmp_path / "model"
    gen_model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    out = tmp_path / "o.jsonl"
    rc = cli_main(["regenerate", "--model", str(model_dir), "--data", str(sharegpt_file), "--out", str(out),
                   "--max-new-tokens", str(MAX_NEW), "--dtype", "float32", "--first-reply-only", "--threads", "2",
                   "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0 and threads == [2] and "regenerating" not in printed.err
    assert f"({len(conversations)} replies" in printed.out
    rows = _read(out)
    assert [len(r["messages"]) for r in rows] == [2, 3, 2]


# -- plain text (a story target): each paragraph becomes its first sentence + the target's continuation ----------
PARAGRAPHS = ["Once upon a time, there was a cat.  It sat\non a mat.", '"Hello!" said the dog. He ran.',
              "no sentence end here"]


def test_first_sentence_of_a_paragraph():
    assert [regen_module.first_sentence(p) for p in PARAGRAPHS] == [
        "Once upon a time, there was a cat.", '"Hello!"', "no sentence end here"]
    assert regen_module.first_sentence("Where is Tom?\u201d she asked. Then") == "Where is Tom?\u201d"


def _text_reference(model, tok, text: str, max_new_tokens: int = MAX_NEW, whole: bool = False) -> str:
    """One paragraph (its first sentence, or all of it when ``whole``) continued with a plain, unbatched
    model.generate call."""
    stops = stop_token_ids(tok, model.generation_config, use_chat_template=False)
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    prompt = bos + tok(text if whole else regen_module.first_sentence(text), add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stops, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    new = new[: next((k for k, t in enumerate(new) if t in stops), len(new))]
    return tok.decode(prompt + new, skip_special_tokens=True)


def test_continue_texts_equals_one_by_one_generate(tmp_path, gen_model, tok_plain):
    (stop,) = stop_token_ids(tok_plain, gen_model.generation_config, use_chat_template=False)
    with torch.no_grad():
        # The tiny model's greedy continuation of the third paragraph is 38 171 256 ...: EOS made to outscore 256
        # ends that one after 2 tokens, while the other two (which never pick 256) run to max_new_tokens.
        gen_model.lm_head.weight[stop] = gen_model.lm_head.weight[256] * 1.05
    out = tmp_path / "stories.jsonl"
    records = [{"text": p, "row": 10 + i} for i, p in enumerate(PARAGRAPHS)]
    stats = regen_module.continue_texts(gen_model, tok_plain, records, out, batch_size=2, max_new_tokens=MAX_NEW)
    rows = _read(out)
    assert [r["id"] for r in rows] == [10, 11, 12]
    assert [r["text"] for r in rows] == [_text_reference(gen_model, tok_plain, p) for p in PARAGRAPHS]
    for row, paragraph in zip(rows, PARAGRAPHS):
        assert row["text"].startswith(regen_module.first_sentence(paragraph))
    assert stats.rows == 3 and stats.new_tokens == MAX_NEW + MAX_NEW + 2  # the stop token is not kept
    assert stats.truncated_replies == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories.jsonl"]  # written atomically, no leftovers


def test_continue_texts_continues_whole_prompts_verbatim_when_told(tmp_path, gen_model, tok_plain):
    # Cut code/records prompts (the demo's): several sentences, newlines and indentation, all kept as they are.
    prompts = ["def total(items):\n    return sum(items)\n\ndef mean(items):", "Hello there. It sat.\n  x = 1"]
    out = tmp_path / "continued.jsonl"
    stats = regen_module.continue_texts(gen_model, tok_plain, [{"text": t} for t in prompts], out, batch_size=2,
                                        max_new_tokens=MAX_NEW, prompt_of=None)
    rows = _read(out)
    assert [r["text"] for r in rows] == [_text_reference(gen_model, tok_plain, t, whole=True) for t in prompts]
    assert all(r["text"].startswith(t) and len(r["text"]) > len(t) for r, t in zip(rows, prompts))
    assert stats.rows == 2 and stats.new_tokens > 0


def test_build_dataset_trains_on_the_continued_text(tmp_path, gen_model, tok_plain, caplog):
    text = tmp_path / "stories.txt"
    text.write_text("\n\n".join(PARAGRAPHS) + "\n", encoding="utf-8")
    cfg = DataConfig(path=str(text), format="text", cache_dir=str(tmp_path / "cache"), regenerate=True,
                     regenerate_max_new_tokens=MAX_NEW)
    train = build_dataset(cfg, tok_plain, model=gen_model)["train"]
    (regen_file,) = (tmp_path / "cache" / "regenerated").glob("*.jsonl")
    rows = _read(regen_file)
    assert [r["text"] for r in rows] == [_text_reference(gen_model, tok_plain, p) for p in PARAGRAPHS]
    trained = sorted(tok_plain.decode(r["input_ids"], skip_special_tokens=True) for r in train)
    assert trained == sorted(r["text"] for r in rows)  # the target's continuations, not the human text
    assert not any("It sat" in t or "He ran" in t for t in trained)
    with caplog.at_level(logging.INFO, logger="specgraft.data.dataset"):
        build_dataset(cfg, tok_plain, model=gen_model)
    assert "data cache hit" in caplog.text


def test_stories260k_medusa_recipe_trains_on_the_targets_greedy_continuations():
    """The shipped stories260K Medusa recipe self-distils (CHANGELOG.md, "Medusa on stories260K": held-out tree tau
    1.89 on the human text, 2.70 on the target's continuations, at the same 600 steps)."""
    from specgraft.config import load_recipe

    data = load_recipe(REPO / "recipes" / "medusa" / "stories260k.yaml").data
    assert (data.format, data.regenerate, data.regenerate_temperature) == ("text", True, 0.0)
    assert (data.num_samples, data.regenerate_max_new_tokens) == (1536, 160)
