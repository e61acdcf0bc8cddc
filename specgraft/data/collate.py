"""Batching and statistics over tokenised datasets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import datasets
import numpy as np
import torch

from specgraft.errors import SpecgraftError

#: Padding id of a batch whose tokenizer has no pad token and no stop token to stand in for it (padding is masked
#: out of attention and losses, so any id in the vocabulary works).
DEFAULT_PAD_ID = 0


def pad_token_id(tokenizer: Any, stop_ids: Sequence[int] = ()) -> int:
    """The id that pads batches of ``tokenizer``'s text: its pad token, else the first stop token (generation pads
    finished rows with it, as transformers does), else :data:`DEFAULT_PAD_ID`. ``tokenizer`` may be None (rows
    tokenised elsewhere)."""
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is not None:
        return int(pad)
    return int(stop_ids[0]) if len(stop_ids) else DEFAULT_PAD_ID


def pad_collate(
    features: Sequence[Mapping[str, Any]], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad tokenised rows into a batch.

    Args:
        features: rows with ``input_ids``, ``loss_mask`` and optionally ``attention_mask`` (lists or 1-D tensors).
        pad_token_id: id written into the padding of ``input_ids``.
        pad_to_multiple_of: round the padded length up to a multiple of this (tensor-core friendly shapes).

    Returns:
        ``input_ids``, ``attention_mask``, ``loss_mask``: int64 tensors [B, T]; attention and loss masks are 0 on
        padding.
    """
    if not features:
        raise ValueError("pad_collate needs at least one row")
    lengths = [len(f["input_ids"]) for f in features]
    width = max(lengths)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(features)
    input_ids = torch.full((batch, width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.long)
    for i, (row, n) in enumerate(zip(features, lengths)):
        input_ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        if "attention_mask" in row:
            attention_mask[i, :n] = torch.as_tensor(row["attention_mask"], dtype=torch.long)
        else:
            attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def token_frequencies(
    dataset: datasets.Dataset | datasets.DatasetDict, vocab_size: int, only_loss_tokens: bool = True
) -> torch.Tensor:
    """Count how often each token id occurs (EAGLE-3 builds its draft vocabulary from the most frequent ones).

    Args:
        dataset: a tokenised dataset (a DatasetDict counts its ``train`` split).
        vocab_size: length of the returned counts (the target's vocabulary size).
        only_loss_tokens: count only label tokens (``loss_mask == 1``: the assistant replies), else every token.

    Returns:
        int64 tensor [vocab_size] of counts.

    Raises:
        SpecgraftError: a token id outside ``[0, vocab_size)`` (data tokenised for another model).
    """
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"]
    columns = ["input_ids", "loss_mask"] if only_loss_tokens else ["input_ids"]
    counts = np.zeros(vocab_size, dtype=np.int64)
    for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=10_000):
        # Arrow list columns flatten without Python loops: [sum of row lengths].
        ids = np.asarray(table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False))
        ids = ids.astype(np.int64, copy=False)
        if only_loss_tokens:
            mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
            ids = ids[np.asarray(mask).astype(bool)]
        if ids.size == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise SpecgraftError(
                f"token id {high if high >= vocab_size else low} is outside the vocabulary of size {vocab_size}; "
                "the data was tokenised with another tokenizer: rebuild it with the target's tokenizer"
            )
        counts += np.bincount(ids, minlength=vocab_size)
    return torch.from_numpy(counts)
