"""Offline target features: precompute only the layers a head needs, in 16-bit, to sharded safetensors.

EAGLE-1 stored the full fp16 last hidden state of every token (about 740 GB for ShareGPT on a 7B target); users of
later systems report 13-38 TB projections for 8B targets at 8k context. This cache keeps only the layers the head
reads (plus the last, post-norm layer when the head needs the target's distribution, which is recomputed from it
with the frozen lm_head at train time instead of storing V logits per token), in bfloat16/float16, and

* prints the projected size before writing and refuses to start when the disk lacks room,
* writes shard by shard (each shard atomically, with a checksum), so an interrupted run resumes where it stopped,
* records the target's identity and the data's fingerprint, and refuses a cache made for another target/tokenizer,
* verifies each shard before training and names a truncated or corrupted one (never trains on it).

Layout of ``cache_dir``: ``shard-00000.safetensors`` (one tensor per layer ``layer{L}`` [tokens_in_shard, h] and
``offsets`` [rows_in_shard + 1]), ``shard-00000.json`` (rows, checksum, bytes), and ``index.json`` written last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.target import Target, TargetIdentity
from specgraft.utils.io import atomic_path, atomic_write_json, sha256_file
from specgraft.utils.models import DTYPES

logger = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT_VERSION = 1
STORAGE_DTYPES = DTYPES  # the feature cache stores in any recipe dtype
#: Headroom kept free on the disk beyond the projected cache size.
DISK_MARGIN = 1.05


def cache_layers(required_layers: Sequence[int], needs_logits: bool, num_layers: int) -> tuple[int, ...]:
    """The layers to store: the head's, plus the last (post-norm) one when logits are recomputed from it."""
    layers = set(int(i) for i in required_layers)
    if needs_logits:
        layers.add(num_layers)
    return tuple(sorted(layers))


def bytes_per_token(num_layers_stored: int, hidden_size: int, dtype: str) -> int:
    return num_layers_stored * hidden_size * torch.tensor([], dtype=STORAGE_DTYPES[dtype]).element_size()


def eagle1_bytes_per_token(hidden_size: int) -> int:
    """What EAGLE-1's offline data stored per token: the full last hidden state in fp16."""
    return hidden_size * 2


