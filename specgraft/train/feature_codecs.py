"""Compressed storage of cached target features: the codecs behind ``training.feature_dtype`` int8 | int4 | vq.

Every codec works on one token's stored layers at once, ``x`` [n, L, h] (n tokens, the L layers the cache stores,
hidden size h), is fitted once per cache from a calibration sample of the cache's own data (the first shard's rows),
and is saved with the cache (``codec.safetensors``) so every shard is decoded with exactly the tables that encoded
it. The codes of a token are bit-packed into ``bytes_per_token`` bytes.

* ``int8`` / ``int4`` (:class:`AffineCodec`): per-(layer, channel) affine scalar quantization, ``low + code * step``
  with the calibration sample's per-channel min/max (values outside are clamped); int4 packs two codes per byte.
  L * h * bits / 8 bytes per token.
* ``vq`` (:class:`ChannelCodebookCodec`): one code per channel per token for ALL stored layers together: channel c's
  L values (the same residual-stream coordinate at each stored depth, strongly correlated) are replaced by the
  nearest of 2**bits centroids of a per-channel k-means codebook. h * bits / 8 bytes per token whatever L is, so a
  head that reads 4 layers costs what one layer costs at int8 (at 2 bits per value for L = 4 at 8 bits, i.e. more
  error as L grows; the benchmark ``benchmarks/bench_feature_cache.py`` measures the error and its cost in tau).

Decoding (:meth:`decode`) is a gather / multiply-add on the packed codes of a whole padded micro-batch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file

from specgraft.errors import SpecgraftError
from specgraft.utils.io import atomic_path

#: Bits per code of the fixed-width integer codecs.
AFFINE_BITS = {"int8": 8, "int4": 4}
QUANTIZED_DTYPES = (*AFFINE_BITS, "vq")
#: Calibration tokens (sampled from the calibration rows) the codec tables are fitted on.
CALIBRATION_TOKENS = 8192
KMEANS_ITERATIONS = 15
KMEANS_SEED = 0
#: Elements of the largest distance matrix built at once (fp32: 128 MiB), so a 4096-wide target fits in memory.
DISTANCE_CHUNK_ELEMENTS = 2**25
#: Floor of a channel's quantization step (a constant channel would otherwise divide by zero).
MIN_STEP = 1e-12


# -- bit packing -----------------------------------------------------------------------------------------------
def packed_bytes(num_codes: int, bits: int) -> int:
    """Bytes that ``num_codes`` codes of ``bits`` bits take packed (codes padded to a multiple of 8 bits)."""
    return math.ceil(num_codes * bits / 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integer codes in [0, 2**bits) -> [..., ceil(n * bits / 8)] uint8, little-endian bit order."""
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    pad = (-n) % 8
    c = torch.nn.functional.pad(codes.to(torch.int32), (0, pad)).reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(bits, dtype=torch.int32, device=codes.device)
    bit_planes = (c.unsqueeze(-1) >> shifts) & 1  # [..., n/8, 8, bits]
    octets = bit_planes.reshape(*c.shape[:-2], -1, bits, 8)  # 8 codes * bits = bits bytes per group of 8 codes
    weights = torch.arange(8, dtype=torch.int32, device=codes.device)
    packed = (octets << weights).sum(-1)  # [..., n/8, bits]
    return packed.reshape(*codes.shape[:-1], -1)[..., : packed_bytes(n, bits)].to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: [..., ceil(n * bits / 8)] uint8 -> [..., n] int64 codes."""
    if bits == 8:
        return packed.long()
    groups = math.ceil(num_codes / 8)
    full = torch.nn.functional.pad(packed.to(torch.int32), (0, groups * bits - packed.shape[-1]))
    octets = full.reshape(*packed.shape[:-1], groups, bits, 1) >> torch.arange(8, dtype=torch.int32,
                                                                               device=packed.device)
    bit_planes = (octets & 1).reshape(*packed.shape[:-1], groups, 8, bits)
    shifts = torch.arange(bits, dtype=torch.int32, device=packed.device)
    codes = (bit_planes << shifts).sum(-1).reshape(*packed.shape[:-1], groups * 8)
    return codes[..., :num_codes].long()


# -- codecs ----------------------------------------------------------------------------------------------------
class FeatureCodec:
    """Base: ``encode`` [n, L, h] float -> [n, bytes_per_token] uint8; ``decode`` [..., bytes_per_token] uint8 ->
    [..., L, h] float."""

    kind: ClassVar[str]
    bits: int
    num_layers: int
    hidden_size: int

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError

    def tables(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> dict[str, int | str]:
        return {"kind": self.kind, "bits": self.bits, "layers": self.num_layers, "hidden_size": self.hidden_size}

    def save(self, path: Path) -> None:
        """Atomically write the tables (and what they describe, as safetensors metadata) to ``path``."""
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in self.tables().items()}, str(tmp),
                      metadata={k: str(v) for k, v in self.describe().items()})


class AffineCodec(FeatureCodec):
    """Per-(layer, channel) uniform scalar quantization: ``x ~ low + code * step``, codes in [0, 2**bits)."""

    kind = "affine"

    def __init__(self, low: torch.Tensor, step: torch.Tensor, bits: int) -> None:
        self.low, self.step, self.bits = low.float(), step.float(), bits  # [L, h] each
        self.num_layers, self.hidden_size = low.shape

    @classmethod
    def fit(cls, sample: torch.Tensor, bits: int) -> AffineCodec:
        """``sample`` [N, L, h]: the per-channel range of the calibration tokens, split into 2**bits - 1 steps."""
        low, high = sample.float().amin(0), sample.float().amax(0)
        return cls(low, ((high - low) / (2**bits - 1)).clamp(min=MIN_STEP), bits)

    @property
    def bytes_per_token(self) -> int:
        return packed_bytes(self.num_layers * self.hidden_size, self.bits)

    def tables(self) -> dict[str, torch.Tensor]:
        return {"low": self.low, "step": self.step}

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        codes = torch.round((x.float() - self.low) / self.step).clamp(0, 2**self.bits - 1)
        return pack_codes(codes.flatten(-2), self.bits)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        low, step = self.low.to(packed.device), self.step.to(packed.device)
        codes = unpack_codes(packed, self.bits, self.num_layers * self.hidden_size)
        codes = codes.reshape(*packed.shape[:-1], self.num_layers, self.hidden_size)
        return (low + codes.to(torch.float32) * step).to(dtype)


class ChannelCodebookCodec(FeatureCodec):
    """One code per channel per token over all L stored layers: channel c's L-vector -> ``codebook[c, code]``."""

    kind = "vq"

    def __init__(self, codebook: torch.Tensor, scale: torch.Tensor, bits: int) -> None:
        # codebook [h, K, L] in feature units; scale [h, L]: the per-(channel, layer) spread the nearest centroid
        # is measured in (so a layer with a larger norm, e.g. the post-norm last one, does not outweigh the others).
        self.codebook, self.scale, self.bits = codebook.float(), scale.float(), bits
        self.hidden_size, _, self.num_layers = codebook.shape

    @classmethod
    def fit(cls, sample: torch.Tensor, bits: int) -> ChannelCodebookCodec:
        """Per-channel k-means (2**bits centroids, :data:`KMEANS_ITERATIONS` Lloyd steps, deterministic init from
        :data:`KMEANS_SEED`) of ``sample`` [N, L, h] in per-(channel, layer) standardized units."""
        points = sample.float().permute(2, 0, 1).contiguous()  # [h, N, L]
        scale = points.std(1).clamp(min=MIN_STEP)  # [h, L]
        z = points / scale[:, None, :]
        k = 2**bits
        n = z.shape[1]
        gen = torch.Generator().manual_seed(KMEANS_SEED)
        init = torch.randperm(n, generator=gen)[: min(k, n)]
        if len(init) < k:  # fewer calibration tokens than centroids: repeat (the duplicates stay unused)
            init = init.repeat(math.ceil(k / len(init)))[:k]
        centroids = z[:, init].clone()  # [h, K, L]
        for _ in range(KMEANS_ITERATIONS):
            assign = _nearest(z, centroids)  # [h, N]
            sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand_as(z), z)
            ones = torch.ones_like(assign, dtype=torch.float32)
            counts = torch.zeros(centroids.shape[:2]).scatter_add_(1, assign, ones)  # [h, K]
            centroids = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids)
        return cls(centroids * scale[:, None, :], scale, bits)

    @property
    def bytes_per_token(self) -> int:
        return packed_bytes(self.hidden_size, self.bits)

    def tables(self) -> dict[str, torch.Tensor]:
        return {"codebook": self.codebook, "scale": self.scale}

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.float().permute(2, 0, 1) / self.scale[:, None, :])  # [h, n, L]
        codes = _nearest(z, self.codebook / self.scale[:, None, :])  # [h, n]
        return pack_codes(codes.T, self.bits)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codebook = self.codebook.to(packed.device)
        codes = unpack_codes(packed, self.bits, self.hidden_size)  # [..., h]
        k = codebook.shape[1]
        flat = codebook.reshape(-1, self.num_layers)  # [h*K, L]: row c*K + code
        rows = codes + torch.arange(self.hidden_size, device=packed.device) * k
        return flat[rows].transpose(-1, -2).to(dtype)  # [..., h, L] -> [..., L, h]


