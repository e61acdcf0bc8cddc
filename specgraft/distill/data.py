"""Distillation data beyond the fixed dataset: target continuations (sequence-level KD) and student samples (GKD).

Prompts come from tokenised training rows (``input_ids`` / ``attention_mask`` / ``loss_mask``):

* a conversation row's prompt is everything before its first label token (the first assistant reply);
* a plain-text row (every token a label) keeps its first ``len - n`` tokens, with ``n`` the number of new tokens,
  but at least :data:`MIN_TEXT_PROMPT_FRACTION` of the row, so a continuation has context to continue.

The continuation is generated (by the target for sequence-level KD, by the student for on-policy batches), cut after
the first stop token, and becomes a row whose labels are exactly the generated tokens.

Sequence-level KD on conversations reuses the data module's target rewrite of every assistant turn
(:func:`specgraft.data.regenerate.regenerate`, through :func:`specgraft.data.build_dataset` with
``regenerate: true``, cached and sharded across processes). Plain text has no turns to rewrite: its rows get target
continuations here, generated in shards across processes and cached on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from specgraft.data.collate import pad_collate, pad_token_id
from specgraft.data.generate import generate_batch, generation_config, ids_past_tokenizer
from specgraft.utils.seeds import derive_seed  # noqa: F401 (re-exported: DistillStep seeds its draws with it)

logger = logging.getLogger(__name__)

#: A plain-text prompt keeps at least this fraction of its row.
MIN_TEXT_PROMPT_FRACTION = 0.5
#: Rows generated together when building sequence-level KD data.
SEQ_KD_BATCH_SIZE = 32
#: Bump when the stored continuations of the same inputs change.
SEQ_KD_VERSION = 1


def first_label(loss_mask: Sequence[int]) -> int:
    """Index of the first label token (-1 when there is none)."""
    for i, m in enumerate(loss_mask):
        if m:
            return i
    return -1


def prompt_length(loss_mask: Sequence[int], length: int, max_new_tokens: int) -> int:
    """How many leading tokens of a row form its prompt (see the module docstring)."""
    start = first_label(loss_mask[:length])
    if start > 0:
        return start
    keep = max(math.ceil(length * MIN_TEXT_PROMPT_FRACTION), length - max_new_tokens)
    return max(1, min(keep, length))


def row_prompts(batch: dict[str, torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """The prompt token ids of every row of a right-padded batch."""
    prompts = []
    lengths = batch["attention_mask"].sum(-1).tolist()
    for ids, mask, n in zip(batch["input_ids"].tolist(), batch["loss_mask"].tolist(), lengths):
        n = int(n)
        prompts.append(ids[: prompt_length(mask, n, max_new_tokens)])
    return prompts


@torch.no_grad()
def generate_continuations(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                           pad_id: int, stop_ids: Sequence[int], seed: int,
                           suppress_tokens: Sequence[int] | None = None) -> list[list[int]]:
    """One continuation per prompt (:func:`specgraft.data.generate.generate_batch`: left-padded, seeded by
    ``seed`` on a forked RNG, never emitting ``suppress_tokens``), each cut after its first stop token and at
    the model's context."""
    width = max(len(p) for p in prompts)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None:
        max_new_tokens = min(max_new_tokens, int(limit) - width)
    if max_new_tokens < 1:
        return [[] for _ in prompts]
    config = generation_config(max_new_tokens, temperature, pad_id, stop_ids, suppress_tokens=suppress_tokens)
    return [tokens for tokens, _ in generate_batch(model, prompts, config, seed)]


def continuation_rows(prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[dict]:
    """Rows ``prompt + continuation`` whose labels are the continuation (empty continuations are dropped)."""
    rows = []
    for p, c in zip(prompts, continuations):
        if not c:
            continue
        ids = list(p) + list(c)
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": [0] * len(p) + [1] * len(c)})
    return rows


def onpolicy_batch(student: Any, batch: dict[str, torch.Tensor], max_new_tokens: int, temperature: float,
                   pad_id: int, stop_ids: Sequence[int], seed: int,
                   suppress_tokens: Sequence[int] | None = None) -> dict[str, torch.Tensor] | None:
    """GKD: the student continues each row's prompt; returns the right-padded batch labelled on its own tokens
    (None when nothing could be generated, e.g. prompts already at the context limit)."""
    prompts = row_prompts(batch, max_new_tokens)
    continuations = generate_continuations(student, prompts, max_new_tokens, temperature, pad_id, stop_ids, seed,
                                           suppress_tokens)
    rows = continuation_rows(prompts, continuations)
    if not rows:
        return None
    device = batch["input_ids"].device
    return {k: v.to(device) for k, v in pad_collate(rows, pad_id).items()}


def is_plain_text(dataset: datasets.Dataset) -> bool:
    """True when every token of every row is a label (plain text), False for conversations."""
    for table in dataset.select_columns(["loss_mask"]).with_format("arrow").iter(batch_size=10_000):
        flat = np.asarray(table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False))
        if flat.size and flat.min() == 0:
            return False
    return True


