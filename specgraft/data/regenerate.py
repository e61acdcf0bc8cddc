"""Rewrite assistant turns with the target (self-distillation data).

For every conversation and every assistant turn in order, the target writes a new reply given the conversation so
far (with its own earlier replies); a conversation ending with a user turn also gets a reply. Training draft heads on
the target's own replies matches what they will see when serving, which matters a lot for chat targets. With
``first_reply_only`` only the first reply is rewritten and the turns after it are dropped: they answered the old
reply, not the new one (one generation per conversation instead of one per assistant turn).

The output is JSON lines ``{"id": <source row>, "messages": [...]}`` in id order, readable as training data
(``format: messages``). The run is resumable: rows are appended to per-process part files in ``<out>.parts/`` as
complete lines, fsynced after each batch; a rerun skips the ids already written and ignores a torn last line. With
several processes (``torchrun --nproc_per_node N`` or ``accelerate launch``) rows are sharded across them; the main
process merges the parts into ``<out>`` atomically once all rows are done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specgraft.data.collate import pad_token_id
from specgraft.data.generate import generate_batch, generation_config, ids_past_tokenizer
from specgraft.data.tokenize import prompt_ids, stop_token_ids, text_prompt_ids, tokenizer_key, with_system_prompt
from specgraft.errors import SpecgraftError
from specgraft.utils.io import atomic_path, atomic_write_json
from specgraft.utils.seeds import derive_seed

logger = logging.getLogger(__name__)

#: Rows read ahead and sorted by length, so batches hold similar lengths (less padding).
WINDOW_BATCHES = 16


@dataclass
class RegenerateStats:
    """What a regeneration run did (summed over processes)."""

    rows: int = 0
    """Conversations written by this run."""
    skipped: int = 0
    """Conversations already written by an earlier, interrupted run."""
    replies: int = 0
    new_tokens: int = 0
    truncated_replies: int = 0
    """Replies that hit max_new_tokens before an end-of-turn token."""
    cut_conversations: int = 0
    """Conversations cut short because the prompt plus max_new_tokens exceeded the model's positions."""
    seconds: float = 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"regenerated {self.rows} conversations ({self.replies} replies, {self.new_tokens} new tokens"
            f"{f', {self.skipped} done earlier' if self.skipped else ''}) in {self.seconds:.1f}s: "
            f"{self.rows_per_s:.2f} rows/s, {self.tokens_per_s:.1f} tokens/s"
            f"{f'; {self.truncated_replies} replies hit max_new_tokens' if self.truncated_replies else ''}"
            f"{f'; {self.cut_conversations} conversations cut at the context limit' if self.cut_conversations else ''}"
        )


def partial_state() -> Any:
    """accelerate's process state; CPU-only multi-process launches (torchrun, gloo) are recognised as such.

    accelerate treats a torchrun launch without a GPU as single-process unless asked for CPU explicitly.
    """
    import torch
    from accelerate import PartialState

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("LOCAL_RANK", "-1")) != -1
    return PartialState(cpu=launched and not torch.cuda.is_available())


def generation_dtype(dtype: str, device: Any) -> str:
    """``auto``: bfloat16 on a GPU that supports it, float32 otherwise; any other name as given."""
    import torch

    if dtype != "auto":
        return dtype
    device = torch.device(device) if device is not None else torch.device("cpu")
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


# ---------------------------------------------------------------------------------------------------------------
# API


