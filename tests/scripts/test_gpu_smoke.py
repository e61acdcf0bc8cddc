"""benchmarks/gpu_smoke.py at tiny sizes on the CPU (the CI run of the GPU smoke test): both target shapes train
EAGLE-3 and DFlash heads through `accelerate launch`, and every speculative answer equals transformers'
``generate``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_gpu_smoke_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_smoke-tiny.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--tiny", "--device", "cpu",
                           "--steps", "6", "--results-dir", str(tmp_path)], capture_output=True, text=True, env=env,
                          check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(out.read_text())
    assert written["source"] == "measured" and written["dtype"] == "float32"
    assert {(row["target"], row["family"]) for row in written["figures"]} == {
        (arch, family) for arch in ("llama", "qwen3") for family in ("dflash", "eagle3")}
    result = written["details"]
    assert result["lossless"] is True and result["tiny"] is True and result["dtype"] == "float32"
    assert result["launcher"] == "accelerate" and result["device"] == "cpu"
    assert sorted(result["targets"]) == ["llama", "qwen3"]
    for arch, entry in result["targets"].items():
        assert entry["parameters"] > 0
        assert sorted(entry["families"]) == ["dflash", "eagle3"]
        for family, row in entry["families"].items():
            assert row["train_steps"] == 6 and row["train_tokens_per_s"] > 0, (arch, family)
            assert row["identical_to_generate"] == row["identical_to_plain"] == row["prompts"] > 0
            assert row["tau"] >= 1.0 and row["speedup_vs_generate"] > 0 and row["speedup_vs_plain"] > 0
    assert "lossless: True" in done.stdout


def test_bad_arguments_get_one_error_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--tiny", "--device", "cpu",
                           "--steps", "0", "--results-dir", str(tmp_path)], capture_output=True, text=True,
                          check=False, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: --steps must be at least 1, got 0"
    assert list(tmp_path.iterdir()) == []
