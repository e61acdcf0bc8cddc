"""Evaluation prompt sets: reading the common formats, grouping by domain, and rendering turns for a target.

Formats (detected per file from its first record; ``prompt_field`` forces the generic reader):

* FastChat ``question.jsonl`` (MT-bench, Vicuna-bench, Spec-Bench, EAGLE's eval sets): ``question_id``,
  ``category`` (the domain), ``turns`` (user turns; a multi-turn conversation continues with the generated answer).
  An empty category (EAGLE's alpaca set) falls back to the file's label.
* HumanEval (``.jsonl.gz`` or ``.jsonl``): ``task_id``, ``prompt``; domain ``humaneval``.
* GSM8K: ``question``, ``answer``; domain ``gsm8k``, id = line number.
* self-instruct user-oriented instructions: ``id``, ``instruction``, ``instances[0].input``; domain
  ``self_instruct``.
* Generic JSONL: a prompt field (``prompt``, ``instruction``, ``question``, ``text``, ``input`` or ``prompt_field``)
  and a domain field (``domain``, ``category``, ``task`` or ``domain_field``; without one, the file's label).

``domain_field`` overrides the domain of any format (e.g. ``motivation_app`` for self-instruct); a record without
it is refused with the fields it does have. The file label is the file name without ``.jsonl``/``.gz``, or its
folder's name when the file is generically named (``question.jsonl``, ``test.jsonl``).

Rendering: :func:`render_turn` applies the tokenizer's chat template when it has one (earlier turns and their
generated answers become user/assistant messages); a base model without a template gets raw text (earlier turns
and answers concatenated) tokenized with the tokenizer's own special tokens (e.g. BOS).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.utils.io import iter_lines_limited, require_file

logger = logging.getLogger(__name__)

#: Field names tried, in order, for the prompt text and the domain of a generic JSONL record.
PROMPT_FIELDS = ("prompt", "instruction", "question", "text", "input")
DOMAIN_FIELDS = ("domain", "category", "task")
ID_FIELDS = ("question_id", "id", "task_id", "prompt_id")
#: File stems too generic to name a domain: the folder's name is used instead.
GENERIC_STEMS = ("question", "questions", "test", "train", "validation", "data", "prompts", "eval")
#: Separator between a base model's previous answer and its next user turn (no chat template).
RAW_TURN_SEPARATOR = "\n\n"

FORMATS = ("fastchat", "humaneval", "gsm8k", "self_instruct", "generic")
#: Fields every record of a file in that format must have.
REQUIRED_FIELDS = {"fastchat": ("turns",), "humaneval": ("task_id", "prompt"), "gsm8k": ("question",),
                   "self_instruct": ("instruction",), "generic": ()}


@dataclass
class Prompt:
    """One evaluation item: a conversation of user turns in one domain.

    Attributes:
        id: the prompt's id (``question_id``, ``task_id``, ... or the line number), as a string.
        domain: the group it is reported under.
        turns: user turns; later turns follow the generated answers to earlier ones.
        source: the file it came from.
    """

    id: str
    domain: str
    turns: list[str] = field(default_factory=list)
    source: str = ""


def file_label(path: str | os.PathLike) -> str:
    """A short name for a prompt file: its stem, or its folder's name for generic stems (``question.jsonl``)."""
    path = Path(path)
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.lower() in GENERIC_STEMS and path.parent.name:
        return path.resolve().parent.name
    return name


#: Limits of a prompt file, decompressed (benchmarks' prompt files are well under a MiB): checked while reading,
#: so a small .gz that expands to gigabytes is refused before it is held in memory.
MAX_PROMPT_LINE_BYTES = 8 << 20
MAX_PROMPT_FILE_BYTES = 64 << 20
#: Prompts one file may hold (benchmarks hold hundreds to a few thousand; each is kept as a parsed record).
MAX_PROMPT_RECORDS = 100_000


