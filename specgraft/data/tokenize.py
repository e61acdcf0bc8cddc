"""Turning normalised records into token ids and a loss mask.

``loss_mask[t] == 1`` marks token ``t`` as a training label: an assistant token of a conversation (its content and
the template's end-of-turn token), or any token of plain text. Trainers shift it together with the labels.

Conversations with a chat template are rendered by ``tokenizer.apply_chat_template``. The assistant tokens come
from ``return_assistant_tokens_mask`` when the template marks replies with ``{% generation %}``; most released
templates (Llama-3, Qwen, Mistral, Gemma) do not, so the fallback renders prefixes of the conversation: the text up
to the generation prompt before assistant turn ``i`` and the text up to the end of that turn bound its span, which
is mapped onto tokens through the tokenizer's character offsets. When a template rewrites history (a later render
is not an extension of an earlier one, e.g. Qwen3 dropping old reasoning), the reply is located by searching its
content in the full render. Without a chat template a conversation is rendered as plain ``User: ...`` /
``Assistant: ...`` lines with BOS first and EOS closing each reply.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

#: Errors a chat template raises for a conversation it does not accept (e.g. Gemma and a system turn).
TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError)

#: Labels of the plain (no chat template) conversation format.
PLAIN_ROLE_LABELS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}
PLAIN_TURN_SEPARATOR = "\n"

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A reply content nobody writes, used to find what a template puts after a reply (its end-of-turn marker).
_SENTINEL = "\u2063specgraft-sentinel\u2063"

Messages = Sequence[Mapping[str, str]]


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's default chat template text, or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # several named templates: the default one renders conversations
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def has_generation_tags(tokenizer: Any) -> bool:
    """True when the chat template marks assistant replies with ``{% generation %}``."""
    template = chat_template_of(tokenizer)
    return bool(template and _GENERATION_TAG.search(template))


def uses_chat_template(tokenizer: Any, use_chat_template: bool = True) -> bool:
    """Whether conversations are rendered with the tokenizer's chat template."""
    return use_chat_template and chat_template_of(tokenizer) is not None


def with_system_prompt(messages: Messages, system_prompt: str | None) -> list[dict[str, str]]:
    """``messages`` as plain dicts, with ``system_prompt`` prepended when given and no system turn exists."""
    out = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    if system_prompt is not None and (not out or out[0]["role"] != "system"):
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def tokenizer_key(tokenizer: Any) -> str:
    """A hash of everything about a tokenizer that changes tokenised data (vocab, merges, specials, template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        body = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), ensure_ascii=False)
    specials = {n: getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    payload = json.dumps(
        [type(tokenizer).__name__, body, specials, chat_template_of(tokenizer)], ensure_ascii=False, sort_keys=True
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


# ---------------------------------------------------------------------------------------------------------------
# plain text


def text_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A plain-text prompt's ids: BOS (when the tokenizer has one) + text, no EOS (how a story target decodes)."""
    ids = _encode(tokenizer, text)
    return ids if tokenizer.bos_token_id is None else [tokenizer.bos_token_id, *ids]