def dataset_fingerprint(dataset: Any) -> str:
    """A hash of the tokenised rows (what the cache is aligned with)."""
    fp = getattr(dataset, "_fingerprint", None)
    if fp:
        return str(fp)
    digest = hashlib.sha256()
    for row in dataset:
        digest.update(torch.as_tensor(row["input_ids"]).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class CacheInfo:
    path: Path
    layers: tuple[int, ...]
    dtype: str
    rows: int
    tokens: int
    bytes: int
    bytes_per_token: float
    eagle1_bytes_per_token: int


def build_feature_cache(
    target: Target,
    dataset: Any,
    cache_dir: str | Path,
    layers: Sequence[int],
    dtype: str = "bfloat16",
    rows_per_shard: int = 256,
    batch_size: int = 8,
    show_progress: bool = True,
) -> CacheInfo:
    """Write (or resume writing) the feature cache of ``dataset`` for ``target``; returns its facts."""
    if dtype not in STORAGE_DTYPES:
        raise SpecgraftError(f"feature dtype {dtype!r} is not supported; use bfloat16, float16 or float32")
    cache_dir = Path(cache_dir)
    layers = tuple(sorted(int(i) for i in layers))
    target.check_layer_indices(layers, what="feature cache layer")
    data_fp = dataset_fingerprint(dataset)
    meta = {"format_version": FORMAT_VERSION, "target": target.identity.to_dict(), "layers": list(layers),
            "dtype": dtype, "rows": len(dataset), "rows_per_shard": rows_per_shard, "data_fingerprint": data_fp}
    if (cache_dir / INDEX).is_file():
        info = open_feature_cache(cache_dir, target, layers, data_fp).info
        logger.info("feature cache %s is complete (%d rows)", cache_dir, info.rows)
        return info
    _check_partial_cache(cache_dir, meta)

    lengths = [int(sum(row["attention_mask"])) if "attention_mask" in row else len(row["input_ids"])
               for row in dataset]
    total_tokens = sum(lengths)
    per_token = bytes_per_token(len(layers), target.hidden_size, dtype)
    projected = total_tokens * per_token
    cache_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache_dir).free
    logger.warning("feature cache: %d rows, %d tokens, layers %s in %s -> projected %.1f MiB (%d B/token; EAGLE-1's "
                   "full fp16 hidden state: %d B/token); %.1f GiB free", len(dataset), total_tokens, list(layers),
                   dtype, projected / 2**20, per_token, eagle1_bytes_per_token(target.hidden_size), free / 2**30)
    already = sum(p.stat().st_size for p in cache_dir.glob("shard-*.safetensors"))
    if free < (projected - already) * DISK_MARGIN:
        raise SpecgraftError(f"the feature cache needs about {(projected - already) / 2**30:.2f} GiB more but "
                             f"{cache_dir} has {free / 2**30:.2f} GiB free; free space, point "
                             "training.feature_cache_dir at a larger disk, or use training.features=online")
    atomic_write_json(cache_dir / "cache_meta.json", meta)

    storage = STORAGE_DTYPES[dtype]
    n_shards = (len(dataset) + rows_per_shard - 1) // rows_per_shard
    bar = tqdm(total=len(dataset), desc="caching features", unit="row", disable=not show_progress)
    for shard in range(n_shards):
        start, stop = shard * rows_per_shard, min(len(dataset), (shard + 1) * rows_per_shard)
        if _shard_complete(cache_dir, shard):
            bar.update(stop - start)
            continue
        per_layer: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        offsets = [0]
        for b0 in range(start, stop, batch_size):
            rows = [dataset[i] for i in range(b0, min(stop, b0 + batch_size))]
            width = max(lengths[i] for i in range(b0, b0 + len(rows)))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for j, row in enumerate(rows):
                n = lengths[b0 + j]
                ids[j, :n] = torch.as_tensor(row["input_ids"][:n])
                mask[j, :n] = 1
            out = target(ids.to(target.device), mask.to(target.device), layers=layers, logits=False)
            for j in range(len(rows)):
                n = lengths[b0 + j]
                for i in layers:
                    per_layer[i].append(out.hidden_states[i][j, :n].to("cpu", storage))
                offsets.append(offsets[-1] + n)
            bar.update(len(rows))
        tensors = {f"layer{i}": torch.cat(per_layer[i]).contiguous() for i in layers}
        tensors["offsets"] = torch.tensor(offsets, dtype=torch.int64)
        shard_file = cache_dir / f"shard-{shard:05d}.safetensors"
        with atomic_path(shard_file) as tmp:
            save_file(tensors, str(tmp))
        atomic_write_json(cache_dir / f"shard-{shard:05d}.json",
                          {"start": start, "stop": stop, "sha256": sha256_file(shard_file),
                           "bytes": shard_file.stat().st_size})
    bar.close()
    shards = [json.loads((cache_dir / f"shard-{s:05d}.json").read_text()) | {"file": f"shard-{s:05d}.safetensors"}
              for s in range(n_shards)]
    atomic_write_json(cache_dir / INDEX, {**meta, "tokens": total_tokens, "shards": shards})
    return open_feature_cache(cache_dir, target, layers, data_fp).info


def _check_partial_cache(cache_dir: Path, meta: dict[str, Any]) -> None:
    """A partial cache may be resumed only if it was started with the same target, layers, dtype and data."""
    meta_file = cache_dir / "cache_meta.json"
    if not meta_file.is_file():
        return
    old = json.loads(meta_file.read_text(encoding="utf-8"))
    TargetIdentity.from_dict(old["target"]).require_compatible(TargetIdentity.from_dict(meta["target"]),
                                                               what="feature cache")
    for key in ("layers", "dtype", "rows", "rows_per_shard", "data_fingerprint"):
        if old.get(key) != meta[key]:
            raise SpecgraftError(f"the partial feature cache in {cache_dir} was started with a different {key} "
                                 f"({old.get(key)} vs {meta[key]}); delete it or choose another "
                                 "training.feature_cache_dir")


def _shard_complete(cache_dir: Path, shard: int) -> bool:
    sidecar = cache_dir / f"shard-{shard:05d}.json"
    data = cache_dir / f"shard-{shard:05d}.safetensors"
    if not (sidecar.is_file() and data.is_file()):
        return False
    info = json.loads(sidecar.read_text(encoding="utf-8"))
    return data.stat().st_size == info["bytes"] and sha256_file(data) == info["sha256"]


