"""Offline feature caches: same training result as online, resumable, verified, refusing the wrong target."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file

from specgraft.cli import main as cli_main
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer
from specgraft.train import features as feat

from .test_trainer import tiny_run  # noqa: F401  (fixture)


def _rows(n=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 17, (n,), generator=gen).tolist()
    ids = [torch.randint(3, 262, (t,), generator=gen).tolist() for t in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids],
                                       "loss_mask": [[1] * len(x) for x in ids]})


def test_cache_holds_exactly_the_target_hidden_states(tmp_path):
    target = Target(tiny_model("qwen3"), tiny_tokenizer())
    rows = _rows()
    info = feat.build_feature_cache(target, rows, tmp_path / "c", layers=(1, 4), dtype="float32", rows_per_shard=3,
                                    show_progress=False)
    assert info.rows == 10 and info.layers == (1, 4)
    assert info.bytes_per_token == pytest.approx(2 * 64 * 4, rel=0.05)  # two fp32 layers (+ small headers)
    cache = feat.open_feature_cache(tmp_path / "c", target, (1, 4))
    for i in (0, 4, 9):
        ids = torch.tensor([rows[i]["input_ids"]])
        ref = target(ids, layers=(1, 4), logits=False)
        got = cache.features(i)
        torch.testing.assert_close(got[4], ref.hidden_states[4][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], ref.hidden_states[1][0], rtol=1e-6, atol=1e-6)

    bf16 = feat.build_feature_cache(target, rows, tmp_path / "b", layers=(4,), dtype="bfloat16", show_progress=False)
    assert bf16.bytes_per_token == pytest.approx(64 * 2, rel=0.1)
    assert bf16.eagle1_bytes_per_token == 64 * 2


def test_resume_after_interruption_and_damaged_shards(tmp_path):
    target = Target(tiny_model("llama"), tiny_tokenizer())
    rows = _rows(12)
    cdir = tmp_path / "c"
    feat.build_feature_cache(target, rows, cdir, layers=(4,), dtype="float16", rows_per_shard=4, show_progress=False)
    first_shard = (cdir / "shard-00000.safetensors").stat().st_mtime_ns
    # Interrupted: the index was never written and the last shard is half-done.
    (cdir / feat.INDEX).unlink()
    (cdir / "shard-00002.json").unlink()
    (cdir / "shard-00002.safetensors").write_bytes(b"partial")
    info = feat.build_feature_cache(target, rows, cdir, layers=(4,), dtype="float16", rows_per_shard=4,
                                    show_progress=False)
    assert info.rows == 12 and (cdir / "shard-00000.safetensors").stat().st_mtime_ns == first_shard

    damaged = cdir / "shard-00001.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    with pytest.raises(SpecgraftError, match=r"shard-00001.safetensors is truncated or corrupted"):
        feat.open_feature_cache(cdir, target, (4,))

    # A partial cache started with other settings is not silently mixed.
    (cdir / feat.INDEX).unlink()
    with pytest.raises(SpecgraftError, match="different dtype"):
        feat.build_feature_cache(target, rows, cdir, layers=(4,), dtype="bfloat16", rows_per_shard=4,
                                 show_progress=False)


def test_refuses_another_targets_cache_and_a_full_disk(tmp_path, monkeypatch):
    target = Target(tiny_model("llama"), tiny_tokenizer())
    rows = _rows(4)
    feat.build_feature_cache(target, rows, tmp_path / "c", layers=(4,), show_progress=False)
    other_tok = tiny_tokenizer()
    other_tok.add_tokens(["zzz"])
    other = Target(tiny_model("llama"), other_tok)
    with pytest.raises(TargetMismatchError, match="tokenizer"):
        feat.open_feature_cache(tmp_path / "c", other, (4,))

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(feat.shutil, "disk_usage", lambda p: usage(10, 10, 100))
    with pytest.raises(SpecgraftError, match=r"needs about .* GiB more but .* GiB free"):
        feat.build_feature_cache(target, rows, tmp_path / "d", layers=(4,), show_progress=False)
    assert not (tmp_path / "d" / "shard-00000.safetensors").exists()


def test_offline_training_equals_online(tiny_run, tmp_path):  # noqa: F811
    _, write_recipe = tiny_run
    training = {"max_steps": 5, "checkpoint_every": 100}
    online = write_recipe("on.yaml", training=training, output={"dir": str(tmp_path / "on")})
    offline = write_recipe("off.yaml", training={**training, "features": "offline", "feature_dtype": "float32"},
                           output={"dir": str(tmp_path / "off")})
    assert cli_main(["train", str(online), "--no-progress"]) == 0
    assert cli_main(["train", str(offline), "--no-progress"]) == 0
    assert (tmp_path / "off" / "features" / feat.INDEX).is_file()
    a = load_file(str(tmp_path / "on" / "head" / "head.safetensors"))
    b = load_file(str(tmp_path / "off" / "head" / "head.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)
    summary = yaml.safe_load((tmp_path / "off" / "train_summary.json").read_text())
    assert summary["feature_cache_bytes_per_token"] > 0 and summary["eagle1_fp16_bytes_per_token"] == 128
    shutil.rmtree(Path(tmp_path / "off" / "features"))