def regenerate(
    model: Any,
    tokenizer: Any,
    records: Any,
    out_path: str | os.PathLike,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    first_reply_only: bool = False,
    show_progress: bool = True,
    settings: Mapping[str, Any] | None = None,
) -> RegenerateStats:
    """Have ``model`` rewrite every assistant turn of ``records`` and write the result to ``out_path`` (JSONL).

    Call it in every process of a multi-process launch: rows are sharded by ``accelerate.PartialState``.

    Args:
        model: a transformers causal LM (on its device, eval mode).
        tokenizer: its tokenizer.
        records: normalised conversations (a Dataset from :func:`~specgraft.data.readers.load_records`, or dicts
            with ``messages`` and an int ``row`` or ``id``; the position is the id when both are absent).
        out_path: the JSONL file to write; ``<out_path>.parts/`` holds the work in progress.
        batch_size: conversations generated together (left padding).
        max_new_tokens: longest reply.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_p: nucleus mass when sampling.
        seed: sampling seed (each batch and turn derives its own, so a run with the same layout repeats exactly).
        use_chat_template: render prompts with the tokenizer's chat template when it has one.
        system_prompt: prepended as a system turn where none exists (and written into the output).
        first_reply_only: rewrite only the first reply of each conversation and drop the messages after it.
        show_progress: tqdm progress bar on the main process (its postfix shows the last batch's size, seconds
            and tokens/s; the same goes to the DEBUG log line of every batch).
        settings: extra identity of the run (e.g. the data path); a resume with other settings is refused.

    Returns:
        Statistics summed over processes, with rows/s and tokens/s.

    Raises:
        SpecgraftError: ``out_path`` has unfinished work from a run with other settings, or duplicate ids.
    """
    import torch
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    state = partial_state()
    rank, world = state.process_index, state.num_processes
    source = _Records(records)
    out = Path(out_path)
    parts = out.with_name(out.name + ".parts")
    if out.exists() and not parts.exists():
        logger.info("%s is complete already; delete it to regenerate", out)
        return RegenerateStats(skipped=len(source))

    # Identity of the work in progress: a resume must continue exactly the same job.
    run_settings = {
        "model_key": model_key(model),
        "tokenizer": tokenizer_key(tokenizer),
        "records": source.content_hash(),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p if temperature > 0 else None,
        "seed": seed if temperature > 0 else None,
        "use_chat_template": use_chat_template,
        "system_prompt": system_prompt,
        # Recorded only when set, so unfinished runs from before the option existed still resume.
        **({"first_reply_only": True} if first_reply_only else {}),
        **dict(settings or {}),
    }
    parts.mkdir(parents=True, exist_ok=True)
    _check_resume_settings(parts, run_settings, out)
    own = parts / f"rank{rank:05d}-of-{world:05d}.jsonl"
    _drop_torn_tail(own)
    done = set(_read_parts(parts))
    # Everyone must have read the same "done" set before anyone appends, or the sharding would differ.
    state.wait_for_everyone()
    if state.is_main_process and not (parts / "meta.json").exists():
        atomic_write_json(parts / "meta.json", run_settings)

    pending = [i for i in sorted(source.ids) if i not in done]
    mine = pending[rank::world]
    device = next(model.parameters()).device
    gen = _Generator(model, tokenizer, max_new_tokens, temperature, top_p, use_chat_template)
    local = RegenerateStats(skipped=len(done) if state.is_main_process else 0)
    started = time.perf_counter()
    bar = tqdm(total=len(mine), desc="regenerating", unit="conv", disable=not (show_progress and state.is_main_process))
    with open(own, "a", encoding="utf-8") as fh:
        for window in _chunks(mine, batch_size * WINDOW_BATCHES):
            convs = {i: with_system_prompt(source.messages(i), system_prompt) for i in window}
            if first_reply_only:
                convs = {i: _through_first_reply(c) for i, c in convs.items()}
            # Longest first: similar lengths share a batch, and an out-of-memory shows up at once.
            ordered = sorted(window, key=lambda i: -sum(len(m["content"]) for m in convs[i]))
            for batch_ids in _chunks(ordered, batch_size):
                batch_seed = derive_seed(seed, batch_ids[0])
                tokens_before, replies_before, batch_started = local.new_tokens, local.replies, time.perf_counter()
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    results = gen.conversations([convs[i] for i in batch_ids], batch_seed, local)
                batch = _BatchTiming(len(batch_ids), local.replies - replies_before, local.new_tokens - tokens_before,
                                     time.perf_counter() - batch_started)
                logger.debug("%s", batch.describe())
                bar.set_postfix_str(batch.postfix(), refresh=False)
                lines = [json.dumps({"id": i, "messages": msgs}, ensure_ascii=False) + "\n"
                         for i, msgs in zip(batch_ids, results)]
                fh.write("".join(lines))
                fh.flush()
                os.fsync(fh.fileno())
                local.rows += len(batch_ids)
                bar.update(len(batch_ids))
    bar.close()
    local.seconds = time.perf_counter() - started

    state.wait_for_everyone()
    gathered = gather_object([asdict(local)]) if world > 1 else [asdict(local)]
    total = RegenerateStats()
    for item in gathered:
        for key, value in item.items():
            setattr(total, key, max(total.seconds, value) if key == "seconds" else getattr(total, key) + value)
    if state.is_main_process:
        _merge(parts, out, source.ids)
        logger.info("%s", total.summary())
    state.wait_for_everyone()
    return total