def _nearest(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """[G, N, d] points, [G, K, d] centroids -> [G, N] index of each point's nearest centroid (chunked over N).
    argmin_k ||p - c_k||^2 = argmin_k (||c_k||^2 - 2 p.c_k): one batched matmul, no square roots."""
    g, n, _ = points.shape
    chunk = max(1, DISTANCE_CHUNK_ELEMENTS // max(g * centroids.shape[1], 1))
    c_sq = centroids.pow(2).sum(-1).unsqueeze(1)  # [G, 1, K]
    c_t = centroids.transpose(1, 2)  # [G, d, K]
    return torch.cat([(c_sq - 2 * torch.bmm(points[:, a:a + chunk], c_t)).argmin(-1) for a in range(0, n, chunk)],
                     dim=1)


def fit_codec(dtype: str, sample: torch.Tensor, vq_bits: int) -> FeatureCodec:
    """The codec of ``training.feature_dtype`` ``dtype`` fitted on ``sample`` [N, L, h] (at most
    :data:`CALIBRATION_TOKENS` tokens of it, drawn deterministically)."""
    if sample.shape[0] > CALIBRATION_TOKENS:
        pick = torch.randperm(sample.shape[0], generator=torch.Generator().manual_seed(KMEANS_SEED))
        sample = sample[pick[:CALIBRATION_TOKENS]]
    if dtype in AFFINE_BITS:
        return AffineCodec.fit(sample, AFFINE_BITS[dtype])
    if dtype == "vq":
        return ChannelCodebookCodec.fit(sample, vq_bits)
    raise SpecgraftError(f"feature dtype {dtype!r} is not a quantized one; use one of {', '.join(QUANTIZED_DTYPES)}")


def load_codec(path: Path) -> FeatureCodec:
    """The codec :meth:`FeatureCodec.save` wrote to ``path``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    tensors = load_file(str(path))
    bits = int(meta["bits"])
    if meta.get("kind") == AffineCodec.kind:
        return AffineCodec(tensors["low"], tensors["step"], bits)
    if meta.get("kind") == ChannelCodebookCodec.kind:
        return ChannelCodebookCodec(tensors["codebook"], tensors["scale"], bits)
    raise SpecgraftError(f"{path} holds an unknown feature codec {meta.get('kind')!r}; delete the cache and rebuild it")


def payload_bytes_per_token(dtype: str, num_layers: int, hidden_size: int, vq_bits: int) -> int:
    """Bytes of codes per token (before the codec tables and the row offsets, which :class:`CacheInfo` adds)."""
    if dtype in AFFINE_BITS:
        return packed_bytes(num_layers * hidden_size, AFFINE_BITS[dtype])
    if dtype == "vq":
        return packed_bytes(hidden_size, vq_bits)
    raise SpecgraftError(f"feature dtype {dtype!r} is not a quantized one; use one of {', '.join(QUANTIZED_DTYPES)}")
