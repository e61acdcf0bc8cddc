"""Readers: every supported source normalised to one schema.

Conversations become a ``messages`` column (a list of ``{"role", "content"}`` with roles ``system``, ``user``,
``assistant``); plain text becomes a ``text`` column. Both carry ``row``, the record's index in the source (counted
across the sorted files of a folder), so errors and regenerated rows can point back at it.

Sources: ShareGPT JSON/JSONL (``conversations`` of ``from``/``value``), OpenAI-style ``messages`` (``role``/
``content``), JSONL with a ``text`` field, ``.txt`` files (one document per blank-line-separated paragraph),
folders written by ``datasets.save_to_disk`` (a Dataset, or a DatasetDict and a split), and folders of such files.
Loading goes through ``datasets`` (``load_dataset("json"|"text")``, ``load_from_disk``) and the normalisation is
a batched ``map`` whose result is cached under the fingerprint of the source files (path and content hash).
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from specgraft.errors import SpecgraftError
from specgraft.utils.io import atomic_path, atomic_write_json, iter_lines_limited, sha256_file

logger = logging.getLogger(__name__)

#: Bump when the normalised output of the same source changes (invalidates cached records).
READER_VERSION = 2

FORMATS = ("auto", "sharegpt", "messages", "text", "disk")
#: Columns that identify a source's kind, in detection order.
ACCEPTED_COLUMNS = {"conversations": "sharegpt", "messages": "messages", "text": "text"}
DATA_SUFFIXES = (".json", ".jsonl", ".txt", ".json.gz", ".jsonl.gz", ".txt.gz")

#: Source role names (lower-cased) -> normalised role. ShareGPT dumps use human/gpt; others use user/assistant.
ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}

MESSAGES_FEATURES = datasets.Features(
    {
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "row": datasets.Value("int64"),
    }
)
TEXT_FEATURES = datasets.Features({"text": datasets.Value("string"), "row": datasets.Value("int64")})

# Status codes written by the normalising map (a column, so drops can be counted after a multi-process map).
_OK, _EMPTY, _BAD_ROLE = 0, 1, 2
# Paragraph separator of plain-text files: a blank line, possibly holding spaces or tabs.
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
# JSON's insignificant whitespace, and how much of each end of a .json file tells whether it is an open array.
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_PEEK_BYTES = 4096


def default_cache_dir() -> Path:
    """``~/.cache/specgraft/datasets`` (``$XDG_CACHE_HOME`` respected)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specgraft" / "datasets"