#: A paragraph's first sentence: up to the first ``.``, ``!`` or ``?`` (and a closing quote) before a space or the end.
FIRST_SENTENCE = re.compile(r"(.+?[.!?][\"\u201d]?)(\s|$)")
#: Paragraphs generated together in plain-text regeneration (left-padded; prompts are one sentence, so similar).
TEXT_BATCH_SIZE = 64


def first_sentence(text: str) -> str:
    """``text``'s first sentence, whitespace collapsed (the whole paragraph when no sentence ends in it)."""
    flat = " ".join(text.split())
    match = FIRST_SENTENCE.match(flat)
    return match.group(1) if match else flat


def continue_texts(
    model: Any,
    tokenizer: Any,
    records: Any,
    out_path: str | os.PathLike,
    *,
    batch_size: int = TEXT_BATCH_SIZE,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    prompt_of: Callable[[str], str] | None = first_sentence,
) -> RegenerateStats:
    """Plain-text self-distillation: every paragraph is replaced by its first sentence and ``model``'s continuation.

    A story target decodes from a one-sentence prompt (BOS + the sentence, no template), so its drafter should
    learn the target's own continuations of such prompts, not the human text after them. The prompt is BOS (when
    the tokenizer has one) + :func:`first_sentence`; the continuation stops at the first stop token (dropped: the
    tokenizer adds EOS back when the text is tokenised for training) or after ``max_new_tokens``. Writes JSON lines
    ``{"id": <row>, "text": <sentence + continuation>}`` in row order, atomically (a rerun starts over).

    Args:
        model: a transformers causal LM (on its device).
        tokenizer: its tokenizer.
        records: plain-text records (a Dataset with ``text`` and optionally ``row``, or dicts with ``text``).
        out_path: the JSONL file to write.
        batch_size: paragraphs generated together (left padding).
        max_new_tokens: longest continuation.
        temperature: 0 for greedy decoding (what greedy speculative decoding verifies against), else sampling.
        seed: sampling seed (each batch derives its own from its first row).
        prompt_of: the prompt taken from each text (default its first sentence); None: each text is already a
            prompt and is continued as it is, whitespace included (the demo's cut code and records prompts).
    """
    texts = list(records["text"]) if hasattr(records, "column_names") else [r["text"] for r in records]
    if hasattr(records, "column_names"):
        rows = list(records["row"]) if "row" in records.column_names else list(range(len(texts)))
    else:
        rows = [int(r.get("row", i)) for i, r in enumerate(records)]
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None), use_chat_template=False)
    config = generation_config(max_new_tokens, temperature, pad_token_id(tokenizer, stops), stops,
                               suppress_tokens=ids_past_tokenizer(model, tokenizer))
    stats = RegenerateStats()
    started = time.perf_counter()
    with atomic_path(Path(out_path)) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for lo in range(0, len(texts), batch_size):
            sentences = [t if prompt_of is None else prompt_of(t) for t in texts[lo:lo + batch_size]]
            prompts = [text_prompt_ids(tokenizer, s) for s in sentences]
            results = generate_batch(model, prompts, config, derive_seed(seed, int(rows[lo])))
            for row, prompt, (tokens, stopped) in zip(rows[lo:lo + batch_size], prompts, results):
                body = tokens[:-1] if stopped else tokens  # [new tokens], the stop token dropped
                text = tokenizer.decode(prompt + body, skip_special_tokens=True)
                fh.write(json.dumps({"id": int(row), "text": text}, ensure_ascii=False) + "\n")
                stats.rows += 1
                stats.replies += 1
                stats.new_tokens += len(body)
                stats.truncated_replies += 0 if stopped else 1
    stats.seconds = time.perf_counter() - started
    what = "paragraphs from their first sentence" if prompt_of is first_sentence else "prompts"
    logger.info("continued %d %s: %d new tokens in %.1fs (%.1f tokens/s)", stats.rows, what, stats.new_tokens,
                stats.seconds, stats.tokens_per_s)
    return stats