def tokenize_text(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """A plain-text document -> (ids, loss_mask): BOS (when the tokenizer has one) + text + EOS, all labels."""
    ids = text_prompt_ids(tokenizer, text)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids, [1] * len(ids)


# ---------------------------------------------------------------------------------------------------------------
# conversations


def tokenize_conversation(
    tokenizer: Any,
    messages: Messages,
    *,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    method: str = "auto",
) -> tuple[list[int], list[int]]:
    """A conversation -> (ids, loss_mask) with 1 exactly on the assistant replies' tokens.

    Args:
        tokenizer: a transformers tokenizer.
        messages: ``{"role", "content"}`` turns (system/user/assistant).
        use_chat_template: render with the tokenizer's chat template when it has one.
        system_prompt: prepended as a system turn when the conversation has none.
        method: ``auto`` (generation tags when present, else prefixes), ``generation`` or ``prefix``.

    Raises:
        jinja2.TemplateError, ValueError: the template rejects the conversation or a reply cannot be located.
    """
    msgs = with_system_prompt(messages, system_prompt)
    if not uses_chat_template(tokenizer, use_chat_template):
        return _plain_conversation(tokenizer, msgs, add_generation_prompt=False)
    if method == "auto":
        method = "generation" if has_generation_tags(tokenizer) else "prefix"
    if method == "generation":
        enc = tokenizer.apply_chat_template(
            msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
    if method != "prefix":
        raise ValueError(f"unknown assistant-span method {method!r}; use auto, generation or prefix")
    text, spans = assistant_char_spans(tokenizer, msgs)
    return mask_from_char_spans(tokenizer, text, spans)


def prompt_ids(
    tokenizer: Any, messages: Messages, *, use_chat_template: bool = True, system_prompt: str | None = None
) -> list[int]:
    """Token ids of ``messages`` followed by the generation prompt of the next assistant reply.

    Matches :func:`tokenize_conversation`: the ids of a conversation start with the prompt ids of each reply.
    """
    msgs = with_system_prompt(messages, system_prompt)
    if not uses_chat_template(tokenizer, use_chat_template):
        return _plain_conversation(tokenizer, msgs, add_generation_prompt=True)[0]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return _encode(tokenizer, text)


def stop_token_ids(tokenizer: Any, generation_config: Any = None, use_chat_template: bool = True) -> list[int]:
    """Token ids that end a reply: EOS, the model's generation EOS ids and the template's end-of-turn token."""
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.append(source)
        elif source is not None:
            ids.extend(int(x) for x in source)
    if uses_chat_template(tokenizer, use_chat_template):
        eot = end_of_turn_text(tokenizer)
        if eot:
            eot_ids = _encode(tokenizer, eot)
            # Only a single special token is a reliable stop (a multi-token marker may also occur inside text).
            if len(eot_ids) == 1 and eot_ids[0] in set(getattr(tokenizer, "all_special_ids", [])):
                ids.append(eot_ids[0])
    return list(dict.fromkeys(ids))


def end_of_turn_text(tokenizer: Any) -> str:
    """What the chat template writes right after an assistant reply (e.g. ``<|im_end|>``), whitespace stripped."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
    except TEMPLATE_ERRORS:  # a template may reject the probe; then there is no marker to learn
        return ""
    pos = text.rfind(_SENTINEL)
    if pos < 0:
        return ""
    tail = text[pos + len(_SENTINEL):].strip()
    # Keep only the first marker when the template appends more than one thing after the reply.
    return tail.split()[0] if tail else ""


def assistant_char_spans(tokenizer: Any, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and find each assistant reply's character span (content + end-of-turn marker).

    Uses incremental prefixes when the template renders consistently, else a content search.

    Raises:
        ValueError: a reply cannot be found in the render.
    """

    def render(msgs: Messages, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=generation_prompt)

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    eot: str | None = None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(messages[:i], True)
        upto = render(messages[: i + 1], False)
        if upto.startswith(prefix) and full.startswith(upto) and cursor <= len(prefix) < len(upto):
            start, end = len(prefix), len(upto)
            # Separators after the end-of-turn marker (ChatML's "\n") are never generated: not a label.
            end = start + len(full[start:end].rstrip())
        else:
            needle = message["content"].strip()
            start = full.find(needle, cursor) if needle else -1
            if start < 0:
                raise ValueError(f"assistant turn {i} is not found in the rendered chat template")
            end = start + len(needle)
            if eot is None:
                eot = end_of_turn_text(tokenizer)
            if eot and full.startswith(eot, end):
                end += len(eot)
        spans.append((start, end))
        cursor = end
    return full, spans


def mask_from_char_spans(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], use_offsets: bool | None = None
) -> tuple[list[int], list[int]]:
    """Tokenise ``text`` and mark the tokens overlapping any character span.

    Fast tokenizers map tokens to characters through their offsets. Without offsets (slow tokenizers), each span's
    bounds are converted by tokenising the text before them (exact unless a token straddles a bound).
    """
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if use_offsets:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        j = 0
        ordered = sorted(spans)
        for t, (a, b) in enumerate(enc["offset_mapping"]):
            while j < len(ordered) and ordered[j][1] <= a:
                j += 1
            if b > a and j < len(ordered) and a < ordered[j][1] and b > ordered[j][0]:
                mask[t] = 1
        return ids, mask
    ids = _encode(tokenizer, text)
    mask = [0] * len(ids)
    for start, end in spans:
        lo, hi = len(_encode(tokenizer, text[:start])), len(_encode(tokenizer, text[:end]))
        mask[lo:hi] = [1] * (min(hi, len(ids)) - lo)
    return ids, mask


def _plain_conversation(
    tokenizer: Any, messages: Messages, add_generation_prompt: bool
) -> tuple[list[int], list[int]]:
    """``User: ...\\nAssistant: ...</s>\\n`` with BOS first; the reply content and its EOS are the labels.

    Pieces are tokenised separately so the reply's tokens are the ones a model generates after ``Assistant: ``.
    """
    ids: list[int] = []
    mask: list[int] = []

    def add(piece: list[int], label: int) -> None:
        ids.extend(piece)
        mask.extend([label] * len(piece))

    if tokenizer.bos_token_id is not None:
        add([tokenizer.bos_token_id], 0)
    for message in messages:
        label = PLAIN_ROLE_LABELS[message["role"]]
        if message["role"] == "assistant":
            add(_encode(tokenizer, label), 0)
            add(_encode(tokenizer, message["content"]), 1)
            if tokenizer.eos_token_id is not None:
                add([tokenizer.eos_token_id], 1)
            add(_encode(tokenizer, PLAIN_TURN_SEPARATOR), 0)
        else:
            add(_encode(tokenizer, label + message["content"] + PLAIN_TURN_SEPARATOR), 0)
    if add_generation_prompt:
        add(_encode(tokenizer, PLAIN_ROLE_LABELS["assistant"]), 0)
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------
# packing


def pack_sequences(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int, separator_id: int | None
) -> list[tuple[list[int], list[int]]]:
    """Concatenate (ids, loss_mask) pairs and cut the stream into ``max_length`` chunks (the last may be shorter).

    A ``separator_id`` (EOS) is appended, unlabelled, to each sequence that does not already end with it, so
    documents stay delimited. Every label survives: the multiset of labelled tokens is unchanged; chunks without
    any label (a long prompt, a lone separator) are left out.
    """
    stream_ids: list[int] = []
    stream_mask: list[int] = []
    for ids, mask in sequences:
        stream_ids.extend(ids)
        stream_mask.extend(mask)
        if separator_id is not None and (not ids or ids[-1] != separator_id):
            stream_ids.append(separator_id)
            stream_mask.append(0)
    chunks = []
    for i in range(0, len(stream_ids), max_length):
        mask = stream_mask[i : i + max_length]
        if any(mask):
            chunks.append((stream_ids[i : i + max_length], mask))
    return chunks
