"""Two processes (DDP over gloo on CPU) give the same head as one process with the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from specgraft.testing import run_torchrun

from .test_trainer import tiny_run  # noqa: F401  (fixture)

#: fp32 all-reduce of per-rank mean gradients vs one mean over the global batch: equal up to rounding.
TOLERANCE = 1e-5


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("head", ["medusa", "eagle3"])
def test_two_processes_match_one_process(tiny_run, tmp_path, head):  # noqa: F811
    _, write_recipe = tiny_run
    training = {"max_steps": 6, "checkpoint_every": 100, "log_every": 1}
    head_cfg = {"type": head, "ttt_steps": 2} if head == "eagle3" else {"type": head}
    one = write_recipe("one.yaml", training={**training, "micro_batch_size": 4}, head=head_cfg,
                       output={"dir": str(tmp_path / "one")})
    two = write_recipe("two.yaml", training={**training, "micro_batch_size": 2}, head=head_cfg,
                       output={"dir": str(tmp_path / "two")})

    run = subprocess.run([sys.executable, "-m", "specgraft.train", str(one), "--no-progress"],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    # On CPU, accelerate's own launcher runs MULTI_CPU jobs in one process unless MPI is set up; torchrun starts
    # real gloo processes and accelerate picks them up (it reports MULTI_CPU).
    run = run_torchrun(["-m", "specgraft.train", str(two), "--no-progress"], env=_env())
    assert run.returncode == 0, run.stderr[-3000:]

    a = load_file(str(tmp_path / "one" / "head" / "head.safetensors"))
    b = load_file(str(tmp_path / "two" / "head" / "head.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if not a[k].is_floating_point())  # d2t / t2d
    worst = max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point())
    print(f"{head}: max |1-process - 2-process| head weight difference: {worst:.3g}")
    assert worst <= TOLERANCE, f"1-process and 2-process heads differ by {worst}"
    # Training did move the weights, so the comparison is meaningful.
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if a[k].is_floating_point())
    import json

    summary = json.loads((tmp_path / "two" / "train_summary.json").read_text())
    assert summary["num_processes"] == 2


@pytest.mark.slow
def test_distillation_two_processes_match_one_process(tiny_run, tmp_path):  # noqa: F811
    _, write_recipe = tiny_run
    training = {"max_steps": 4, "checkpoint_every": 100, "log_every": 1}
    distill = {"keep_every_k_layers": 2, "loss": "fkl", "alpha_eval_every": 100}
    one = write_recipe("d1.yaml", training={**training, "micro_batch_size": 4}, distill=distill, head=None,
                       output={"dir": str(tmp_path / "d1")})
    two = write_recipe("d2.yaml", training={**training, "micro_batch_size": 2}, distill=distill, head=None,
                       output={"dir": str(tmp_path / "d2")})
    run = subprocess.run([sys.executable, "-m", "specgraft.distill", str(one), "--no-progress"],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    run = run_torchrun(["-m", "specgraft.distill", str(two), "--no-progress"], env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    a = load_file(str(tmp_path / "d1" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "d2" / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"distill: max |1-process - 2-process| student weight difference: {worst:.3g}")
    assert worst <= TOLERANCE, f"1-process and 2-process students differ by {worst}"


@pytest.mark.slow
def test_held_out_acceptance_is_measured_once_across_processes(tiny_run, tmp_path):  # noqa: F811
    """training.eval_every in a 2-process run: the main process measures, once per evaluation step."""
    import json

    _, write_recipe = tiny_run
    recipe = write_recipe("eval.yaml", training={"max_steps": 4, "micro_batch_size": 2, "checkpoint_every": 100,
                                                 "log_every": 1, "eval_every": 2, "eval_prompts": 1,
                                                 "eval_max_new_tokens": 8,
                                                 "eval_setting": {"mode": "chain", "depth": 2}},
                          head={"type": "eagle3", "ttt_steps": 2}, output={"dir": str(tmp_path / "eval")},
                          data={"eval_fraction": 0.2})
    run = run_torchrun(["-m", "specgraft.train", str(recipe), "--no-progress"], env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert all(r["sim_tau"] >= 1.0 and r["decoder_identical"] == r["decoder_prompts"] == 1 for r in records)
    summary = json.loads((tmp_path / "eval" / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and 0 < summary["eval_time_fraction"] < 1
    assert (tmp_path / "eval" / "best" / "head.safetensors").is_file()
