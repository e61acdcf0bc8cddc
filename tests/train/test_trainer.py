"""The head-training pipeline end to end through the real CLI on tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from specgraft.cli import main as cli_main
from specgraft.heads import load_head
from specgraft.target import load_target
from specgraft.testing import TINY_CORPUS_TEXT, recipe_writer, tiny_model, tiny_tokenizer
from specgraft.train.checkpoint import list_checkpoints, verify_checkpoint


@pytest.fixture
def tiny_run(tmp_path):
    """A saved tiny Llama target + tokenizer, a text corpus, and a recipe writer."""
    model_dir = tmp_path / "target"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "corpus.txt"
    data.write_text(TINY_CORPUS_TEXT)

    write_recipe = recipe_writer(tmp_path, {
        "model": {"name_or_path": str(model_dir)},
        "data": {"path": str(data), "format": "text", "max_length": 64, "packing": True,
                 "cache_dir": str(tmp_path / "cache")},
        "head": {"type": "medusa", "num_heads": 2},
        "training": {"max_steps": 12, "micro_batch_size": 4, "learning_rate": 1e-2, "warmup_steps": 2,
                     "checkpoint_every": 4, "log_every": 2, "seed": 3},
        "output": {"dir": str(tmp_path / "out")},
        "tracking": {"backend": "tensorboard"},
    })
    return model_dir, write_recipe


def test_train_cli_end_to_end(tiny_run, capsys):
    model_dir, write_recipe = tiny_run
    recipe = write_recipe()
    assert cli_main(["train", str(recipe), "training.max_steps=12", "--no-progress"]) == 0
    out = Path(yaml.safe_load(recipe.read_text())["output"]["dir"])
    assert "head saved to" in capsys.readouterr().out

    # The resolved recipe is saved beside the output and the head; tensorboard logs were written.
    assert yaml.safe_load((out / "recipe.yaml").read_text())["training"]["max_steps"] == 12
    assert (out / "head" / "recipe.yaml").is_file()
    assert list(out.rglob("events.out.tfevents.*"))
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 12 and summary["tokens_seen"] > 0

    # Checkpoints verify, and only keep_checkpoints (2) are kept.
    ckpts = list_checkpoints(out)
    assert [c.name for c in ckpts] == ["step-0000012", "step-0000008"]
    assert all(verify_checkpoint(c) is None for c in ckpts)

    # The head loads onto the target and learned something (the corpus is highly repetitive).
    target = load_target(model_dir)
    head = load_head(target, out / "head")
    meta = json.loads((out / "head" / "head_config.json").read_text())
    assert meta["training"]["steps"] == 12
    # The Medusa heads' per-position top-k accuracy was measured for the static tree, and reported.
    assert len(meta["config"]["topk_accuracy"]) == 2 and len(summary["medusa_top1_accuracy"]) == 2
    initial = tiny_model("llama").lm_head.weight
    assert not torch.equal(head.state_dict()[next(k for k in head.state_dict() if "lm_head" in k)], initial)


def test_refuses_non_empty_output_and_resume_with_other_recipe(tiny_run, capsys):
    _, write_recipe = tiny_run
    recipe = write_recipe()
    assert cli_main(["train", str(recipe), "training.max_steps=4", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    assert "is not empty; pass --resume" in capsys.readouterr().err
    assert cli_main(["train", str(recipe), "training.learning_rate=0.5", "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "was made by a different recipe" in err and err.count("\n") == 1


def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(tiny_run, capsys):
    _, write_recipe = tiny_run
    recipe = write_recipe(training={"learning_rate": 1e30, "max_grad_norm": 0.0, "warmup_steps": 0,
                                    "checkpoint_every": 1, "max_steps": 30})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the loss became" in err and "at step" in err and "last good checkpoint" in err
    out = Path(yaml.safe_load(recipe.read_text())["output"]["dir"])
    assert all(verify_checkpoint(c) is None for c in list_checkpoints(out))


def _run_train(recipe: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "specgraft.train", str(recipe), "--no-progress", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_equal_to_uninterrupted(tiny_run, tmp_path):
    """Kill training (SIGKILL) after a checkpoint and mid-way to the next; resume; weights equal bitwise."""
    _, write_recipe = tiny_run
    steps = {"max_steps": 24, "checkpoint_every": 8}
    reference = write_recipe("ref.yaml", training=steps, output={"dir": str(tmp_path / "ref")})
    proc = _run_train(reference)
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-2000:]

    interrupted = write_recipe("int.yaml", training=steps, output={"dir": str(tmp_path / "int")})
    for _attempt in range(3):
        proc = _run_train(interrupted)
        first = tmp_path / "int" / "checkpoints" / "step-0000008"
        deadline = time.time() + 600
        while not (first / "manifest.json").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        killed_mid_run = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if killed_mid_run and not (tmp_path / "int" / "head").exists():
            break
        subprocess.run(["rm", "-rf", str(tmp_path / "int")], check=True)
    else:
        pytest.fail("could not kill the run between two checkpoints")

    proc = _run_train(interrupted, "--resume")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    ref_weights = load_file(str(tmp_path / "ref" / "head" / "head.safetensors"))
    resumed = load_file(str(tmp_path / "int" / "head" / "head.safetensors"))
    assert ref_weights.keys() == resumed.keys()
    for name in ref_weights:
        assert torch.equal(ref_weights[name], resumed[name]), name


@pytest.mark.slow
def test_compiled_head_training_equals_eager_training(tiny_run):
    """training.compile (torch.compile of the EAGLE-3 midlayer): the same losses and trained weights as eager
    training to float rounding, and the saved head has the same tensor names (compiled in place, no wrapper)."""
    model_dir, write_recipe = tiny_run
    heads = {}
    for compiled in (False, True):
        out = model_dir.parent / f"out-{compiled}"
        recipe = write_recipe(head={"type": "eagle3", "ttt_steps": 2},
                              training={"max_steps": 3, "checkpoint_every": 10, "log_every": 1, "compile": compiled},
                              output={"dir": str(out)}, tracking={"backend": "none"})
        assert cli_main(["train", str(recipe), "--no-progress"]) == 0
        heads[compiled] = (load_file(out / "head" / "head.safetensors"),
                           json.loads((out / "train_summary.json").read_text()))
    (eager, eager_summary), (compiled, compiled_summary) = heads[False], heads[True]
    assert eager.keys() == compiled.keys()
    for name, weight in eager.items():
        torch.testing.assert_close(compiled[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    assert compiled_summary["tokens_seen"] == eager_summary["tokens_seen"]


@pytest.mark.parametrize(("family", "compiled"), [("eagle3", 1), ("eagle", 1), ("medusa", 0)])
def test_compile_for_training_compiles_the_draft_layers_in_place(family, compiled):
    from specgraft.heads import head_class
    from specgraft.target import Target

    target = Target(tiny_model("llama"))
    cls = head_class(family)
    head = cls.build(target, cls.Config().resolve(target))
    names = list(head.state_dict())
    assert head.compile_for_training() == compiled
    assert sum(m._compiled_call_impl is not None for m in head.modules()) == compiled
    assert list(head.state_dict()) == names  # in place: no wrapper prefix in the saved names
