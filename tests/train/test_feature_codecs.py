"""Compressed feature caches (training.feature_dtype int8 | int4 | vq): exact packing, measured error bounds with
negative controls, exact bytes/token, the precision in the cache's key, resume, and training through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specgraft.cli import main as cli_main
from specgraft.errors import SpecgraftError
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer
from specgraft.train import feature_codecs as codecs
from specgraft.train import features as feat

from .test_features import _rows
from .test_trainer import tiny_run  # noqa: F401  (fixture)

HIDDEN = 64


def _residual_stream(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, 4, h] features shaped like stored target layers: each deeper layer = the previous one + an update, the
    last one at twice the scale (a post-norm layer is larger than the residual stream)."""
    x1 = torch.randn(n, HIDDEN, generator=gen)
    x2 = x1 + 0.3 * torch.randn(n, HIDDEN, generator=gen)
    x3 = x2 + 0.3 * torch.randn(n, HIDDEN, generator=gen)
    return torch.stack([x1, x2, x3, 2 * x3], dim=1)


def _relative_error_by_layer(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    return [float((y[:, i] - x[:, i]).norm() / x[:, i].norm()) for i in range(x.shape[1])]


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_round_trips_exactly(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in (1, 5, 8, 13, 64, 256):
        codes = torch.randint(0, 2**bits, (3, 2, n), generator=gen)
        packed = codecs.pack_codes(codes, bits)
        assert packed.dtype == torch.uint8 and packed.shape == (3, 2, -(-n * bits // 8))
        assert torch.equal(codecs.unpack_codes(packed, bits, n), codes)
    # int4: two codes per byte, low nibble first.
    assert codecs.pack_codes(torch.tensor([3, 10]), 4).tolist() == [3 + 16 * 10]


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_affine_codec_error_is_at_most_half_a_step_inside_the_calibrated_range(dtype, bits):
    gen = torch.Generator().manual_seed(0)
    calibration, held_out = _residual_stream(4096, gen), _residual_stream(1024, gen)
    codec = codecs.fit_codec(dtype, calibration, vq_bits=7)
    assert codec.bytes_per_token == 4 * HIDDEN * bits // 8
    low, high = codec.low, codec.low + codec.step * (2**bits - 1)
    torch.testing.assert_close(low, calibration.amin(0))
    torch.testing.assert_close(high, calibration.amax(0), rtol=1e-5, atol=1e-5)
    inside = held_out.clamp(low, high)
    decoded = codec.decode(codec.encode(inside))
    # Reference bound of rounding to the nearest of 2**bits evenly spaced levels: |x - x'| <= step / 2.
    max_in_steps = float(((decoded - inside).abs() / codec.step).max())
    assert max_in_steps <= 0.5 + 1e-4
    measured = max(_relative_error_by_layer(inside, decoded))
    assert measured < {8: 0.01, 4: 0.15}[bits]
    # Negative control: values beyond the calibrated range are clamped, so the bound does not hold for them.
    beyond = high + 3 * codec.step
    assert float(((codec.decode(codec.encode(beyond[None])) - beyond) / codec.step).abs().min()) >= 3 - 1e-3


@pytest.mark.slow
def test_channel_codebook_error_bound_and_negative_controls():
    gen = torch.Generator().manual_seed(0)
    calibration, held_out = _residual_stream(4096, gen), _residual_stream(1024, gen)
    codec = codecs.fit_codec("vq", calibration, vq_bits=7)
    packed = codec.encode(held_out)
    assert packed.shape == (1024, HIDDEN * 7 // 8)  # one 7-bit code per channel for all 4 layers
    decoded = codec.decode(packed)
    assert decoded.shape == held_out.shape
    errors = _relative_error_by_layer(held_out, decoded)
    assert max(errors) < 0.15  # measured 0.129 (first layer), 0.092 (last)
    # Every decoded L-vector is a centroid of its channel's codebook (nothing is made up between them).
    channel = 5
    centroids = codec.codebook[channel]  # [K, L]
    distance = torch.cdist(decoded[:, :, channel], centroids, compute_mode="donot_use_mm_for_euclid_dist")
    assert distance.min(-1).values.max() < 1e-5
    # Negative control 1: the same number of values without cross-layer correlation is far harder to code at the
    # same rate (the bound above is a property of the stored layers' structure, not of the codec alone).
    independent = torch.randn(4096, 4, HIDDEN, generator=gen) * calibration.std(0)
    control = codecs.fit_codec("vq", independent, vq_bits=7)
    assert min(_relative_error_by_layer(independent, control.decode(control.encode(independent)))) > 0.3
    # Negative control 2: a codebook fitted on other data does not reconstruct these features.
    assert min(_relative_error_by_layer(held_out, control.decode(control.encode(held_out)))) > 2 * max(errors)
    # Deterministic: the same calibration sample gives the same tables.
    torch.testing.assert_close(codecs.fit_codec("vq", calibration, vq_bits=7).codebook, codec.codebook,
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype,payload", [("int8", 4 * HIDDEN), ("int4", 2 * HIDDEN), ("vq", HIDDEN * 7 // 8)])
def test_bytes_per_token_is_exactly_the_codes_plus_the_counted_overhead(tmp_path, dtype, payload):
    target = Target(tiny_model("llama"), tiny_tokenizer())
    rows = _rows(10)
    layers = (1, 2, 3, 4)  # 4 stored layers, like EAGLE-3 (3 fused + the last for the soft targets) on stories260K
    info = feat.build_feature_cache(target, rows, tmp_path / "c", layers=layers, dtype=dtype, rows_per_shard=4,
                                    show_progress=False)
    tokens = sum(len(r) for r in rows["input_ids"])
    assert info.tokens == tokens and info.payload_bytes_per_token == payload
    assert feat.bytes_per_token(len(layers), HIDDEN, dtype, vq_bits=7) == payload
    code_bytes = 0
    for shard in sorted((tmp_path / "c").glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            assert set(fh.keys()) == {"codes", "offsets"}
            codes = fh.get_tensor("codes")
        assert codes.dtype == torch.uint8 and codes.shape[1] == payload
        code_bytes += codes.numel()
    assert code_bytes == payload * tokens
    # Every byte the cache reads is counted: the shards (codes, offsets, headers) and the codec tables.
    files = [*(tmp_path / "c").glob("shard-*.safetensors"), tmp_path / "c" / feat.CODEC_FILE]
    assert info.bytes == sum(p.stat().st_size for p in files)
    assert info.bytes_per_token == info.bytes / tokens
    # EAGLE-1 stores 2h B/token; vq stores h*7/8 B/token whatever the number of layers.
    assert info.eagle1_bytes_per_token == 2 * HIDDEN
    if dtype == "vq":
        assert payload <= 0.5 * info.eagle1_bytes_per_token


def test_decoded_cache_matches_the_target_and_pads_with_zeros(tmp_path):
    target = Target(tiny_model("qwen3"), tiny_tokenizer())
    rows = _rows(12)
    cache = feat.open_feature_cache(
        feat.build_feature_cache(target, rows, tmp_path / "c", layers=(1, 4), dtype="int8", rows_per_shard=5,
                                 show_progress=False).path, target, (1, 4), dtype="int8")
    codec = cache.codec
    for i in (0, 6, 11):
        ref = target(torch.tensor([rows[i]["input_ids"]]), layers=(1, 4), logits=False).hidden_states
        got = cache.decoded(i)
        for k, layer in enumerate((1, 4)):
            # Within half a step wherever the value lies in the range calibrated on the first shard's rows (all of
            # it for those rows); a later row's value outside it is clamped to the range's end.
            low, high = codec.low[k], codec.low[k] + codec.step[k] * 255
            inside = ref[layer][0].clamp(low, high)
            if i < 5:  # (up to the cache's batched forward vs this single-row one: ~1e-8)
                torch.testing.assert_close(inside, ref[layer][0], rtol=0, atol=1e-6)
            assert float(((got[layer] - inside).abs() / codec.step[k]).max()) <= 0.5 + 1e-3
    batch = cache.collate([dict(rows[i], features=cache.features(i)) for i in (0, 1)], pad_token_id=0)
    n0, n1 = len(rows[0]["input_ids"]), len(rows[1]["input_ids"])
    short, width = min(n0, n1), max(n0, n1)
    assert batch["features"][4].shape == (2, width, HIDDEN) and batch["features"][4].dtype == torch.float32
    padded_row = 0 if n0 < n1 else 1
    assert torch.all(batch["features"][1][padded_row, short:] == 0)
    torch.testing.assert_close(batch["features"][4][0, :n0], cache.decoded(0)[4])


def test_precision_is_part_of_the_cache_key_and_resume_keeps_the_codec(tmp_path):
    target = Target(tiny_model("llama"), tiny_tokenizer())
    rows = _rows(12)
    cdir = tmp_path / "c"
    feat.build_feature_cache(target, rows, cdir, layers=(2, 4), dtype="vq", rows_per_shard=4, show_progress=False,
                             vq_bits=6)
    index = json.loads((cdir / feat.INDEX).read_text())
    assert index["dtype"] == "vq" and index["vq_bits"] == 6 and len(index["codec_sha256"]) == 64
    codec_bytes = (cdir / feat.CODEC_FILE).read_bytes()
    shard_bytes = (cdir / "shard-00002.safetensors").read_bytes()

    # A complete cache is refused (never read) in another precision, also through build (the trainer's path).
    for dtype, bits in (("bfloat16", 7), ("int4", 7), ("vq", 7)):
        with pytest.raises(SpecgraftError, match=r"is stored as vq \(6 bits\) but training.feature_dtype asks"):
            feat.open_feature_cache(cdir, target, (2, 4), dtype=dtype, vq_bits=bits)
        with pytest.raises(SpecgraftError, match="is stored as vq"):
            feat.build_feature_cache(target, rows, cdir, layers=(2, 4), dtype=dtype, vq_bits=bits,
                                     show_progress=False)
    assert feat.open_feature_cache(cdir, target, (2, 4), dtype="vq", vq_bits=6).info.dtype == "vq"

    # Interrupted after 2 shards: the resumed run reuses the codec, so the rebuilt shard is byte-identical.
    (cdir / feat.INDEX).unlink()
    (cdir / "shard-00002.json").unlink()
    (cdir / "shard-00002.safetensors").write_bytes(b"partial")
    with pytest.raises(SpecgraftError, match="different vq_bits"):
        feat.build_feature_cache(target, rows, cdir, layers=(2, 4), dtype="vq", rows_per_shard=4, vq_bits=7,
                                 show_progress=False)
    feat.build_feature_cache(target, rows, cdir, layers=(2, 4), dtype="vq", rows_per_shard=4, vq_bits=6,
                             show_progress=False)
    assert (cdir / feat.CODEC_FILE).read_bytes() == codec_bytes
    assert (cdir / "shard-00002.safetensors").read_bytes() == shard_bytes

    # A damaged codec is named, never used to decode.
    (cdir / feat.CODEC_FILE).write_bytes(codec_bytes[:-8])
    with pytest.raises(SpecgraftError, match="codec.safetensors is missing or corrupted"):
        feat.open_feature_cache(cdir, target, (2, 4), dtype="vq", vq_bits=6)
    (cdir / feat.INDEX).unlink()
    with pytest.raises(SpecgraftError, match="lost or damaged its codec.safetensors"):
        feat.build_feature_cache(target, rows, cdir, layers=(2, 4), dtype="vq", rows_per_shard=4, vq_bits=6,
                                 show_progress=False)


@pytest.mark.slow
def test_training_from_a_compressed_cache_through_the_cli(tiny_run, tmp_path, capsys):  # noqa: F811
    _, write_recipe = tiny_run
    head = {"type": "eagle3", "ttt_steps": 2}
    cache_dir = tmp_path / "shared-features"
    recipe = write_recipe("vq.yaml", head=head,
                          training={"max_steps": 3, "checkpoint_every": 100, "features": "offline",
                                    "feature_dtype": "vq", "feature_cache_dir": str(cache_dir)},
                          output={"dir": str(tmp_path / "vq")})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "vq" / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["feature_cache_dtype"] == "vq"
    # EAGLE-3's fused layers (1, 2, 3 on this 4-layer target) and the last one, all coded together.
    assert json.loads((cache_dir / feat.INDEX).read_text())["layers"] == [1, 2, 3, 4]
    assert summary["feature_cache_payload_bytes_per_token"] == HIDDEN * 7 // 8
    assert (tmp_path / "vq" / "head" / "head.safetensors").is_file()
    capsys.readouterr()

    # The same cache folder asked for in another precision: one error line, exit 2, nothing trained.
    other = write_recipe("bf16.yaml", head=head,
                         training={"max_steps": 3, "checkpoint_every": 100, "features": "offline",
                                   "feature_dtype": "bfloat16", "feature_cache_dir": str(cache_dir)},
                         output={"dir": str(tmp_path / "bf16")})
    assert cli_main(["train", str(other), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the feature cache") and "stored as vq (7 bits)" in err[-1]
    assert not (tmp_path / "bf16" / "head").exists()

    # An unknown precision is refused when the recipe is read.
    assert cli_main(["train", str(recipe), "training.feature_dtype=int3", "--no-progress"]) == 2
    assert "feature_dtype" in capsys.readouterr().err