def text_continuations(model: Any, tokenizer: Any, train: datasets.Dataset, *, max_new_tokens: int,
                       temperature: float, seed: int, stop_ids: Sequence[int], cache_dir: Path,
                       batch_size: int = SEQ_KD_BATCH_SIZE) -> datasets.Dataset:
    """Sequence-level KD for plain text: the target continues every training row's prompt.

    Every process generates its share of rows (rows ``rank::world``); the result is gathered, cached under
    ``cache_dir/seq_kd/`` keyed by model, tokenizer, rows and settings, and reused by later runs.
    """
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from specgraft.data.regenerate import model_key
    from specgraft.data.tokenize import tokenizer_key
    from specgraft.utils.io import atomic_path

    state = PartialState()
    pad_id = pad_token_id(tokenizer, stop_ids)
    suppress = ids_past_tokenizer(model, tokenizer)
    key = hashlib.sha256(json.dumps({
        "version": SEQ_KD_VERSION, "model": model_key(model), "tokenizer": tokenizer_key(tokenizer),
        "rows": getattr(train, "_fingerprint", None), "n": len(train), "max_new_tokens": max_new_tokens,
        "temperature": temperature, "seed": seed, "stop_ids": list(stop_ids),
    }, sort_keys=True).encode()).hexdigest()[:16]
    entry = Path(cache_dir) / "seq_kd" / f"text-{key}"
    if (entry / "state.json").is_file():
        logger.info("seq_kd: cache hit %s", entry)
        return datasets.load_from_disk(str(entry))
    logger.info("seq_kd: the target continues %d training rows (%d new tokens each at most)", len(train),
                max_new_tokens)
    mine = list(range(len(train)))[state.process_index::state.num_processes]
    rows: list[dict] = []
    for start in range(0, len(mine), batch_size):
        index = mine[start: start + batch_size]
        chunk = train.select(index)
        batch = pad_collate([{k: chunk[i][k] for k in ("input_ids", "attention_mask", "loss_mask")}
                             for i in range(len(chunk))], pad_id)
        prompts = row_prompts(batch, max_new_tokens)
        conts = generate_continuations(model, prompts, max_new_tokens, temperature, pad_id, stop_ids,
                                       seed=derive_seed(seed, index[0]), suppress_tokens=suppress)
        rows.extend({"index": i, **row} for i, row in zip(index, continuation_rows(prompts, conts)))
    gathered = gather_object(rows) if state.num_processes > 1 else rows
    gathered = sorted(gathered, key=lambda r: r["index"])
    features = datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32")),
        "attention_mask": datasets.List(datasets.Value("int8")),
        "loss_mask": datasets.List(datasets.Value("int8")),
    })
    result = datasets.Dataset.from_dict(
        {k: [r[k] for r in gathered] for k in ("input_ids", "attention_mask", "loss_mask")}, features=features)
    if state.is_main_process:
        with atomic_path(entry) as tmp:
            result.save_to_disk(str(tmp))
    state.wait_for_everyone()
    return result


def seq_kd_dataset(data_cfg: Any, target: Any, train: datasets.Dataset, stop_ids: Sequence[int],
                   batch_size: int = SEQ_KD_BATCH_SIZE) -> datasets.Dataset | None:
    """Target-generated training rows for sequence-level KD (None when the fixed data already is the target's).

    Conversations: the recipe's data with every assistant turn rewritten by the target (``data.regenerate``);
    plain text: target continuations of the training rows. Generation uses ``data.regenerate_max_new_tokens`` and
    ``data.regenerate_temperature``.
    """
    from specgraft.data import build_dataset
    from specgraft.data.readers import default_cache_dir

    if is_plain_text(train):
        cache = Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()
        return text_continuations(target.model, target.tokenizer, train,
                                  max_new_tokens=data_cfg.regenerate_max_new_tokens,
                                  temperature=data_cfg.regenerate_temperature, seed=data_cfg.seed,
                                  stop_ids=stop_ids, cache_dir=cache, batch_size=batch_size)
    if data_cfg.regenerate:
        logger.info("seq_kd: data.regenerate is already true, so the fixed data is the target's own; nothing to add")
        return None
    regenerated = build_dataset(dataclasses.replace(data_cfg, regenerate=True), target.tokenizer, model=target.model)
    return regenerated["train"]