def source_files(path: str | os.PathLike, key: str = "data.path") -> list[Path]:
    """The files that make up a source (the file itself, a saved dataset's files, or a folder's data files);
    ``key`` is the recipe field the error messages name.

    Raises:
        SpecgraftError: the path does not exist, or a folder holds no data file.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise SpecgraftError(
            f"{key.replace('.', ' ').replace('_', ' ')} {path} does not exist; set {key} to a .json/.jsonl/.txt "
            "file, a folder saved with datasets' save_to_disk, or a folder of such files"
        )
    if p.is_file():
        return [p]
    if _is_saved_dataset(p):
        return sorted(f for f in p.rglob("*") if f.is_file())
    files = sorted(f for f in p.rglob("*") if f.is_file() and _is_data_file(f))
    if not files:
        raise SpecgraftError(
            f"folder {path} holds no data file ({', '.join(DATA_SUFFIXES)}) and was not saved with save_to_disk; "
            f"point {key} at the data itself"
        )
    return files


def source_fingerprint(path: str | os.PathLike, format: str = "auto", split: str = "train") -> str:
    """A hash of a source: its files' absolute paths and CONTENTS (SHA-256), plus format/split.

    Contents, not size and mtime: a file edited in place keeps both when the edit is the same length and the
    mtime is restored (rsync -t, git checkout, copying tools), and the cache would serve the old rows.
    """
    parts: list[Any] = [READER_VERSION, format, split]
    for f in source_files(path):
        parts.append([str(f.resolve()), _content_hash(f)])
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()


#: (path, size, mtime_ns, ctime_ns, inode) -> SHA-256, so that one run hashes each file once. ctime cannot be set
#: by the user and changes on every write or utime, so a stale entry cannot be hit after an edit.
_CONTENT_HASHES: dict[tuple[str, int, int, int, int], str] = {}


def _content_hash(f: Path) -> str:
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _CONTENT_HASHES:
        _CONTENT_HASHES[key] = sha256_file(f)
    return _CONTENT_HASHES[key]


def load_records(
    path: str | os.PathLike,
    format: str = "auto",
    split: str = "train",
    *,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int = 1,
) -> datasets.Dataset:
    """Read a source into normalised records.

    Args:
        path: a data file, a folder saved with ``save_to_disk``, or a folder of data files (read in sorted order).
        format: ``auto`` (detected from the columns / suffix), ``sharegpt``, ``messages``, ``text`` or ``disk``.
        split: the split to take when the source is a saved ``DatasetDict``.
        cache_dir: where ``datasets`` caches the parsed files and the normalised records.
        num_proc: worker processes for the normalising ``map``.

    Returns:
        A Dataset with columns ``messages`` + ``row`` (conversations) or ``text`` + ``row`` (plain text).
        Leading assistant turns (before any user turn) are dropped, as FastChat does for ShareGPT; conversations
        with a role outside system/user/assistant and empty texts are dropped with a warning count.

    Raises:
        SpecgraftError: missing path, unknown format, a source with none of the accepted columns, a folder mixing
            conversations and plain text, an empty source.
    """
    if format not in FORMATS:
        raise SpecgraftError(f"unknown data format {format!r}; use one of {', '.join(FORMATS)}")
    root = Path(path).expanduser()
    files = source_files(root)  # also checks existence
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = source_fingerprint(root, format, split)

    if root.is_dir() and _is_saved_dataset(root):
        parts = [(root, _load_disk(root, split))]
    elif format == "disk":
        raise SpecgraftError(
            f"data.format is disk but {path} is not a folder saved with save_to_disk; use format auto"
        )
    else:
        empty = [f for f in files if f.stat().st_size == 0]
        if empty and len(empty) == len(files):
            raise SpecgraftError(f"{path} is empty; point data.path at a file with records")
        if empty:
            logger.warning("skipping %d empty file(s) in %s (e.g. %s)", len(empty), path, empty[0].name)
        # datasets' own cache is keyed by path and mtime: key its folder by content too.
        parts = [(f, _load_file(f, format, cache / key[:24])) for f in files if f not in empty]

    normalised: list[datasets.Dataset] = []
    kinds: set[str] = set()
    offset = 0
    for i, (src, raw) in enumerate(parts):
        kind = _detect_kind(raw, src, format)
        kinds.add("text" if kind == "text" else "messages")
        if len(kinds) > 1:
            raise SpecgraftError(
                f"{path} mixes conversations and plain text (at {src.name}); keep one kind per data folder"
            )
        paragraphs = src.is_file() and src.name.lower().endswith((".txt", ".txt.gz"))
        cache_file = cache / "records" / f"{key[:24]}-{i}.arrow"
        out = _normalise(raw, kind, offset, paragraphs, cache_file, f"{key}-{i}", num_proc, src.name)
        offset += len(raw)
        out = _drop_invalid(out, src)
        normalised.append(out)
    records = normalised[0] if len(normalised) == 1 else datasets.concatenate_datasets(normalised)
    if len(records) == 0:
        raise SpecgraftError(f"{path} holds no usable record; check that the file is not empty")
    logger.info("read %d %s from %s", len(records), "conversations" if kinds == {"messages"} else "documents", path)
    return records


def subsample(records: datasets.Dataset, num_samples: int | None, seed: int) -> datasets.Dataset:
    """At most ``num_samples`` records, drawn by a seeded shuffle (all records, in order, when None)."""
    if num_samples is None or num_samples >= len(records):
        return records
    return records.shuffle(seed=seed, keep_in_memory=True).select(range(num_samples), keep_in_memory=True)


def is_conversations(records: datasets.Dataset) -> bool:
    """True for normalised conversation records, False for plain text."""
    return "messages" in records.column_names


# ---------------------------------------------------------------------------------------------------------------
# loading


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "state.json").exists())


def _is_data_file(f: Path) -> bool:
    return not f.name.startswith(".") and f.name.lower().endswith(DATA_SUFFIXES)


def _load_disk(root: Path, split: str) -> datasets.Dataset:
    loaded = datasets.load_from_disk(str(root))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SpecgraftError(
                f"{root} has no split {split!r} (it has {', '.join(loaded)}); set data.split to one of them"
            )
        return loaded[split]
    return loaded


def _load_file(f: Path, format: str, cache: Path) -> datasets.Dataset:
    name = f.name.lower()
    is_txt = name.endswith((".txt", ".txt.gz"))
    hf_cache = str(cache / "hf")
    _require_utf8(f)
    try:
        if is_txt:
            # Paragraph mode splits on "\n\n"; _normalise re-splits on blank lines holding whitespace.
            return datasets.load_dataset(
                "text", data_files=str(f), split="train", sample_by="paragraph", cache_dir=hf_cache
            )
        if not name.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")):
            raise SpecgraftError(
                f"cannot read {f}: unknown file type; use .json, .jsonl or .txt (or a folder saved with save_to_disk)"
            )
        array = _json_array_state(f) if name.endswith(".json") else None
        if array == "open":
            # Not closed by "]": a dump cut off mid-record (ShareGPT V3 as shipped). Keep what is complete.
            return datasets.load_dataset("json", data_files=str(_salvaged_array(f, cache)), split="train",
                                         cache_dir=hf_cache)
        return datasets.load_dataset("json", data_files=str(f), split="train", cache_dir=hf_cache)
    except SpecgraftError:
        raise
    except Exception as exc:  # datasets wraps parser errors in several types; all mean "unreadable file"
        if not is_txt and _json_array_state(f) == "closed":
            scan_json_array(f, lambda record: None)  # raises with the line and column of the damage
        detail = _first_line(exc)
        expected = "UTF-8 text" if is_txt else "valid JSON / JSON lines"
        raise SpecgraftError(f"could not read {f} ({detail}); check that it is {expected}") from None


# ---------------------------------------------------------------------------------------------------------------
# JSON arrays cut off at the end


@dataclass(frozen=True)
class ArrayEnd:
    """How a JSON array file ended: its complete records and, when it was cut off, where."""

    records: int
    truncated: bool
    file_bytes: int
    #: 1-based line of the file's last character (where the cut is, when truncated).
    end_line: int
    #: 1-based line where the incomplete record starts (None when the cut falls between records or no cut).
    cut_record_line: int | None = None

    def describe(self, path: Path) -> str:
        where = f", inside record {self.records + 1} (from line {self.cut_record_line})" if self.cut_record_line else ""
        return (f"{path} is a JSON array cut off at its end (byte {self.file_bytes}, line {self.end_line}{where}): "
                f"kept the {self.records} complete records before the cut")


def _json_array_state(f: Path) -> str | None:
    """``closed`` / ``open`` (no final ``]``) for a file whose content is a JSON array, None for anything else."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(_PEEK_BYTES).removeprefix(codecs.BOM_UTF8).lstrip()
        if not head.startswith(b"["):
            return None
        fh.seek(max(0, size - _PEEK_BYTES))
        tail = fh.read().rstrip()
    return "closed" if tail.endswith(b"]") else "open"


