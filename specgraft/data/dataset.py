"""``build_dataset``: records -> tokenised, filtered, optionally packed and split training data, cached on disk.

The result is cached in ``<cache_dir>/tokenized/<name>-<key>/`` where the key hashes the source files (path and
SHA-256 of the contents), the tokenizer (vocabulary, specials, chat template) and every config field that changes the
data. A second run with the same inputs loads the saved ``DatasetDict`` without touching the tokenizer; the log
says ``data cache hit`` or ``data cache miss``. Intermediate ``map`` results use ``datasets``' own cache files with
fingerprints derived from the same key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np

from specgraft.data.readers import default_cache_dir, is_conversations, load_records, source_fingerprint, subsample
from specgraft.data.tokenize import (
    TEMPLATE_ERRORS,
    pack_sequences,
    tokenize_conversation,
    tokenize_text,
    tokenizer_key,
    uses_chat_template,
)
from specgraft.errors import SpecgraftError
from specgraft.utils.io import atomic_path, atomic_write_json

if TYPE_CHECKING:
    from specgraft.config import DataConfig

logger = logging.getLogger(__name__)

#: Bump when the tokenised output of the same inputs changes (invalidates cached datasets).
TOKENIZE_VERSION = 1
#: DataConfig fields that change the tokenised data (num_proc and cache_dir do not).
KEY_FIELDS = (
    "format", "split", "max_length", "packing", "num_samples", "eval_fraction", "use_chat_template",
    "system_prompt", "seed", "regenerate", "regenerate_max_new_tokens", "regenerate_temperature",
)
TOKEN_COLUMNS = ("input_ids", "attention_mask", "loss_mask")
TOKEN_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "attention_mask": datasets.List(datasets.Value("int8")),
        "loss_mask": datasets.List(datasets.Value("int8")),
    }
)
# Row status written by the tokenising map, counted afterwards (works across num_proc workers).
OK, NO_ASSISTANT, NO_LOSS, TEMPLATE_ERROR = 0, 1, 2, 3
_STATUS_FEATURES = {
    "_status": datasets.Value("int8"),
    "_error": datasets.Value("string"),
    "_row": datasets.Value("int64"),
    "_truncated": datasets.Value("bool"),
}


def build_dataset(cfg: DataConfig, tokenizer: Any, model: Any = None) -> datasets.DatasetDict:
    """Read, (regenerate,) tokenise, filter, pack and split the training data described by ``cfg``.

    Args:
        cfg: the recipe's ``data`` section.
        tokenizer: the target's tokenizer.
        model: the target model; needed only when ``cfg.regenerate`` (its rewrites are cached by model identity).

    Returns:
        ``DatasetDict`` with ``train`` (and ``eval`` when ``cfg.eval_fraction > 0``), columns ``input_ids``,
        ``attention_mask``, ``loss_mask`` (1 on label tokens), each at most ``cfg.max_length`` long.

    Raises:
        SpecgraftError: bad input (see :func:`~specgraft.data.readers.load_records`), no conversation with an
            assistant turn, nothing left after filtering, ``regenerate`` without a model.
    """
    _check_config(cfg)
    if cfg.regenerate and model is None:
        raise SpecgraftError(
            "data.regenerate is true but no target model was given to build the data; pass the model, or run "
            "`specgraft regenerate` and point data.path at its output with regenerate: false"
        )
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    _require_writable(cache)
    # Generation settings only matter when the data is regenerated.
    fields = {n: getattr(cfg, n) for n in KEY_FIELDS if cfg.regenerate or not n.startswith("regenerate_")}
    regen_key = _regenerate_key(cfg, tokenizer, model) if cfg.regenerate else None
    key_payload = {
        "version": TOKENIZE_VERSION,
        "source": source_fingerprint(cfg.path, cfg.format, cfg.split),
        "tokenizer": tokenizer_key(tokenizer),
        "fields": fields,
        "regenerate": regen_key,
    }
    key = _hash(key_payload)
    entry = cache / "tokenized" / f"{Path(cfg.path).name or 'data'}-{key[:16]}"

    if _complete(entry):
        return _load_hit(entry)
    logger.info("data cache miss: tokenizing %s into %s", cfg.path, entry)

    with _main_process_first():
        records = load_records(cfg.path, cfg.format, cfg.split, cache_dir=cache, num_proc=cfg.num_proc)
        records = subsample(records, cfg.num_samples, cfg.seed)
    if cfg.regenerate:
        records = _regenerated_records(cfg, tokenizer, model, records, cache, regen_key)

    with _main_process_first():
        if _complete(entry):  # another process built it meanwhile
            return _load_hit(entry)
        started = time.perf_counter()
        with atomic_path(entry) as tmp:
            work = tmp / "work"
            work.mkdir(parents=True)
            splits = _split(records, cfg.eval_fraction, cfg.seed, work)
            out: dict[str, datasets.Dataset] = {}
            stats: dict[str, Any] = {}
            for name, split_records in splits.items():
                ds, split_stats = _tokenize_split(split_records, cfg, tokenizer, work / name, f"{key}-{name}", name)
                if ds is not None:
                    out[name] = ds
                stats[name] = split_stats
            dataset_dict = datasets.DatasetDict(out)
            # One writer: datasets saves with "spawn" workers, which re-import the caller's main module.
            dataset_dict.save_to_disk(str(tmp / "dataset"))
            atomic_write_json(tmp / "meta.json", {"key": key_payload, "config": fields, "stats": stats})
            shutil.rmtree(work)
        logger.info("data: tokenized in %.1fs, cached at %s", time.perf_counter() - started, entry)
        return _load(entry)


def _check_config(cfg: DataConfig) -> None:
    if cfg.max_length < 2:
        raise SpecgraftError(f"data.max_length is {cfg.max_length}; use at least 2 tokens")
    if not 0.0 <= cfg.eval_fraction < 1.0:
        raise SpecgraftError(f"data.eval_fraction is {cfg.eval_fraction}; use a value in [0, 1)")
    if cfg.num_samples is not None and cfg.num_samples < 1:
        raise SpecgraftError(f"data.num_samples is {cfg.num_samples}; use a positive count or leave it unset")


def _require_writable(cache: Path) -> None:
    """The cache folder must be creatable and writable (else datasets' errors read as a bad data file)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=cache):
            pass
    except OSError as exc:
        raise SpecgraftError(f"cannot write the data cache folder {cache} ({exc.strerror or exc}); set "
                             "data.cache_dir to a writable folder") from None


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _main_process_first() -> AbstractContextManager:
    """Under several processes the main one builds caches first and the others then reuse them."""
    from specgraft.data.regenerate import partial_state

    state = partial_state()
    return state.main_process_first() if state.num_processes > 1 else nullcontext()


def _complete(entry: Path) -> bool:
    return (entry / "meta.json").is_file() and (entry / "dataset").is_dir()


def _load(entry: Path) -> datasets.DatasetDict:
    return datasets.load_from_disk(str(entry / "dataset"))


def _load_hit(entry: Path) -> datasets.DatasetDict:
    ds = _load(entry)
    sizes = ", ".join(f"{len(split)} {name}" for name, split in ds.items())
    logger.info("data cache hit: %s (%s sequences)", entry, sizes)
    return ds


def _split(records: datasets.Dataset, eval_fraction: float, seed: int, work: Path) -> dict[str, datasets.Dataset]:
    if eval_fraction <= 0:
        return {"train": records}
    n_eval = max(1, round(eval_fraction * len(records)))
    if n_eval >= len(records):
        raise SpecgraftError(
            f"data.eval_fraction {eval_fraction} of {len(records)} records leaves nothing to train on; "
            "lower it or use more data"
        )
    # Index files go to the work folder: never beside a user's saved dataset (datasets' default).
    parts = records.train_test_split(
        test_size=n_eval,
        seed=seed,
        train_indices_cache_file_name=str(work / "train-indices.arrow"),
        test_indices_cache_file_name=str(work / "eval-indices.arrow"),
    )
    return {"train": parts["train"], "eval": parts["test"]}


# ---------------------------------------------------------------------------------------------------------------
# tokenisation


def _tokenize_batch(
    batch: dict[str, list],
    tokenizer: Any,
    conversations: bool,
    use_chat_template: bool,
    system_prompt: str | None,
    max_length: int,
    truncate: bool,
) -> dict[str, list]:
    out: dict[str, list] = {k: [] for k in (*TOKEN_COLUMNS, *_STATUS_FEATURES)}
    items = batch["messages"] if conversations else batch["text"]
    for item, row in zip(items, batch["row"]):
        status, error, ids, mask = OK, "", [], []
        if conversations and not any(m["role"] == "assistant" for m in item):
            status, error = NO_ASSISTANT, ",".join(m["role"] for m in item) or "(no turns)"
        else:
            try:
                if conversations:
                    ids, mask = tokenize_conversation(
                        tokenizer, item, use_chat_template=use_chat_template, system_prompt=system_prompt
                    )
                else:
                    ids, mask = tokenize_text(tokenizer, item)
            except TEMPLATE_ERRORS as exc:
                status, error = TEMPLATE_ERROR, (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        truncated = truncate and len(ids) > max_length
        if truncated:
            ids, mask = ids[:max_length], mask[:max_length]
        if status == OK and not any(mask):
            status = NO_LOSS
        out["input_ids"].append(ids)
        out["attention_mask"].append([1] * len(ids))
        out["loss_mask"].append(mask)
        out["_status"].append(status)
        out["_error"].append(error)
        out["_row"].append(row)
        out["_truncated"].append(truncated)
    return out


def _pack_batch(batch: dict[str, list], max_length: int, separator_id: int | None) -> dict[str, list]:
    chunks = pack_sequences(list(zip(batch["input_ids"], batch["loss_mask"])), max_length, separator_id)
    return {
        "input_ids": [ids for ids, _ in chunks],
        "attention_mask": [[1] * len(ids) for ids, _ in chunks],
        "loss_mask": [mask for _, mask in chunks],
    }


def _tokenize_split(
    records: datasets.Dataset, cfg: DataConfig, tokenizer: Any, work: Path, key: str, split_name: str
) -> tuple[datasets.Dataset | None, dict[str, Any]]:
    """Tokenise one split; returns (dataset or None when nothing is left in an eval split, stats)."""
    work.mkdir(parents=True, exist_ok=True)
    conversations = is_conversations(records)
    if conversations and cfg.use_chat_template and not uses_chat_template(tokenizer):
        logger.info("data: the tokenizer has no chat template; conversations use plain User:/Assistant: lines")
    num_proc = cfg.num_proc if cfg.num_proc > 1 else None
    tokenized = records.map(
        _tokenize_batch,
        batched=True,
        fn_kwargs=dict(
            tokenizer=tokenizer,
            conversations=conversations,
            use_chat_template=cfg.use_chat_template,
            system_prompt=cfg.system_prompt,
            max_length=cfg.max_length,
            truncate=not cfg.packing,
        ),
        remove_columns=records.column_names,
        features=datasets.Features({**TOKEN_FEATURES, **_STATUS_FEATURES}),
        num_proc=num_proc,
        cache_file_name=str(work / "tokenized.arrow"),
        new_fingerprint=_hash([key, "tokenize"])[:32],
        desc=f"tokenizing {split_name}",
    )
    columns = tokenized.select_columns(["_status", "_truncated"]).with_format("numpy")[:]
    status = np.asarray(columns["_status"])
    counts = Counter(int(s) for s in status)
    stats = {
        "records": len(records),
        "no_assistant": counts.get(NO_ASSISTANT, 0),
        "no_loss_tokens": counts.get(NO_LOSS, 0),
        "template_errors": counts.get(TEMPLATE_ERROR, 0),
        # Among the kept rows: a dropped row's truncation is already reported as its drop reason.
        "truncated": int(np.asarray(columns["_truncated"])[status == OK].sum()),
    }
    _report_drops(tokenized, status, stats, cfg, split_name)
    kept = tokenized.select(np.flatnonzero(status == OK), keep_in_memory=True)
    kept = kept.remove_columns(list(_STATUS_FEATURES))
    if cfg.packing:
        separator = tokenizer.eos_token_id
        kept = kept.map(
            _pack_batch,
            batched=True,
            fn_kwargs=dict(max_length=cfg.max_length, separator_id=separator),
            remove_columns=kept.column_names,
            features=TOKEN_FEATURES,
            num_proc=num_proc,
            cache_file_name=str(work / "packed.arrow"),
            new_fingerprint=_hash([key, "pack"])[:32],
            desc=f"packing {split_name}",
        )
    stats["sequences"] = len(kept)
    stats["tokens"] = _total(kept, "attention_mask")
    stats["loss_tokens"] = _total(kept, "loss_mask")
    logger.info(
        "data %s: %d sequences from %d records, %d tokens (%d labels)%s",
        split_name, stats["sequences"], stats["records"], stats["tokens"], stats["loss_tokens"],
        f", {stats['truncated']} truncated to max_length={cfg.max_length} (packing: true keeps every token)"
        if stats["truncated"] else "",
    )
    if len(kept) == 0:
        if split_name != "train":
            logger.warning("data: the %s split is empty after filtering; training runs without it", split_name)
            return None, stats
        raise SpecgraftError(_empty_message(cfg, stats))
    return kept, stats


def _first_error(tokenized: datasets.Dataset, status: np.ndarray, code: int) -> tuple[int, str]:
    idx = int(np.flatnonzero(status == code)[0])
    row = tokenized[idx]
    return int(row["_row"]), str(row["_error"])


def _report_drops(
    tokenized: datasets.Dataset, status: np.ndarray, stats: dict[str, Any], cfg: DataConfig, split_name: str
) -> None:
    total = stats["records"]
    if stats["no_assistant"]:
        row, roles = _first_error(tokenized, status, NO_ASSISTANT)
        if stats["no_assistant"] == total:
            raise SpecgraftError(
                f"no conversation in {cfg.path} ({split_name} split) has an assistant turn (e.g. row {row} has "
                f"roles {roles}); add the assistant replies, or set data.regenerate: true (or run "
                "`specgraft regenerate`) so the target writes them"
            )
        logger.warning(
            "data %s: dropped %d of %d conversations with no assistant turn (e.g. row %d, roles %s); "
            "set data.regenerate: true to have the target answer them",
            split_name, stats["no_assistant"], total, row, roles,
        )
    if stats["template_errors"]:
        row, error = _first_error(tokenized, status, TEMPLATE_ERROR)
        logger.warning(
            "data %s: dropped %d of %d conversations the chat template rejected (row %d: %s)",
            split_name, stats["template_errors"], total, row, error,
        )
    if stats["no_loss_tokens"]:
        logger.warning(
            "data %s: dropped %d of %d records with no label token within max_length=%d "
            "(a long prompt, or an empty reply); raise data.max_length to keep them",
            split_name, stats["no_loss_tokens"], total, cfg.max_length,
        )


def _empty_message(cfg: DataConfig, stats: dict[str, Any]) -> str:
    return (
        f"no training sequence is left from {cfg.path} after filtering ({stats['records']} records: "
        f"{stats['no_assistant']} without an assistant turn, {stats['no_loss_tokens']} with no label token within "
        f"max_length={cfg.max_length}, {stats['template_errors']} rejected by the chat template); "
        "check the data, raise data.max_length, or set data.use_chat_template: false"
    )


def _total(ds: datasets.Dataset, column: str) -> int:
    total = 0
    for table in ds.select_columns([column]).with_format("arrow").iter(batch_size=10_000):
        values = table.column(column).combine_chunks().flatten()
        total += int(np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64).sum())
    return total


# ---------------------------------------------------------------------------------------------------------------
# self-distillation


def _regenerate_key(cfg: DataConfig, tokenizer: Any, model: Any) -> str:
    from specgraft.data.regenerate import model_key

    return _hash(
        {
            "source": source_fingerprint(cfg.path, cfg.format, cfg.split),
            "model": model_key(model),
            "tokenizer": tokenizer_key(tokenizer),
            "num_samples": cfg.num_samples,
            "seed": cfg.seed,
            "max_new_tokens": cfg.regenerate_max_new_tokens,
            "temperature": cfg.regenerate_temperature,
            "use_chat_template": cfg.use_chat_template,
            "system_prompt": cfg.system_prompt,
        }
    )


def _regenerated_records(
    cfg: DataConfig, tokenizer: Any, model: Any, records: datasets.Dataset, cache: Path, regen_key: str | None
) -> datasets.Dataset:
    from specgraft.data.regenerate import continue_texts, regenerate

    out = cache / "regenerated" / f"{Path(cfg.path).name or 'data'}-{(regen_key or '')[:16]}.jsonl"
    if not is_conversations(records):
        # Plain text (a story target): each paragraph becomes its first sentence + the target's continuation.
        with _main_process_first():
            if not out.exists():
                continue_texts(model, tokenizer, records, out, max_new_tokens=cfg.regenerate_max_new_tokens,
                               temperature=cfg.regenerate_temperature, seed=cfg.seed)
            return load_records(out, "text", cache_dir=cache, num_proc=cfg.num_proc)
    # Every process takes part (rows are sharded across them); the output is resumable after an interruption.
    regenerate(
        model,
        tokenizer,
        records,
        out,
        max_new_tokens=cfg.regenerate_max_new_tokens,
        temperature=cfg.regenerate_temperature,
        seed=cfg.seed,
        use_chat_template=cfg.use_chat_template,
        system_prompt=cfg.system_prompt,
    )
    with _main_process_first():
        return load_records(out, "messages", cache_dir=cache, num_proc=cfg.num_proc)


def mix_replay(train: datasets.Dataset, replay: datasets.Dataset, share: float, seed: int) -> datasets.Dataset:
    """``train`` with rows of ``replay`` added so that they make ``share`` of the result: ``round(share / (1 -
    share) * len(train))`` rows drawn by a seeded shuffle of ``replay`` (repeated whole when it has fewer)."""
    wanted = round(share / (1.0 - share) * len(train))
    if wanted == 0:
        return train
    if len(replay) == 0:
        raise SpecgraftError("data.replay_path has no rows after filtering; check data.replay_path")
    order = np.random.default_rng(seed).permutation(len(replay))
    picks = np.resize(order, wanted)  # the shuffled order, repeated whole as often as needed
    columns = [c for c in train.column_names if c in replay.column_names]
    replayed = replay.select_columns(columns).select(picks.tolist())
    return datasets.concatenate_datasets([train.select_columns(columns), replayed])
