"""Tokenisation: the loss mask is exactly the assistant tokens, on every template path; packing keeps labels."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specgraft.data.tokenize import (
    assistant_char_spans,
    end_of_turn_text,
    has_generation_tags,
    mask_from_char_spans,
    pack_sequences,
    prompt_ids,
    stop_token_ids,
    tokenize_conversation,
    tokenize_text,
)

# A Llama-3 style template (header tokens, no trailing newline, no generation tags) written with ChatML's specials.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '<|im_end|>\n\n' + (m['content'] | trim) + '</s>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\n\n' }}{% endif %}"
)
# A template whose render of a prefix is not a prefix of the full render (it counts the turns up front), like
# templates that rewrite history (Qwen3 drops old reasoning): spans must be found by searching the replies.
COUNTING_TEMPLATE = "{{ messages | length }} turns\n" + (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _labelled_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def _assistant_text(conv, suffix: str) -> str:
    return "".join(m["content"] + suffix for m in conv if m["role"] == "assistant")


def test_generation_tag_path_masks_exactly_the_replies(tiny_tok, conversations):
    assert has_generation_tags(tiny_tok)
    for conv in conversations:
        ids, mask = tokenize_conversation(tiny_tok, conv)
        assert ids == list(tiny_tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
        assert _labelled_text(tiny_tok, ids, mask) == _assistant_text(conv, "<|im_end|>")


def test_prefix_path_matches_the_generation_tag_path(tiny_tok, tok_no_tags, conversations):
    assert not has_generation_tags(tok_no_tags)
    for conv in conversations:
        tagged = tokenize_conversation(tiny_tok, conv)
        fallback = tokenize_conversation(tok_no_tags, conv)
        forced = tokenize_conversation(tiny_tok, conv, method="prefix")
        assert fallback == tagged == forced
        ids, mask = fallback
        assert _labelled_text(tok_no_tags, ids, mask) == _assistant_text(conv, "<|im_end|>")


@pytest.mark.parametrize("template", [HEADER_TEMPLATE, COUNTING_TEMPLATE], ids=["header", "history-rewriting"])
def test_other_templates_mask_the_replies_and_their_end_token(tok_no_tags, conversations, template):
    tok_no_tags.chat_template = template
    eot = end_of_turn_text(tok_no_tags)
    assert eot == ("</s>" if template is HEADER_TEMPLATE else "<|im_end|>")
    for conv in conversations:
        ids, mask = tokenize_conversation(tok_no_tags, conv)
        assert ids == tok_no_tags(tok_no_tags.apply_chat_template(conv, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        # The header template trims contents; the replies here have no outer whitespace, so they survive unchanged.
        assert _labelled_text(tok_no_tags, ids, mask) == _assistant_text(conv, eot)


def test_plain_concatenation_without_a_template(tok_plain, conversations):
    for conv in conversations:
        ids, mask = tokenize_conversation(tok_plain, conv)
        assert ids[0] == tok_plain.bos_token_id and mask[0] == 0
        assert _labelled_text(tok_plain, ids, mask) == _assistant_text(conv, "</s>")
        text = tok_plain.decode(ids)
        assert "User: " + conv[-2]["content"] + "\nAssistant: " + conv[-1]["content"] + "</s>\n" in text


def test_use_chat_template_false_renders_plain_lines(tiny_tok, tok_plain, conversations):
    assert tokenize_conversation(tiny_tok, conversations[1], use_chat_template=False) == tokenize_conversation(
        tok_plain, conversations[1]
    )


@pytest.mark.parametrize("which", ["tags", "no_tags", "plain"])
def test_prompt_ids_prefix_the_conversation(tiny_tok, tok_no_tags, tok_plain, conversations, which):
    """The prompt given to generation equals the training ids up to each reply (what the head sees at serving)."""
    tok = {"tags": tiny_tok, "no_tags": tok_no_tags, "plain": tok_plain}[which]
    conv = conversations[1]
    ids, mask = tokenize_conversation(tok, conv)
    for i, m in enumerate(conv):
        if m["role"] == "assistant":
            prompt = prompt_ids(tok, conv[:i])
            assert ids[: len(prompt)] == prompt
            assert mask[len(prompt) - 1] == 0 and mask[len(prompt)] == 1


def test_system_prompt_is_prepended_only_when_missing(tiny_tok, conversations):
    ids, mask = tokenize_conversation(tiny_tok, conversations[0], system_prompt="Be brief.")
    assert tiny_tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert _labelled_text(tiny_tok, ids, mask) == _assistant_text(conversations[0], "<|im_end|>")
    with_system = tokenize_conversation(tiny_tok, conversations[1], system_prompt="ignored")
    assert with_system == tokenize_conversation(tiny_tok, conversations[1])


def test_span_mapping_without_offsets_matches_offsets(tok_no_tags, conversations):
    for conv in conversations:
        text, spans = assistant_char_spans(tok_no_tags, conv)
        assert mask_from_char_spans(tok_no_tags, text, spans, use_offsets=False) == mask_from_char_spans(
            tok_no_tags, text, spans, use_offsets=True
        )


def test_unlocatable_reply_raises(tok_no_tags):
    tok_no_tags.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="assistant turn 1 is not found"):
        tokenize_conversation(tok_no_tags, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "zzz"}])


def test_plain_text_is_all_labels_with_bos_and_eos(tiny_tok):
    ids, mask = tokenize_text(tiny_tok, "Once upon a time")
    assert ids[0] == tiny_tok.bos_token_id and ids[-1] == tiny_tok.eos_token_id
    assert tiny_tok.decode(ids[1:-1]) == "Once upon a time"
    assert mask == [1] * len(ids)


def test_stop_tokens_include_the_template_end_of_turn(tiny_tok, tok_plain):
    assert stop_token_ids(tiny_tok) == [tiny_tok.eos_token_id, tiny_tok.convert_tokens_to_ids("<|im_end|>")]
    assert stop_token_ids(tok_plain) == [tok_plain.eos_token_id]


def _random_sequences(rng, eos, all_labels):
    seqs = []
    for _ in range(20):
        n = rng.randint(1, 30)
        ids = [rng.randint(3, 99) for _ in range(n)]
        mask = [1] * n if all_labels else [rng.randint(0, 1) for _ in range(n)]
        if rng.random() < 0.3:
            ids[-1] = eos  # already ends with the separator: no second one
        seqs.append((ids, mask))
    return seqs


def test_packing_preserves_every_label():
    rng = random.Random(0)
    seqs = _random_sequences(rng, eos=2, all_labels=False)
    chunks = pack_sequences(seqs, max_length=16, separator_id=2)

    def labels(pairs):
        return Counter(i for ids, mask in pairs for i, m in zip(ids, mask) if m)

    assert labels(chunks) == labels(seqs)
    assert all(len(ids) == len(mask) <= 16 for ids, mask in chunks)
    assert all(any(mask) for _, mask in chunks)


def test_packing_chunks_the_eos_delimited_stream():
    rng = random.Random(1)
    seqs = _random_sequences(rng, eos=2, all_labels=True)
    chunks = pack_sequences(seqs, max_length=16, separator_id=2)
    stream = [i for ids, _ in seqs for i in (ids if ids[-1] == 2 else [*ids, 2])]
    assert [len(ids) for ids, _ in chunks[:-1]] == [16] * (len(chunks) - 1)
    assert [i for ids, _ in chunks for i in ids] == stream
    separators = [m for ids, mask in chunks for i, m in zip(ids, mask) if i == 2]
    # Added separators are not labels; a sequence's own final EOS keeps its label.
    assert separators.count(1) == sum(1 for ids, _ in seqs if ids[-1] == 2)
