"""Offline target features: precompute only the layers a head needs, in 16-bit or compressed, to sharded safetensors.

EAGLE-1 stored the full fp16 last hidden state of every token (about 740 GB for ShareGPT on a 7B target); users of
later systems report 13-38 TB projections for 8B targets at 8k context. This cache keeps only the layers the head
reads (plus the last, post-norm layer when the head needs the target's distribution, which is recomputed from it
with the frozen lm_head at train time instead of storing V logits per token), each distinct layer once, in
bfloat16/float16, or compressed (``int8`` / ``int4`` / ``vq``: :mod:`specgraft.train.feature_codecs`, with the codec's
tables fitted once from the cache's first rows and stored in ``codec.safetensors``), and

* prints the projected size before writing and refuses to start when the disk lacks room,
* writes shard by shard (each shard atomically, with a checksum), so an interrupted run resumes where it stopped,
* records the target's identity and the data's fingerprint, and refuses a cache made for another target/tokenizer,
* verifies each shard before training and names a truncated or corrupted one (never trains on it).

Layout of ``cache_dir``: ``shard-00000.safetensors`` (one tensor per layer ``layer{L}`` [tokens_in_shard, h], or for a
compressed cache one ``codes`` [tokens_in_shard, bytes_per_token] uint8 for all layers, and ``offsets``
[rows_in_shard + 1]), ``shard-00000.json`` (rows, checksum, bytes), ``codec.safetensors`` (compressed caches) and
``index.json`` written last. The storage dtype (and the codec's checksum) is part of the cache's key: a cache written
in one precision is refused, never read, by a run that asks for another.
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
from specgraft.train.feature_codecs import (
    CALIBRATION_TOKENS,
    QUANTIZED_DTYPES,
    FeatureCodec,
    fit_codec,
    load_codec,
    payload_bytes_per_token,
)
from specgraft.utils.io import atomic_path, atomic_write_json, sha256_file
from specgraft.utils.models import DTYPES

logger = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT_VERSION = 1
STORAGE_DTYPES = DTYPES  # the feature cache stores in any recipe dtype
#: Every ``training.feature_dtype``: a float dtype stored as is, or a codec of feature_codecs.
FEATURE_DTYPES = (*STORAGE_DTYPES, *QUANTIZED_DTYPES)
CODEC_FILE = "codec.safetensors"
#: ``training.feature_vq_bits`` default: 7-bit codes (h * 7 / 8 B/token) leave room under half of EAGLE-1's
#: 2h B/token for the codec tables and row offsets.
DEFAULT_VQ_BITS = 7
#: Headroom kept free on the disk beyond the projected cache size.
DISK_MARGIN = 1.05


def cache_layers(required_layers: Sequence[int], needs_logits: bool, num_layers: int) -> tuple[int, ...]:
    """The layers to store: the head's, plus the last (post-norm) one when logits are recomputed from it."""
    layers = set(int(i) for i in required_layers)
    if needs_logits:
        layers.add(num_layers)
    return tuple(sorted(layers))


def bytes_per_token(num_layers_stored: int, hidden_size: int, dtype: str, vq_bits: int = DEFAULT_VQ_BITS) -> int:
    """Feature bytes per token (shard payload; the codec tables and the row offsets come on top)."""
    if dtype in QUANTIZED_DTYPES:
        return payload_bytes_per_token(dtype, num_layers_stored, hidden_size, vq_bits)
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
    """Every byte of the cache that training reads: shards (codes, offsets, headers) and the codec tables."""
    bytes_per_token: float
    """``bytes / tokens``."""
    eagle1_bytes_per_token: int
    payload_bytes_per_token: int = 0
    """:func:`bytes_per_token`: the features alone."""