def _cut_at_end(text: str, exc: json.JSONDecodeError) -> bool:
    """True when a decode error means "the text ended" rather than "the text is wrong here"."""
    if exc.msg.startswith("Unterminated string"):
        return True  # the string scanner found no closing quote (nor any quote, escape or newline) before the end
    rest = text[exc.pos :].strip()
    return rest == "" or any(literal.startswith(rest) for literal in ("true", "false", "null"))


def scan_json_array(path: str | os.PathLike, on_record: Callable[[Any], None]) -> ArrayEnd:
    """Decode a JSON array file element by element, passing each complete element to ``on_record``.

    An array cut off at the end (mid-record or between records) ends the scan with ``truncated`` set; anything
    else that is not JSON is refused with its line and column.

    Raises:
        SpecgraftError: the file is not UTF-8, not a JSON array, or damaged anywhere but at its end.
    """
    path = Path(path)
    try:
        text = path.read_bytes().removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecgraftError(f"could not read {path}: byte {exc.start} is not UTF-8; check that it is valid JSON "
                             "in UTF-8") from None
    decoder = json.JSONDecoder()
    n_bytes = path.stat().st_size

    def damaged(exc: json.JSONDecodeError, record: int) -> SpecgraftError:
        return SpecgraftError(f"could not read {path}: not valid JSON at line {exc.lineno} column {exc.colno} "
                              f"({exc.msg}), in record {record + 1} of the array; fix the file or re-download it")

    def end(count: int, truncated: bool, record_start: int | None = None) -> ArrayEnd:
        last_line = text.count("\n", 0, max(len(text.rstrip()), 1) - 1) + 1
        start_line = text.count("\n", 0, record_start) + 1 if record_start is not None else None
        return ArrayEnd(count, truncated, n_bytes, last_line, start_line)

    idx = _JSON_SPACE.match(text).end()
    if text[idx : idx + 1] != "[":
        raise SpecgraftError(f"could not read {path}: it is not a JSON array; check that it is valid JSON")
    count = 0
    idx = _JSON_SPACE.match(text, idx + 1).end()
    if text[idx : idx + 1] == "]":
        return end(0, truncated=False)
    while True:
        if idx >= len(text):
            return end(count, truncated=True)
        try:
            record, stop = decoder.raw_decode(text, idx)
        except json.JSONDecodeError as exc:
            if _cut_at_end(text, exc):
                return end(count, truncated=True, record_start=idx)
            raise damaged(exc, count) from None
        on_record(record)
        count += 1
        idx = _JSON_SPACE.match(text, stop).end()
        if idx >= len(text):
            return end(count, truncated=True)
        if text[idx] == ",":
            idx = _JSON_SPACE.match(text, idx + 1).end()
        elif text[idx] == "]":
            if text[idx + 1 :].strip():
                raise damaged(json.JSONDecodeError("Extra data after the array", text, idx + 1), count)
            return end(count, truncated=False)
        else:
            raise damaged(json.JSONDecodeError("Expecting ',' delimiter", text, idx), count)


