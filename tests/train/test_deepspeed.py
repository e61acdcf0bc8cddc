"""DeepSpeed ZeRO-2 through accelerate on this CPU (single process: DeepSpeed's CPU accelerator + accelerate
cannot run 2 CPU processes, see docs/distributed.md). Same result as plain training; resume works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .test_trainer import tiny_run  # noqa: F401  (fixture)

pytest.importorskip("deepspeed")
REPO = Path(__file__).resolve().parents[2]
#: DeepSpeed's ZeRO-2 AdamW step vs torch's AdamW in fp32: equal up to rounding.
TOLERANCE = 1e-5


def _deepspeed_train(recipe: Path, *extra: str) -> subprocess.CompletedProcess:
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [str(accelerate), "launch", "--config_file", str(REPO / "recipes/accelerate/deepspeed_zero2.yaml"),
           "--num_processes", "1", "--mixed_precision", "no", "--main_process_port", "29571",
           "-m", "specgraft.train", str(recipe), "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_zero2_matches_plain_training_and_resumes(tiny_run, tmp_path):  # noqa: F811
    _, write_recipe = tiny_run
    training = {"max_steps": 6, "checkpoint_every": 3, "max_grad_norm": 1.0}
    plain = write_recipe("plain.yaml", training=training, output={"dir": str(tmp_path / "plain")})
    zero2 = write_recipe("zero2.yaml", training=training, output={"dir": str(tmp_path / "zero2")})
    run = subprocess.run([sys.executable, "-m", "specgraft.train", str(plain), "--no-progress"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    run = _deepspeed_train(zero2)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "zero2"
    assert (out / "checkpoints" / "step-0000003" / "deepspeed").is_dir()
    # Only the head is saved: no target tensor is in the head file.
    weights = load_file(str(out / "head" / "head.safetensors"))
    assert not any(k.startswith(("model.", "embed_tokens")) for k in weights)
    reference = load_file(str(tmp_path / "plain" / "head" / "head.safetensors"))
    worst = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    print(f"max |ZeRO-2 - plain| head weight difference: {worst:.3g}")
    assert worst <= TOLERANCE, f"ZeRO-2 differs from plain training by {worst}"

    # Resume from step 3 (drop the final checkpoint and head) and finish again: same weights.
    shutil.rmtree(out / "checkpoints" / "step-0000006")
    shutil.rmtree(out / "head")
    run = _deepspeed_train(zero2, "--resume")
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = load_file(str(out / "head" / "head.safetensors"))
    for name in weights:
        assert torch.equal(resumed[name], weights[name]), name