def _open_text(path: Path) -> Iterator[str]:
    try:
        for line in iter_lines_limited(path, MAX_PROMPT_LINE_BYTES, MAX_PROMPT_FILE_BYTES, "prompt file"):
            yield line.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise SpecgraftError(f"cannot read prompt file {path} ({type(exc).__name__}: {exc}); pass a UTF-8 JSONL "
                             "file (optionally .gz)") from None


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for every non-blank line of a JSONL file (``.gz`` allowed)."""
    path = Path(path)
    require_file(path, "prompt file", "pass a JSONL file of prompts")
    records = []
    for lineno, line in enumerate(_open_text(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecgraftError(f"{path} line {lineno} is not valid JSON ({exc.msg}); fix or remove that line") \
                from None
        if not isinstance(record, dict):
            raise SpecgraftError(f"{path} line {lineno} is a JSON {type(record).__name__}, not an object; each "
                                 "line must be one prompt object")
        records.append((lineno, record))
        if len(records) > MAX_PROMPT_RECORDS:
            raise SpecgraftError(f"{path} holds more than {MAX_PROMPT_RECORDS:,} prompts; pass a smaller file (or "
                                 "a sample of it)")
    return records


def detect_format(record: dict[str, Any]) -> str:
    """The format of a record (see the module docstring)."""
    if "turns" in record:
        return "fastchat"
    if "task_id" in record and "prompt" in record:
        return "humaneval"
    if "question" in record and "answer" in record and not any(f in record for f in DOMAIN_FIELDS):
        return "gsm8k"
    if "instruction" in record and "instances" in record:
        return "self_instruct"
    return "generic"


def _fields(record: dict[str, Any]) -> str:
    return ", ".join(sorted(record)) or "none"


def _text(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise SpecgraftError(f"{where}: field {name!r} is a {type(value).__name__}, not text; fix that record")
    if not value.strip():
        raise SpecgraftError(f"{where}: field {name!r} is empty; remove that record or give it a prompt")
    return value


def _record_prompt(record: dict[str, Any], fmt: str, where: str, lineno: int, label: str,
                   prompt_field: str | None) -> tuple[str, str, list[str]]:
    """(id, default domain, turns) of one record."""
    if prompt_field is not None:
        if prompt_field not in record:
            raise SpecgraftError(f"{where} has no prompt field {prompt_field!r} (fields present: {_fields(record)}); "
                                 "pass one of those to --prompt-field")
        fmt = "generic"
    missing = [f for f in REQUIRED_FIELDS[fmt] if f not in record]
    if missing:
        raise SpecgraftError(f"{where} lacks {', '.join(map(repr, missing))}, which the file's first record "
                             f"({fmt} format) has (fields present: {_fields(record)}); use one format per file")
    if fmt == "fastchat":
        turns = record["turns"]
        turns = [turns] if isinstance(turns, str) else turns
        if not isinstance(turns, list) or not turns:
            raise SpecgraftError(f"{where}: 'turns' must be a non-empty list of user turns; fix that record")
        turns = [_text(t, where, "turns") for t in turns]
        domain = record.get("category") or label
        pid = record.get("question_id", lineno)
        return str(pid), str(domain), turns
    if fmt == "humaneval":
        return str(record["task_id"]), "humaneval", [_text(record["prompt"], where, "prompt")]
    if fmt == "gsm8k":
        return str(lineno), "gsm8k", [_text(record["question"], where, "question")]
    if fmt == "self_instruct":
        instruction = _text(record["instruction"], where, "instruction")
        instances = record.get("instances") or [{}]
        extra = instances[0].get("input", "") if isinstance(instances[0], dict) else ""
        text = instruction + (RAW_TURN_SEPARATOR + extra if isinstance(extra, str) and extra.strip() else "")
        return str(record.get("id", lineno)), "self_instruct", [text]
    # generic
    name = prompt_field or next((f for f in PROMPT_FIELDS if f in record), None)
    if name is None:
        raise SpecgraftError(f"{where} has no prompt field (tried {', '.join(PROMPT_FIELDS)}; fields present: "
                             f"{_fields(record)}); name it with --prompt-field")
    value = record[name]
    turns = [_text(t, where, name) for t in value] if isinstance(value, list) else [_text(value, where, name)]
    if not turns:
        raise SpecgraftError(f"{where}: field {name!r} is an empty list; give at least one turn")
    domain_name = next((f for f in DOMAIN_FIELDS if f in record), None)
    domain = record.get(domain_name) if domain_name else None
    pid = next((record[f] for f in ID_FIELDS if f in record), lineno)
    return str(pid), str(domain) if domain not in (None, "") else label, turns


def load_prompt_file(path: str | os.PathLike, domain_field: str | None = None,
                     prompt_field: str | None = None) -> list[Prompt]:
    """All prompts of one file, in file order (see the module docstring for formats)."""
    path = Path(path)
    records = read_jsonl(path)
    if not records:
        raise SpecgraftError(f"prompt file {path} is empty; pass a JSONL file with one prompt per line")
    label = file_label(path)
    fmt = detect_format(records[0][1])
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, record in records:
        where = f"{path} line {lineno}"
        pid, domain, turns = _record_prompt(record, fmt, where, lineno, label, prompt_field)
        if domain_field is not None:
            if domain_field not in record:
                raise SpecgraftError(f"unknown domain field {domain_field!r} in {where} (fields present: "
                                     f"{_fields(record)}); pass one of those to --domain-field")
            value = record[domain_field]
            if isinstance(value, (dict, list)) or value in (None, ""):
                raise SpecgraftError(f"{where}: domain field {domain_field!r} is {value!r}, not a name; pick a field "
                                     "holding a short text or number")
            domain = str(value)
        if pid in seen:
            raise SpecgraftError(f"{where} repeats prompt id {pid} (first on line {seen[pid]}); ids must be unique "
                                 "within a file")
        seen[pid] = lineno
        prompts.append(Prompt(id=pid, domain=domain, turns=turns, source=str(path)))
    logger.info("read %d prompts (%s format) from %s", len(prompts), fmt if prompt_field is None else "generic", path)
    return prompts


def load_prompts(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    domain_field: str | None = None,
    prompt_field: str | None = None,
    limit_per_domain: int | None = None,
) -> list[Prompt]:
    """Read one or several prompt files (formats auto-detected) into a list of :class:`Prompt`.

    Args:
        paths: a file or a list of files (JSONL, optionally gzip-compressed).
        domain_field: take each record's domain from this field (every record must have it).
        prompt_field: read every file as generic JSONL with the prompt text in this field.
        limit_per_domain: keep only the first N prompts of each domain (file order).

    Ids stay as in the files unless two files share an id; then every id is prefixed with its file's label
    (``mt_bench:81``) so each prompt stays identifiable in ``answers.jsonl``.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise SpecgraftError("no prompt files given; pass at least one JSONL file to --prompts")
    if limit_per_domain is not None and (int(limit_per_domain) != limit_per_domain or limit_per_domain < 1):
        raise SpecgraftError(f"limit per domain must be a positive integer, got {limit_per_domain}")
    per_file = [load_prompt_file(p, domain_field=domain_field, prompt_field=prompt_field) for p in paths]
    all_ids = [p.id for prompts in per_file for p in prompts]
    if len(set(all_ids)) != len(all_ids):
        labels = [file_label(p) for p in paths]
        if len(set(labels)) != len(labels):
            labels = [str(p) for p in paths]
        for label, prompts in zip(labels, per_file):
            for p in prompts:
                p.id = f"{label}:{p.id}"
    out: list[Prompt] = []
    counts: dict[str, int] = {}
    for prompts in per_file:
        for p in prompts:
            if limit_per_domain is not None and counts.get(p.domain, 0) >= limit_per_domain:
                continue
            counts[p.domain] = counts.get(p.domain, 0) + 1
            out.append(p)
    return out