def _salvaged_array(f: Path, cache: Path) -> Path:
    """The complete records of a cut-off JSON array as JSON lines in the cache (written once per file version),
    with a warning that says how many were kept and where the file ends."""
    st = f.stat()
    key = hashlib.sha256(json.dumps([READER_VERSION, str(f.resolve()), st.st_size, st.st_mtime_ns]).encode())
    stem = cache / "salvaged" / key.hexdigest()[:24]
    lines, meta = stem.with_suffix(".jsonl"), stem.with_suffix(".json")
    if lines.is_file() and meta.is_file():
        info = ArrayEnd(**json.loads(meta.read_text(encoding="utf-8")))
    else:
        with atomic_path(lines) as tmp, open(tmp, "w", encoding="utf-8") as out:
            info = scan_json_array(f, lambda record: out.write(json.dumps(record, ensure_ascii=False) + "\n"))
        atomic_write_json(meta, dataclasses.asdict(info))
    if info.records == 0:
        raise SpecgraftError(f"{f} is a JSON array cut off before its first record ended; re-download the file")
    logger.warning("%s", info.describe(f))
    return lines
#: The longest line (one record) a compressed data file may hold, decompressed.
MAX_RECORD_BYTES = 64 << 20


def _require_utf8(f: Path) -> None:
    """Data files must be UTF-8: pyarrow's JSON reader passes invalid bytes through and its text reader fails
    later with a bare UnicodeDecodeError. Checked in blocks (compressed files are checked by their reader)."""
    if f.name.lower().endswith(".gz"):
        # Decompressed as a stream first: one record longer than this is no conversation but a file that expands
        # to gigabytes in the JSON reader (which holds a whole line at once).
        for _ in iter_lines_limited(f, MAX_RECORD_BYTES, what="data file"):
            pass
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                raise SpecgraftError(f"{f} is not UTF-8 text (invalid byte at offset {offset + exc.start}); "
                                     "re-encode it as UTF-8, e.g. `iconv -f latin1 -t utf-8`") from None
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise SpecgraftError(f"{f} is not UTF-8 text (it ends inside a character); re-encode it as UTF-8") from None


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    text = str(cause).strip().splitlines()
    return text[0][:200] if text else type(cause).__name__


def _detect_kind(raw: datasets.Dataset, src: Path, format: str) -> str:
    """sharegpt | messages | text for one loaded source."""
    cols = raw.column_names
    if format == "text":
        wanted: tuple[str, ...] = ("text",)
    elif format in ("sharegpt", "messages"):
        # Both conversation formats share one turn parser, so either column serves either format.
        wanted = ("conversations", "messages") if format == "sharegpt" else ("messages", "conversations")
    else:
        wanted = tuple(ACCEPTED_COLUMNS)
    for col in wanted:
        if col in cols:
            return ACCEPTED_COLUMNS[col]
    if format == "auto":
        raise SpecgraftError(
            f"{src} has columns {', '.join(cols) or '(none)'} but none of the accepted ones "
            "(conversations: ShareGPT from/value turns; messages: role/content turns; text: plain text); "
            "rename the column or convert the file"
        )
    raise SpecgraftError(
        f"data.format is {format} but {src} has columns {', '.join(cols) or '(none)'} and no "
        f"{' or '.join(wanted)} column; fix the file or use format auto"
    )


# ---------------------------------------------------------------------------------------------------------------
# normalisation