class FeatureCache:
    """Read access to a complete, verified cache: ``features(row) -> {layer: [T, h]}``."""

    def __init__(self, cache_dir: Path, index: dict[str, Any]) -> None:
        self.cache_dir = cache_dir
        self.index = index
        self.layers = tuple(index["layers"])
        self._shards: list[tuple[int, int, dict[int, torch.Tensor], torch.Tensor]] = []
        for shard in index["shards"]:
            path = cache_dir / shard["file"]
            with safe_open(str(path), framework="pt") as fh:
                tensors = {i: fh.get_tensor(f"layer{i}") for i in self.layers}
                offsets = fh.get_tensor("offsets")
            self._shards.append((shard["start"], shard["stop"], tensors, offsets))
        total = sum(p.stat().st_size for p in cache_dir.glob("shard-*.safetensors"))
        per_token = total / max(index["tokens"], 1)
        hidden = index["target"]["hidden_size"]
        self.info = CacheInfo(cache_dir, self.layers, index["dtype"], index["rows"], index["tokens"], total,
                              per_token, eagle1_bytes_per_token(hidden))

    def features(self, row: int) -> dict[int, torch.Tensor]:
        for start, stop, tensors, offsets in self._shards:
            if start <= row < stop:
                a, b = int(offsets[row - start]), int(offsets[row - start + 1])
                return {i: tensors[i][a:b] for i in self.layers}
        raise IndexError(row)


def open_feature_cache(cache_dir: str | Path, target: Target, layers: Sequence[int],
                       data_fingerprint: str | None = None) -> FeatureCache:
    """Open and verify a complete cache for ``target``; refuses another target's cache or a damaged shard."""
    cache_dir = Path(cache_dir)
    index_file = cache_dir / INDEX
    if not index_file.is_file():
        raise SpecgraftError(f"{cache_dir} has no complete feature cache (no {INDEX}); build it by training with "
                             "training.features=offline, which resumes a partial cache")
    index = json.loads(index_file.read_text(encoding="utf-8"))
    try:
        TargetIdentity.from_dict(index["target"]).require_compatible(target.identity, what="feature cache")
    except TargetMismatchError as exc:
        raise TargetMismatchError(f"{exc}; delete {cache_dir} or point training.feature_cache_dir elsewhere") from None
    missing = sorted(set(int(i) for i in layers) - set(index["layers"]))
    if missing:
        raise SpecgraftError(f"the feature cache {cache_dir} lacks layers {missing} (it has {index['layers']}); "
                             "rebuild it in a new training.feature_cache_dir")
    if data_fingerprint is not None and index.get("data_fingerprint") != data_fingerprint:
        raise SpecgraftError(f"the feature cache {cache_dir} was built from different training data; rebuild it in "
                             "a new training.feature_cache_dir")
    for shard in index["shards"]:
        path = cache_dir / shard["file"]
        if not path.is_file():
            raise SpecgraftError(f"feature cache shard {path} is missing; rebuild the cache (delete {cache_dir})")
        if path.stat().st_size != shard["bytes"] or sha256_file(path) != shard["sha256"]:
            raise SpecgraftError(f"feature cache shard {path} is truncated or corrupted (checksum mismatch); delete "
                                 f"it and rerun to rebuild that shard")
    return FeatureCache(cache_dir, index)


class CachedFeatureDataset(torch.utils.data.Dataset):
    """Tokenised rows joined with their cached features (row ``i`` of the dataset <-> row ``i`` of the cache)."""

    def __init__(self, dataset: Any, cache: FeatureCache) -> None:
        if len(dataset) != cache.info.rows:
            raise SpecgraftError(f"the feature cache has {cache.info.rows} rows but the data has {len(dataset)}; "
                                 "rebuild the cache in a new training.feature_cache_dir")
        self.dataset = dataset
        self.cache = cache

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = dict(self.dataset[index])
        row["features"] = self.cache.features(index)
        return row


def collate_with_features(features: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """``pad_collate`` plus the cached features padded to [B, T, h] per layer (in fp32)."""
    from specgraft.data import pad_collate

    batch = pad_collate([{k: v for k, v in f.items() if k != "features"} for f in features], pad_token_id)
    width = batch["input_ids"].shape[1]
    layers = features[0]["features"].keys()
    out = {}
    for i in layers:
        h = features[0]["features"][i].shape[-1]
        stacked = torch.zeros(len(features), width, h, dtype=torch.float32)
        for j, f in enumerate(features):
            t = f["features"][i]
            stacked[j, : t.shape[0]] = t.float()
        out[i] = stacked
    batch["features"] = out
    return batch