def build_feature_cache(
    target: Target,
    dataset: Any,
    cache_dir: str | Path,
    layers: Sequence[int],
    dtype: str = "bfloat16",
    rows_per_shard: int = 256,
    batch_size: int = 8,
    show_progress: bool = True,
    vq_bits: int = DEFAULT_VQ_BITS,
) -> CacheInfo:
    """Write (or resume writing) the feature cache of ``dataset`` for ``target``; returns its facts."""
    if dtype not in FEATURE_DTYPES:
        raise SpecgraftError(f"feature dtype {dtype!r} is not supported; use one of {', '.join(FEATURE_DTYPES)}")
    cache_dir = Path(cache_dir)
    layers = tuple(sorted(int(i) for i in layers))
    target.check_layer_indices(layers, what="feature cache layer")
    data_fp = dataset_fingerprint(dataset)
    meta = {"format_version": FORMAT_VERSION, "target": target.identity.to_dict(), "layers": list(layers),
            "dtype": dtype, "rows": len(dataset), "rows_per_shard": rows_per_shard, "data_fingerprint": data_fp}
    if dtype == "vq":
        meta["vq_bits"] = int(vq_bits)
    if (cache_dir / INDEX).is_file():
        info = open_feature_cache(cache_dir, target, layers, data_fp, dtype=dtype, vq_bits=vq_bits).info
        logger.info("feature cache %s is complete (%d rows)", cache_dir, info.rows)
        return info
    old_meta = _check_partial_cache(cache_dir, meta)

    lengths = [int(sum(row["attention_mask"])) if "attention_mask" in row else len(row["input_ids"])
               for row in dataset]
    total_tokens = sum(lengths)
    per_token = bytes_per_token(len(layers), target.hidden_size, dtype, vq_bits)
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

    def shard_features(start: int, stop: int, convert: Any) -> tuple[list[dict[Any, torch.Tensor]], list[int]]:
        """Rows [start, stop): ``convert({layer: [n, h]})`` of each row (right away, so a shard is held in its
        storage form only), and the row offsets."""
        rows_out: list[dict[Any, torch.Tensor]] = []
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
                rows_out.append(convert({i: out.hidden_states[i][j, :n].to("cpu") for i in layers}))
                offsets.append(offsets[-1] + n)
            bar.update(len(rows))
        return rows_out, offsets

    def stacked(row: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.stack([row[i] for i in layers], dim=1)  # [n, L, h]

    bar = tqdm(total=len(dataset), desc="caching features", unit="row", disable=not show_progress)
    codec = None
    if dtype in QUANTIZED_DTYPES:
        calibration = min(len(dataset), rows_per_shard)
        # Every stride-th token of the first shard's rows: about CALIBRATION_TOKENS of them, never the whole shard
        # in fp32 in memory.
        stride = max(1, sum(lengths[:calibration]) // CALIBRATION_TOKENS)

        def calibration_sample() -> torch.Tensor:
            rows, _ = shard_features(0, calibration, lambda r: {0: stacked(r)[::stride].float()})
            return torch.cat([r[0] for r in rows])  # [~CALIBRATION_TOKENS, L, h]

        codec = _resume_or_fit_codec(cache_dir, old_meta, dtype, vq_bits, calibration_sample)
        meta["codec_sha256"] = sha256_file(cache_dir / CODEC_FILE)
        bar.reset()
    atomic_write_json(cache_dir / "cache_meta.json", meta)

    storage = STORAGE_DTYPES.get(dtype)
    n_shards = (len(dataset) + rows_per_shard - 1) // rows_per_shard
    for shard in range(n_shards):
        start, stop = shard * rows_per_shard, min(len(dataset), (shard + 1) * rows_per_shard)
        if _shard_complete(cache_dir, shard):
            bar.update(stop - start)
            continue
        if codec is None:
            rows_out, offsets = shard_features(start, stop, lambda r: {i: r[i].to(storage) for i in layers})
            tensors = {f"layer{i}": torch.cat([r[i] for r in rows_out]).contiguous() for i in layers}
        else:
            rows_out, offsets = shard_features(start, stop, lambda r: {0: codec.encode(stacked(r))})
            tensors = {"codes": torch.cat([r[0] for r in rows_out]).contiguous()}  # [tokens, bytes_per_token]
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
    return open_feature_cache(cache_dir, target, layers, data_fp, dtype=dtype, vq_bits=vq_bits).info


def _resume_or_fit_codec(cache_dir: Path, old_meta: dict[str, Any] | None, dtype: str, vq_bits: int,
                         calibration_sample: Any) -> FeatureCodec:
    """The codec a resumed cache's shards were encoded with (checksum-verified), or one fitted now on
    ``calibration_sample()`` -> [tokens, L, h] and written atomically."""
    codec_file = cache_dir / CODEC_FILE
    if old_meta is not None and old_meta.get("codec_sha256"):
        if not codec_file.is_file() or sha256_file(codec_file) != old_meta["codec_sha256"]:
            raise SpecgraftError(f"the partial feature cache {cache_dir} lost or damaged its {CODEC_FILE} (its shards "
                                 "cannot be decoded); delete the folder and rerun to rebuild the cache")
        return load_codec(codec_file)
    sample = calibration_sample()
    codec = fit_codec(dtype, sample, vq_bits)
    codec.save(codec_file)
    logger.info("feature codec %s fitted on %d calibration tokens", codec.describe(), len(sample))
    return codec


def _check_partial_cache(cache_dir: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """A partial cache may be resumed only if it was started with the same target, layers, dtype and data;
    returns its recorded meta (None when there is no partial cache)."""
    meta_file = cache_dir / "cache_meta.json"
    if not meta_file.is_file():
        return None
    old = json.loads(meta_file.read_text(encoding="utf-8"))
    TargetIdentity.from_dict(old["target"]).require_compatible(TargetIdentity.from_dict(meta["target"]),
                                                               what="feature cache")
    for key in ("layers", "dtype", "vq_bits", "rows", "rows_per_shard", "data_fingerprint"):
        if old.get(key) != meta.get(key):
            raise SpecgraftError(f"the partial feature cache in {cache_dir} was started with a different {key} "
                                 f"({old.get(key)} vs {meta.get(key)}); delete it or choose another "
                                 "training.feature_cache_dir")
    return old


def _shard_complete(cache_dir: Path, shard: int) -> bool:
    sidecar = cache_dir / f"shard-{shard:05d}.json"
    data = cache_dir / f"shard-{shard:05d}.safetensors"
    if not (sidecar.is_file() and data.is_file()):
        return False
    info = json.loads(sidecar.read_text(encoding="utf-8"))
    return data.stat().st_size == info["bytes"] and sha256_file(data) == info["sha256"]


class FeatureCache:
    """Read access to a complete, verified cache: ``features(row) -> {layer: [T, h]}`` (a float cache) or
    ``{"codes": [T, bytes_per_token]}`` (a compressed one, decoded per micro-batch by :meth:`collate`)."""

    def __init__(self, cache_dir: Path, index: dict[str, Any]) -> None:
        self.cache_dir = cache_dir
        self.index = index
        self.layers = tuple(index["layers"])
        self.codec: FeatureCodec | None = None
        files = [cache_dir / shard["file"] for shard in index["shards"]]
        if index["dtype"] in QUANTIZED_DTYPES:
            self.codec = load_codec(cache_dir / CODEC_FILE)
            files.append(cache_dir / CODEC_FILE)
        names = ["codes"] if self.codec is not None else [f"layer{i}" for i in self.layers]
        self._shards: list[tuple[int, int, dict[str, torch.Tensor], torch.Tensor]] = []
        for shard in index["shards"]:
            path = cache_dir / shard["file"]
            with safe_open(str(path), framework="pt") as fh:
                tensors = {name: fh.get_tensor(name) for name in names}
                offsets = fh.get_tensor("offsets")
            self._shards.append((shard["start"], shard["stop"], tensors, offsets))
        total = sum(p.stat().st_size for p in files)
        per_token = total / max(index["tokens"], 1)
        hidden = index["target"]["hidden_size"]
        self.info = CacheInfo(cache_dir, self.layers, index["dtype"], index["rows"], index["tokens"], total,
                              per_token, eagle1_bytes_per_token(hidden),
                              bytes_per_token(len(self.layers), hidden, index["dtype"],
                                              index.get("vq_bits", DEFAULT_VQ_BITS)))

    def features(self, row: int) -> dict[int | str, torch.Tensor]:
        for start, stop, tensors, offsets in self._shards:
            if start <= row < stop:
                a, b = int(offsets[row - start]), int(offsets[row - start + 1])
                if self.codec is not None:
                    return {"codes": tensors["codes"][a:b]}
                return {i: tensors[f"layer{i}"][a:b] for i in self.layers}
        raise IndexError(row)

    def decoded(self, row: int) -> dict[int, torch.Tensor]:
        """Row ``row``'s features {layer: [T, h]} in fp32 (decoded when the cache is compressed)."""
        stored = self.features(row)
        if self.codec is None:
            return {i: t.float() for i, t in stored.items()}
        values = self.codec.decode(stored["codes"])  # [T, L, h]
        return {i: values[:, k] for k, i in enumerate(self.layers)}

    def collate(self, features: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
        """:func:`collate_with_features` with this cache's codec."""
        return collate_with_features(features, pad_token_id, codec=self.codec, layers=self.layers)


def open_feature_cache(cache_dir: str | Path, target: Target, layers: Sequence[int],
                       data_fingerprint: str | None = None, dtype: str | None = None,
                       vq_bits: int = DEFAULT_VQ_BITS) -> FeatureCache:
    """Open and verify a complete cache for ``target``; refuses another target's cache, one stored in another
    ``dtype`` (when given) or a damaged shard or codec."""
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
    if dtype is not None:
        stored = index["dtype"] + (f" ({index.get('vq_bits')} bits)" if index["dtype"] == "vq" else "")
        wanted = dtype + (f" ({vq_bits} bits)" if dtype == "vq" else "")
        if stored != wanted:
            raise SpecgraftError(f"the feature cache {cache_dir} is stored as {stored} but training.feature_dtype asks "
                                 f"for {wanted}; set training.feature_dtype to match or use another "
                                 "training.feature_cache_dir")
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
    if index["dtype"] in QUANTIZED_DTYPES:
        codec_file = cache_dir / CODEC_FILE
        if not codec_file.is_file() or sha256_file(codec_file) != index.get("codec_sha256"):
            raise SpecgraftError(f"the feature cache's {codec_file} is missing or corrupted (checksum mismatch); "
                                 f"delete {cache_dir} and rerun to rebuild the cache")
    return FeatureCache(cache_dir, index)


class CachedFeatureDataset(torch.utils.data.Dataset):
    """Tokenised rows joined with their cached features (row ``i`` of the dataset <-> row ``i`` of the cache)."""

    def __init__(self, dataset: Any, cache: FeatureCache) -> None:
        if len(dataset) != cache.info.rows:
            raise SpecgraftError(f"the feature cache has {cache.info.rows} rows but the data has {len(dataset)}; "
                                 "rebuild the cache in a new training.feature_cache_dir")
        # numpy rows: the collator's torch.as_tensor wraps them instead of converting Python lists of ints (half the
        # data loading time of a tiny-target EAGLE-1 offline step)
        self.dataset = dataset.with_format("numpy") if hasattr(dataset, "with_format") else dataset
        self.cache = cache

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = dict(self.dataset[index])
        row["features"] = self.cache.features(index)
        return row

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """The rows of ``indices`` (torch's DataLoader asks for a batch at once): one batched read of the dataset."""
        if not hasattr(self.dataset, "with_format"):
            return [self[i] for i in indices]
        columns = self.dataset[list(indices)]  # {column: [rows]}
        return [{**{name: values[j] for name, values in columns.items()}, "features": self.cache.features(i)}
                for j, i in enumerate(indices)]


def collate_with_features(features: list[dict[str, Any]], pad_token_id: int, codec: FeatureCodec | None = None,
                          layers: Sequence[int] | None = None) -> dict[str, Any]:
    """``pad_collate`` plus the cached features padded to [B, T, h] per layer (in fp32; zero at padding). A
    compressed cache's codes (``codec``, over ``layers`` in order) are padded first and decoded once per micro-batch."""
    from specgraft.data import pad_collate

    batch = pad_collate([{k: v for k, v in f.items() if k != "features"} for f in features], pad_token_id)
    width = batch["input_ids"].shape[1]
    if codec is not None:
        codes = torch.zeros(len(features), width, codec.bytes_per_token, dtype=torch.uint8)
        present = torch.zeros(len(features), width, 1, 1)
        for j, f in enumerate(features):
            n = f["features"]["codes"].shape[0]
            codes[j, :n] = f["features"]["codes"]
            present[j, :n] = 1.0
        decoded = codec.decode(codes) * present  # [B, T, L, h]
        batch["features"] = {int(i): decoded[:, :, k] for k, i in enumerate(layers)}
        return batch
    out = {}
    for i in features[0]["features"].keys():
        h = features[0]["features"][i].shape[-1]
        stacked = torch.zeros(len(features), width, h, dtype=torch.float32)
        for j, f in enumerate(features):
            t = f["features"][i]
            stacked[j, : t.shape[0]] = t.float()
        out[i] = stacked
    batch["features"] = out
    return batch