def domains(prompts: Iterable[Prompt]) -> list[str]:
    """The domains of ``prompts`` in first-appearance order."""
    return list(dict.fromkeys(p.domain for p in prompts))


# -- rendering for a target ---------------------------------------------------------------------------------------
def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer carries a chat template (instruct models); base models have none."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_turn(tokenizer: Any, turns: Sequence[str], answers: Sequence[str]) -> tuple[str, list[int]]:
    """The prompt text and ids for user turn ``len(answers)`` of a conversation.

    Args:
        tokenizer: the target's tokenizer.
        turns: the conversation's user turns (at least ``len(answers) + 1``).
        answers: the generated answers to the earlier turns (assistant messages).

    With a chat template: messages user/assistant/.../user plus the generation prompt; the rendered text is
    tokenized without adding special tokens again (templates write BOS themselves). Without: raw text, each
    earlier turn directly followed by its answer (a base model continues the text), turns separated by a blank
    line, tokenized with the tokenizer's special tokens (BOS for Llama-style tokenizers).
    """
    n = len(answers)
    if n >= len(turns):
        raise ValueError(f"turn {n} does not exist in a conversation of {len(turns)} turns")
    if has_chat_template(tokenizer):
        messages: list[dict[str, str]] = []
        for user, answer in zip(turns[:n], answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": turns[n]})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = RAW_TURN_SEPARATOR.join(user + answer for user, answer in zip(turns[:n], answers))
        text = text + RAW_TURN_SEPARATOR + turns[n] if n else turns[n]
        ids = tokenizer(text)["input_ids"]
    return text, [int(i) for i in ids]