@dataclass(frozen=True)
class _BatchTiming:
    """What one batch of conversations took (the progress bar's postfix and the per-batch log line)."""

    conversations: int
    replies: int
    new_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        return (f"batch of {self.conversations} conversations: {self.replies} replies, {self.new_tokens} new tokens "
                f"in {self.seconds:.2f}s ({self.tokens_per_s:.1f} tokens/s)")

    def postfix(self) -> str:
        return f"last batch {self.conversations} conv, {self.seconds:.1f}s, {self.tokens_per_s:.0f} tok/s"


def model_key(model: Any) -> str:
    """A hash identifying a model's weights: its config plus a strided sample of every parameter tensor."""
    import torch

    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode("utf-8"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            # A strided sample identifies weights without hashing every byte of a multi-GB model.
            sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy()
            h.update(name.encode("utf-8"))
            h.update(sample.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# generation


class _Generator:
    """Batched, left-padded generation of one reply per conversation and turn."""

    def __init__(
        self, model: Any, tokenizer: Any, max_new_tokens: int, temperature: float, top_p: float,
        use_chat_template: bool,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None), use_chat_template)
        self.pad_id = pad_token_id(tokenizer, self.stop_ids)
        self.config = generation_config(max_new_tokens, temperature, self.pad_id, self.stop_ids, top_p=top_p,
                                        suppress_tokens=ids_past_tokenizer(model, tokenizer))
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_positions = int(limit) if limit else None

    def conversations(
        self, convs: Sequence[list[dict[str, str]]], seed: int, stats: RegenerateStats
    ) -> list[list[dict[str, str]]]:
        """New messages for each conversation: assistant turns rewritten in order (plus a final reply)."""
        msgs = [list(c) for c in convs]
        slots = [_reply_slots(c) for c in msgs]
        step = 0
        while True:
            active = [c for c in range(len(msgs)) if step < len(slots[c])]
            if not active:
                return msgs
            prompts, keep = [], []
            for c in active:
                slot = slots[c][step]
                ids = prompt_ids(self.tokenizer, msgs[c][:slot], use_chat_template=self.use_chat_template)
                if self.max_positions and len(ids) + self.max_new_tokens > self.max_positions:
                    msgs[c] = _cut(msgs[c], slot)
                    slots[c] = []
                    stats.cut_conversations += 1
                    continue
                prompts.append(ids)
                keep.append(c)
            if keep:
                replies = self.generate(prompts, derive_seed(seed, step), stats)
                for c, reply in zip(keep, replies):
                    slot = slots[c][step]
                    turn = {"role": "assistant", "content": reply}
                    if slot == len(msgs[c]):
                        msgs[c].append(turn)
                    else:
                        msgs[c][slot] = turn
            step += 1

    def generate(self, prompts: Sequence[Sequence[int]], seed: int, stats: RegenerateStats) -> list[str]:
        """One reply per prompt (token ids); ``seed`` seeds sampling."""
        replies = []
        for tokens, stopped in generate_batch(self.model, prompts, self.config, seed):
            if stopped:
                stats.new_tokens += len(tokens)
                tokens = tokens[:-1]  # the stop token ends the reply; it is not part of its text
            else:
                stats.truncated_replies += 1
                stats.new_tokens += len(tokens)
            replies.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        stats.replies += len(prompts)
        return replies


def _reply_slots(messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Message indices the target writes: every assistant turn, plus a new one after a final user turn."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] == "user":
        slots.append(len(messages))
    return slots


def _through_first_reply(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to its first reply slot: later turns followed from the reply being replaced."""
    slots = _reply_slots(messages)
    return messages[: slots[0] + 1] if slots else messages


def _cut(messages: list[dict[str, str]], slot: int) -> list[dict[str, str]]:
    """The conversation before ``slot``, ending at its last reply when it has one."""
    head = messages[:slot]
    last = max((i for i, m in enumerate(head) if m["role"] == "assistant"), default=None)
    return head[: last + 1] if last is not None else head


def _chunks(items: Sequence[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


# ---------------------------------------------------------------------------------------------------------------
# records, part files, merging


class _Records:
    """Uniform access to records given as a Dataset or a list of dicts: ids and messages by id."""

    def __init__(self, records: Any) -> None:
        self.records = records
        columns = getattr(records, "column_names", None)
        if columns is not None:
            if "messages" not in columns:
                raise SpecgraftError("regenerate needs conversation records with a messages column")
            ids = list(records["row"]) if "row" in columns else list(range(len(records)))
        else:
            ids = [int(r.get("row", r.get("id", i))) for i, r in enumerate(records)]
        self.ids = [int(i) for i in ids]
        if len(set(self.ids)) != len(self.ids):
            raise SpecgraftError("regenerate got records with duplicate ids; give each conversation its own row id")
        self.position = {i: p for p, i in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def content_hash(self) -> str:
        """A hash of every id and conversation (a resume must see the same data)."""
        h = hashlib.sha256(json.dumps(self.ids).encode("utf-8"))
        if hasattr(self.records, "iter"):
            batches = (b["messages"] for b in self.records.select_columns(["messages"]).iter(batch_size=1000))
        else:
            batches = iter([[r["messages"] for r in self.records]])
        for batch in batches:
            h.update(json.dumps(batch, ensure_ascii=False, default=str).encode("utf-8"))
        return h.hexdigest()

    def messages(self, row_id: int) -> list[dict[str, str]]:
        return [{"role": m["role"], "content": m["content"]} for m in self.records[self.position[row_id]]["messages"]]


def _check_resume_settings(parts: Path, settings: Mapping[str, Any], out: Path) -> None:
    meta = parts / "meta.json"
    if not meta.exists():
        return
    try:
        previous = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return  # an unreadable meta (killed mid-write cannot happen: atomic) is rewritten
    normalised = json.loads(json.dumps(dict(settings), default=str))
    changed = sorted(k for k in set(previous) | set(normalised) if previous.get(k) != normalised.get(k))
    if changed:
        raise SpecgraftError(
            f"{parts} holds an unfinished run with other settings ({', '.join(changed)} differ); rerun with the "
            f"same settings to resume, or delete {parts} (or choose another --out than {out.name}) to start over"
        )


def _drop_torn_tail(path: Path) -> None:
    """Cut a part file back to its last complete line (a run killed mid-write leaves a torn one)."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as fh:
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())


def _read_parts(parts: Path) -> dict[int, str]:
    """id -> JSON line of every complete, valid row in the part files (first occurrence wins)."""
    rows: dict[int, str] = {}
    for part in sorted(parts.glob("rank*-of-*.jsonl")):
        data = part.read_bytes()
        # The piece after the last newline is empty or a torn line: never a row.
        for raw in data.split(b"\n")[:-1]:
            try:
                line = raw.decode("utf-8")
                obj = json.loads(line)
                row_id = int(obj["id"])
                if not isinstance(obj["messages"], list):
                    continue
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            rows.setdefault(row_id, line)
    return rows


def _merge(parts: Path, out: Path, ids: Sequence[int]) -> None:
    rows = _read_parts(parts)
    missing = [i for i in ids if i not in rows]
    if missing:
        raise SpecgraftError(
            f"{len(missing)} rows (e.g. id {missing[0]}) are missing from {parts} after generation; rerun the "
            "same command to finish them"
        )
    with atomic_path(out) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            for i in sorted(ids):
                fh.write(rows[i] + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    shutil.rmtree(parts)


if __name__ == "__main__":  # `python -m specgraft.data.regenerate ...` (e.g. under torchrun) = `specgraft regenerate`
    import sys

    from specgraft.cli import main

    sys.exit(main(["regenerate", *sys.argv[1:]]))
