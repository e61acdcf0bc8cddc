"""DistillTrainer end to end on tiny models: CLI, data sources, held-out alpha, best/, exact resume, bad input."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specgraft.cli import main as cli_main
from specgraft.config import load_recipe
from specgraft.data import pad_collate
from specgraft.distill.losses import distill_loss
from specgraft.distill.output import DRAFT_META
from specgraft.distill.trainer import DistillStep, DistillTrainer
from specgraft.heads.losses import masked_cross_entropy
from specgraft.target import Target
from specgraft.testing import TINY_CORPUS_TEXT, recipe_writer, run_torchrun, tiny_model, tiny_tokenizer
from specgraft.train.checkpoint import list_checkpoints, verify_checkpoint


@pytest.fixture
def tiny_run(tmp_path):
    """A saved tiny Llama target + tokenizer, a text corpus, a chat corpus, and a recipe writer."""
    model_dir = tmp_path / "target"
    tiny_model("llama", seed=1, initializer_range=0.2).save_pretrained(model_dir)  # peaked outputs
    tiny_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text(TINY_CORPUS_TEXT)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"count to {i}"},
                                                     {"role": "assistant", "content": f"1 2 3 {i}"}]}) + "\n"
                            for i in range(12)))

    write_recipe = recipe_writer(tmp_path, {
        "model": {"name_or_path": str(model_dir)},
        "data": {"path": str(text), "format": "text", "max_length": 48, "packing": True, "eval_fraction": 0.1,
                 "cache_dir": str(tmp_path / "cache"), "regenerate_max_new_tokens": 8},
        "distill": {"keep_every_k_layers": 2, "loss": "fkl", "alpha_eval_every": 4, "onpolicy_max_new_tokens": 8},
        "training": {"max_steps": 8, "micro_batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 0,
                     "lr_scheduler": "constant", "checkpoint_every": 4, "log_every": 2, "seed": 3},
        "output": {"dir": str(tmp_path / "out")},
        "tracking": {"backend": "tensorboard"},
    })
    return model_dir, write_recipe


def test_distill_cli_end_to_end(tiny_run, capsys):
    model_dir, write_recipe = tiny_run
    recipe = write_recipe(distill={"loss": "tvd", "lmbda": 0.5, "seq_kd": True})
    assert cli_main(["distill", str(recipe), "--no-progress"]) == 0
    out = Path(yaml.safe_load(recipe.read_text())["output"]["dir"])
    printed = capsys.readouterr().out
    assert "draft saved to" in printed and "best held-out alpha_exact" in printed

    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 8 and summary["seq_kd_rows"] > 0 and summary["student_origin"] == "target"
    assert 0 < summary["best_alpha_exact"] <= 1 and summary["best_step"] in (4, 8)
    assert [c.name for c in list_checkpoints(out)] == ["step-0000008", "step-0000004"]
    assert all(verify_checkpoint(c) is None for c in list_checkpoints(out))
    assert list(out.rglob("events.out.tfevents.*"))

    # draft/ and best/ are plain transformers folders recording the target they draft for.
    for name in ("draft", "best"):
        folder = out / name
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.num_hidden_layers == 2
        meta = json.loads((folder / DRAFT_META).read_text())
        assert meta["target"]["name_or_path"] == str(model_dir) and meta["distill"]["loss"] == "tvd"
        assert (folder / "README.md").is_file() and (folder / "tokenizer.json").is_file()
    best_meta = json.loads((out / "best" / DRAFT_META).read_text())
    assert best_meta["metrics"]["alpha_exact"] == pytest.approx(summary["best_alpha_exact"])


def test_distillation_raises_held_out_alpha(tiny_run):
    _, write_recipe = tiny_run
    recipe = load_recipe(write_recipe(training={"max_steps": 16}, distill={"alpha_eval_every": 16}),
                         ["tracking.backend=none"])
    trainer = DistillTrainer(recipe, show_progress=False)
    trainer.setup()
    try:
        before = trainer.evaluate_alpha()["alpha_exact"]
        summary = trainer.train()
    finally:
        trainer.cleanup()
    assert summary["best_alpha_exact"] > before + 0.02


@pytest.mark.parametrize("override,message", [
    ("distill.lmbda=1.5", "distill.lmbda must be in [0.0, 1.0], got 1.5"),
    ("distill.beta=-0.1", "distill.beta must be in [0.0, 1.0], got -0.1"),
    ("distill.loss=kld", "distill.loss must be one of fkl, rkl, jsd, tvd, ce, got 'kld'"),
    ("training.compile=true", "distillation does not compile its student: set training.compile=false"),
])
def test_bad_settings_are_one_line_cli_errors(tiny_run, capsys, override, message):
    _, write_recipe = tiny_run
    assert cli_main(["distill", str(write_recipe()), override, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_student_with_another_tokenizer_is_refused_by_the_cli(tiny_run, tmp_path, capsys):
    _, write_recipe = tiny_run
    student = tmp_path / "student"
    tiny_model("llama", num_hidden_layers=1).save_pretrained(student)
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tok.save_pretrained(student)
    capsys.readouterr()
    assert cli_main(["distill", str(write_recipe()), f"distill.student={student}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1  # refused before the target and data load
    assert "does not use the target's tokenizer (student vs target: 263 vs 262 tokens)" in err


def test_resume_with_on_policy_batches_is_bitwise_exact(tiny_run, tmp_path):
    _, write_recipe = tiny_run
    distill = {"loss": "jsd", "beta": 0.3, "lmbda": 0.5}
    straight = write_recipe("a.yaml", distill=distill, output={"dir": str(tmp_path / "a")})
    assert cli_main(["distill", str(straight), "--no-progress"]) == 0
    split = write_recipe("b.yaml", distill=distill, output={"dir": str(tmp_path / "b")})
    assert cli_main(["distill", str(split), "training.max_steps=4", "--no-progress"]) == 0
    assert cli_main(["distill", str(split), "--resume", "--no-progress"]) == 0

    ref = load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))
    got = load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    a = json.loads((tmp_path / "a" / "train_summary.json").read_text())
    b = json.loads((tmp_path / "b" / "train_summary.json").read_text())
    assert a["best_alpha_exact"] == b["best_alpha_exact"] and a["best_step"] == b["best_step"]


def test_conversations_with_seq_kd_and_on_policy(tiny_run, tmp_path):
    model_dir, write_recipe = tiny_run
    recipe = write_recipe(
        data={"path": str(tmp_path / "chat.jsonl"), "format": "messages", "packing": False, "max_length": 64,
              "eval_fraction": 0.0},
        distill={"seq_kd": True, "lmbda": 1.0, "loss": "ce"}, training={"max_steps": 4})
    assert cli_main(["distill", str(recipe), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["seq_kd_rows"] == 12 and summary["training_rows"] == 24
    assert (tmp_path / "cache" / "regenerated").is_dir()  # the data module's target rewrite was reused


def _step_fixture(lmbda: float):
    tok = tiny_tokenizer()
    target = Target(tiny_model("llama", seed=1), tok)
    student = tiny_model("llama", num_hidden_layers=1, seed=2).train()
    step = DistillStep(student, target, distill_loss("fkl"), lmbda=lmbda, max_new_tokens=6, pad_id=0,
                       stop_ids=(2,), seed=7)
    rows = [{"input_ids": [1, *range(40, 40 + n)], "loss_mask": [1] * (n + 1)} for n in (11, 9)]
    return step, target, student, pad_collate(rows, 0)


def test_on_policy_batches_label_only_the_students_tokens_and_are_reproducible():
    step, target, student, batch = _step_fixture(lmbda=1.0)
    rng = torch.get_rng_state()
    first = step(batch, step=3)
    assert torch.equal(torch.get_rng_state(), rng)  # sampling used its own seeded generator
    assert first.metrics["onpolicy"].item() == 1.0
    again = step(batch, step=3)
    assert again.loss.item() == first.loss.item()

    # Reference: rebuild the on-policy batch by hand and compute the loss on the continuation positions.
    from specgraft.distill.data import onpolicy_batch

    sampled = onpolicy_batch(student, batch, 6, 1.0, 0, (2,), step.batch_seed(batch, 3))
    lengths = batch["attention_mask"].sum(-1).tolist()
    for row, n in zip(range(2), lengths):
        prompt = max(-(-n // 2), n - 6)
        assert sampled["input_ids"][row, :prompt].tolist() == batch["input_ids"][row, :prompt].tolist()
        assert sampled["loss_mask"][row, :prompt].sum() == 0 and sampled["loss_mask"][row, prompt] == 1
    ids, att = sampled["input_ids"], sampled["attention_mask"]
    mask = (sampled["loss_mask"][:, 1:] * att[:, 1:]).bool()
    with torch.no_grad():
        want = distill_loss("fkl")(student(input_ids=ids, attention_mask=att).logits[:, :-1],
                                   target.model(input_ids=ids, attention_mask=att).logits[:, :-1], mask)
    assert first.loss.item() == pytest.approx(want.item(), rel=1e-6)


def test_off_policy_step_is_the_divergence_on_label_tokens():
    step, target, student, batch = _step_fixture(lmbda=0.0)
    result = step(batch, step=0)
    assert result.metrics["onpolicy"].item() == 0.0
    ids, att = batch["input_ids"], batch["attention_mask"]
    mask = (batch["loss_mask"][:, 1:] * att[:, 1:]).bool()
    with torch.no_grad():
        s = student(input_ids=ids, attention_mask=att).logits[:, :-1]
        t = target.model(input_ids=ids, attention_mask=att).logits[:, :-1]
    assert result.loss.item() == pytest.approx(distill_loss("fkl")(s, t, mask).item(), rel=1e-6)
    step.objective = "data_ce"
    assert step(batch, step=0).loss.item() == pytest.approx(masked_cross_entropy(s, ids[:, 1:], mask).item(),
                                                            rel=1e-6)


@pytest.mark.slow
def test_two_processes_train_and_save_once(tiny_run, tmp_path):
    _, write_recipe = tiny_run
    recipe = write_recipe(distill={"lmbda": 0.5, "loss": "tvd"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = run_torchrun(["-m", "specgraft.distill", str(recipe), "--no-progress"], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("draft saved to") == 1  # only the main process reports and writes
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 8 and 0 < summary["best_alpha_exact"] <= 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "draft")


def test_num_processes_hands_off_to_accelerate_launch(tiny_run, monkeypatch, capsys):
    _, write_recipe = tiny_run
    recipe = write_recipe()
    calls, envs = [], []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: calls.append(cmd) or envs.append(env) or 0)
    assert cli_main(["distill", str(recipe), "distill.loss=tvd", "--num-processes", "2", "--resume",
                     "--accelerate-config", "cfg.yaml"]) == 0
    (cmd,) = calls
    assert envs[0]["SPECGRAFT_LAUNCHED"] == "1"  # the processes run under the launcher's output-folder lock
    assert cmd[1:] == ["launch", "--config_file", "cfg.yaml", "--num_processes", "2", "-m", "specgraft.distill",
                       str(recipe), "distill.loss=tvd", "--resume"]
    # A bad recipe fails here, before any process starts.
    assert cli_main(["distill", str(recipe), "distill.lmbda=2", "--num-processes", "2"]) == 2
    assert len(calls) == 1