def _content_text(content: Any) -> str:
    """Message content as a string (OpenAI content-part lists are joined; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type", "text") == "text" and part.get("text") is not None:
                    texts.append(str(part["text"]))
            elif part is not None:
                texts.append(str(part))
        return "".join(texts)
    return str(content)


def normalise_turns(turns: Any) -> tuple[list[dict[str, str]], str | None]:
    """One conversation's turns -> (normalised messages, the first unsupported role or None).

    Accepts ShareGPT (``from``/``value``) and OpenAI (``role``/``content``) turns; drops leading assistant turns.
    """
    if isinstance(turns, str):  # a conversation stored as a JSON string
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            return [], "(unparseable conversation)"
    messages: list[dict[str, str]] = []
    for turn in turns or []:
        if not isinstance(turn, Mapping):
            return [], "(turn that is not an object)"
        raw_role = turn.get("from", turn.get("role"))
        role = ROLE_MAP.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            return [], str(raw_role)
        content = turn["value"] if "value" in turn else turn.get("content")
        messages.append({"role": role, "content": _content_text(content)})
    # A reply with no question before it teaches nothing and breaks strict templates (Llama-2, Mistral).
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = [m for i, m in enumerate(messages) if not (i < first_user and m["role"] == "assistant")]
    return messages, None


def _normalise_batch(
    batch: dict[str, list], indices: list[int], kind: str, offset: int, paragraphs: bool
) -> dict[str, list]:
    if kind == "text":
        texts, rows, status = [], [], []
        for text, idx in zip(batch["text"], indices):
            if not isinstance(text, str):
                text = "" if text is None else str(text)
            # .txt: one document per blank-line separated paragraph; a JSONL text field is one document as is.
            docs = [d.strip() for d in _BLANK_LINE.split(text)] if paragraphs else [text]
            docs = [d for d in docs if d.strip()]
            if not docs and not paragraphs:
                docs = [""]  # kept as an (empty) record so it is counted and reported
            for doc in docs:
                texts.append(doc)
                rows.append(offset + idx)
                status.append(_OK if doc else _EMPTY)
        return {"text": texts, "row": rows, "_status": status, "_bad_role": [""] * len(texts)}
    col = "conversations" if kind == "sharegpt" else "messages"
    if col not in batch:  # explicit format served by the other conversation column
        col = "messages" if col == "conversations" else "conversations"
    out_msgs, rows, status, bad = [], [], [], []
    for turns, idx in zip(batch[col], indices):
        msgs, bad_role = normalise_turns(turns)
        out_msgs.append(msgs)
        rows.append(offset + idx)
        status.append(_BAD_ROLE if bad_role is not None else (_OK if msgs else _EMPTY))
        bad.append(bad_role or "")
    return {"messages": out_msgs, "row": rows, "_status": status, "_bad_role": bad}


def _normalise(
    raw: datasets.Dataset,
    kind: str,
    offset: int,
    paragraphs: bool,
    cache_file: Path,
    fingerprint: str,
    num_proc: int,
    name: str,
) -> datasets.Dataset:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    base = MESSAGES_FEATURES if kind != "text" else TEXT_FEATURES
    features = datasets.Features(
        {**base, "_status": datasets.Value("int8"), "_bad_role": datasets.Value("string")}
    )
    # Cache key = the source files' identity, so a second run reuses the normalised arrow file directly.
    return raw.map(
        _normalise_batch,
        batched=True,
        with_indices=True,
        fn_kwargs={"kind": kind, "offset": offset, "paragraphs": paragraphs},
        remove_columns=raw.column_names,
        features=features,
        num_proc=num_proc if num_proc > 1 else None,
        cache_file_name=str(cache_file),
        new_fingerprint=hashlib.sha256(fingerprint.encode()).hexdigest()[:32],
        load_from_cache_file=True,
        desc=f"reading {name}",
    )


def _drop_invalid(ds: datasets.Dataset, src: Path) -> datasets.Dataset:
    status = ds["_status"]
    bad_rows = [i for i, s in enumerate(status) if s == _BAD_ROLE]
    empty = sum(1 for s in status if s == _EMPTY)
    if bad_rows:
        example = ds[bad_rows[0]]
        logger.warning(
            "dropped %d conversation(s) of %s with a role other than system/user/assistant (e.g. %r in row %d)",
            len(bad_rows), src, example["_bad_role"], example["row"],
        )
    if empty:
        logger.warning("dropped %d empty record(s) of %s", empty, src)
    if bad_rows or empty:
        keep = [i for i, s in enumerate(status) if s == _OK]
        ds = ds.select(keep, keep_in_memory=True)
    return ds.remove_columns(["_status", "_bad_role"])
