"""Token-weighted losses: one optimiser step does not depend on how its batch is split.

The same 8 rows (with different numbers of loss tokens) are trained for one optimiser step from the same
initialisation as (micro-batch 8, accumulation 1), (micro-batch 4, accumulation 2) and, in the slow test,
(2 processes x micro-batch 4). Every loss term is divided by its item count over the whole step (all micro-batches,
all processes), so the three runs make the same update, log the same loss and metrics, and match a direct
computation of the loss on the whole batch. Negative control: with the trainer's counting switched off (each
micro-batch takes its own token mean and accelerate averages those means, the behaviour before token weighting)
micro-batch 4 x accumulation 2 moves the parameters measurably differently from micro-batch 8.

Run as a script under torchrun (``python -m torch.distributed.run --nproc_per_node 2 <this file> FAMILY OUT MODE``,
MODE ``token-weighted`` or ``per-micro-batch``) it trains one step in each process and the main process saves the
trained parameters and logged values to OUT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from specgraft.testing import run_torchrun

#: Loss tokens per row (prompt tokens first, then labelled ones): deliberately unequal, so that a mean of
#: per-micro-batch means differs from the token mean of the batch.
ROW_SHAPES: tuple[tuple[int, int], ...] = ((3, 4), (5, 21), (2, 6), (7, 30), (4, 9), (2, 3), (6, 25), (3, 12))
#: Families trained through HeadTrainer (medusa2: Medusa heads + a LoRA adapter on the target; *_hass: the EAGLE heads
#: with HASS's alignment passes and top-K distillation term).
HEAD_FAMILIES = ("medusa", "eagle", "eagle3", "medusa2", "dflash", "eagle_hass", "eagle3_hass", "eagle3_aligned")
FAMILIES = (*HEAD_FAMILIES, "distill")
#: fp32 rounding of the same sums taken in another order (per micro-batch, per process).
TOLERANCE = 2e-6
#: The old per-micro-batch means must move the parameters by at least this much differently (far above rounding).
MIN_OLD_DIFFERENCE = 1e-4
#: Recipe sections of every run. adam_eps = 1 makes AdamW's first update ~ lr * g / (|g| + 1), i.e. it follows the
#: gradient's size instead of only its sign (with eps = 1e-8 the first step is ~ lr * sign(g) and hides a rescaled
#: gradient); no clipping or weight decay, so the parameters are a direct image of the gradient.
TRAINING = {"max_steps": 1, "learning_rate": 1.0, "warmup_steps": 0, "lr_scheduler": "constant", "adam_eps": 1.0,
            "weight_decay": 0.0, "max_grad_norm": 0.0, "checkpoint_every": 100, "log_every": 1, "seed": 5}
HEAD_SECTIONS: dict[str, dict[str, Any]] = {
    "medusa": {"head": {"type": "medusa", "num_heads": 2}},
    "eagle": {"head": {"type": "eagle", "feature_noise": 0.0}},  # noise draws would depend on the batch shape
    # A reduced draft vocabulary: the scored rows then depend on the target's top-1 too.
    "eagle3": {"head": {"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 96}},
    "medusa2": {"head": {"type": "medusa", "num_heads": 2},
                "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "head_warmup_steps": 0,
                         "target_modules": ["q_proj", "v_proj"], "learning_rate": 1.0}},
    # Anchors are drawn row by row in order, so the micro-batch split draws the same blocks.
    "dflash": {"head": {"type": "dflash", "block_size": 4, "max_anchors": 6}},
    "distill": {"distill": {"keep_every_k_layers": 2, "loss": "fkl", "alpha_eval_every": 100}},
    "eagle_hass": {"head": {"type": "eagle", "feature_noise": 0.0, "ttt_steps": 3, "hass_topk": 10}},
    "eagle3_hass": {"head": {"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 96, "hass_topk": 10}},
    # EAGLE-3's feature-alignment term (its own item counts: real tokens) and sharpened soft targets.
    "eagle3_aligned": {"head": {"type": "eagle3", "ttt_steps": 3, "draft_vocab_size": 96,
                                "feature_loss_weight": 1.0, "target_temperature": 0.5}},
}


def rows() -> list[dict[str, list[int]]]:
    """The 8 tokenised rows (ids of the tiny tokenizer's byte range; loss only on the second part)."""
    generator = torch.Generator().manual_seed(11)
    out = []
    for prompt, labelled in ROW_SHAPES:
        ids = torch.randint(6, 262, (prompt + labelled,), generator=generator).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": [0] * prompt + [1] * labelled})
    return out


def dataset():
    import datasets

    return datasets.Dataset.from_list(rows())


def make_recipe(family: str, folder: Path, micro_batch_size: int, accumulation: int) -> Any:
    from specgraft.config import DistillRecipe, Recipe, from_dict

    corpus = folder / "corpus.txt"  # never read: the rows are given to the trainer
    corpus.write_text("unused\n")
    sections = {
        "model": {"name_or_path": str(folder / "target")},
        "data": {"path": str(corpus), "format": "text", "max_length": 64},
        "training": {**TRAINING, "micro_batch_size": micro_batch_size, "gradient_accumulation_steps": accumulation},
        "output": {"dir": str(folder / f"out-{family}-{micro_batch_size}x{accumulation}-{os.getpid()}"),
                   "overwrite": True},
        "tracking": {"backend": "none"},
        **HEAD_SECTIONS[family],
    }
    return from_dict(DistillRecipe if family == "distill" else Recipe, sections)


def save_target(folder: Path) -> None:
    from specgraft.testing import tiny_model, tiny_tokenizer

    tiny_model("llama", seed=1, initializer_range=0.2).save_pretrained(folder / "target")
    tiny_tokenizer().save_pretrained(folder / "target")


def train_one_step(family: str, folder: Path, micro_batch_size: int, accumulation: int
                   ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(the trainable parameters after one optimiser step, the logged values of that step); the parameters before
    the step are in the logged values' ``initial`` entry."""
    from specgraft.distill.trainer import DistillTrainer
    from specgraft.target import load_target
    from specgraft.train.trainer import HeadTrainer

    recipe = make_recipe(family, folder, micro_batch_size, accumulation)
    target = load_target(folder / "target")  # fresh each run: Medusa-2 wraps the target's model with LoRA
    data = dataset()
    if family == "distill":
        trainer = DistillTrainer(recipe, target=target, dataset=data, eval_dataset=data, show_progress=False)
    else:
        trainer = HeadTrainer(recipe, target=target, dataset=data, show_progress=False)
    logged: dict[str, float] = {}
    trainer.setup()
    try:
        initial = {name: p.detach().clone() for name, p in trainer.unwrapped().named_parameters() if p.requires_grad}
        trainer.accelerator.log = lambda values, step=None: logged.update(values)
        trainer.train()
        params = {name: p.detach().clone() for name, p in trainer.unwrapped().named_parameters() if p.requires_grad}
    finally:
        trainer.cleanup()
    return params, {**logged, "initial": initial}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("token_weighting")
    save_target(path)
    return path


def _per_micro_batch_means(monkeypatch) -> None:
    """The behaviour before token weighting: no counts, so each micro-batch's loss is its own token mean."""
    from specgraft.train.trainer import RecipeTrainer

    monkeypatch.setattr(RecipeTrainer, "_prepare_step", lambda self, group: (group, None))


@pytest.mark.parametrize("family", FAMILIES)
def test_accumulation_is_the_same_step_as_one_big_micro_batch(family, folder, monkeypatch):
    whole, whole_logs = train_one_step(family, folder, 8, 1)
    split, split_logs = train_one_step(family, folder, 4, 2)
    initial = whole_logs.pop("initial")
    assert max_difference(split_logs.pop("initial"), initial) == 0  # the same initialisation
    assert max_difference(whole, initial) > 10 * MIN_OLD_DIFFERENCE  # the step moved the parameters
    new = max_difference(whole, split)
    # The logged loss and metrics are the batch's token means, whatever the split.
    assert whole_logs.keys() == split_logs.keys() and "loss" in whole_logs
    for key in whole_logs.keys() - {"lr", "tokens_per_s"}:
        assert split_logs[key] == pytest.approx(whole_logs[key], rel=1e-5, abs=1e-7), key

    _per_micro_batch_means(monkeypatch)
    old_whole, old_whole_logs = train_one_step(family, folder, 8, 1)
    old_split, old_split_logs = train_one_step(family, folder, 4, 2)
    assert max_difference(old_whole_logs.pop("initial"), initial) == 0
    old = max_difference(old_whole, old_split)
    print(f"{family}: max |(8 x 1) - (4 x 2)| parameter difference: token-weighted {new:.3g}, "
          f"per-micro-batch means {old:.3g}")
    assert new <= TOLERANCE, f"{family}: micro 4 x accumulation 2 differs from micro 8 by {new}"
    # With one micro-batch the two normalisations are the same formula: the change is invisible there ...
    assert max_difference(whole, old_whole) <= TOLERANCE
    assert old_whole_logs["loss"] == pytest.approx(whole_logs["loss"], rel=1e-6)
    # ... and the old per-micro-batch means made accumulation another optimisation (and another logged loss).
    assert old >= MIN_OLD_DIFFERENCE, f"{family}: the negative control moved only {old}"
    assert old_split_logs["loss"] != pytest.approx(whole_logs["loss"], rel=1e-6)


@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3", "eagle_hass", "eagle3_hass", "eagle3_aligned"])
def test_micro_batch_losses_with_global_counts_sum_to_the_whole_batch_loss(family, folder):
    """The head-level contract: training_loss(part, num_items=counts of the whole batch), summed over the parts,
    is training_loss(whole batch) (value and gradient); the per-part means are not."""
    from specgraft.data import pad_collate
    from specgraft.heads.base import head_class
    from specgraft.target import load_target

    target = load_target(folder / "target")
    recipe = make_recipe(family, folder, 8, 1)
    cls = head_class(recipe.head.type)
    torch.manual_seed(0)
    head = cls.build(target, recipe.head.resolve(target))
    layers, logits = head.required_layers(), type(head).needs_target_logits
    all_rows = rows()
    parts = [pad_collate(all_rows[:4], 0), pad_collate(all_rows[4:], 0)]
    whole = pad_collate(all_rows, 0)

    def loss_and_grads(batch, num_items=None):
        head.zero_grad(set_to_none=True)
        out = target(batch["input_ids"], batch["attention_mask"], layers=layers, logits=logits)
        loss = head.training_loss(batch, out, num_items).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    def counts(batch):
        out = target(batch["input_ids"], batch["attention_mask"], layers=layers, logits=logits)
        return head.loss_item_counts(batch, out if head.loss_item_counts_need_target() else None)

    whole_loss, whole_grads = loss_and_grads(whole)
    per_part = [counts(p) for p in parts]
    total_counts = {k: sum(c[k] for c in per_part) for k in per_part[0]}
    assert total_counts == {k: v for k, v in counts(whole).items()}
    weighted = [loss_and_grads(p, total_counts) for p in parts]
    torch.testing.assert_close(sum(w[0] for w in weighted), whole_loss, rtol=1e-5, atol=1e-7)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(sum(w[1][name] for w in weighted), grad, rtol=1e-4, atol=1e-7)
    # Negative control: the mean of the per-part means (the old accumulation) has another gradient.
    means = [loss_and_grads(p) for p in parts]
    scale = max(g.abs().max().item() for g in whole_grads.values())
    off = max((sum(m[1][n] for m in means) / 2 - g).abs().max().item() for n, g in whole_grads.items())
    print(f"{family}: max |gradient difference| / max |gradient|: token-weighted parts "
          f"{max((sum(w[1][n] for w in weighted) - g).abs().max().item() for n, g in whole_grads.items()) / scale:.3g}"
          f", mean of per-part means {off / scale:.3g}")
    assert off > 1e-2 * scale


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_processes_are_the_same_step_as_one_big_micro_batch(family, folder):
    def two_processes(mode: str) -> dict[str, Any]:
        out = folder / f"two-{family}-{mode}.pt"
        paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(paths)}
        run = run_torchrun([__file__, family, str(out), mode], env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        return torch.load(out)

    whole, whole_logs = train_one_step(family, folder, 8, 1)
    new = two_processes("token-weighted")
    difference = max_difference(whole, new["params"])
    assert new["logs"]["loss"] == pytest.approx(whole_logs["loss"], rel=1e-5)
    # Negative control: each process's own token mean, averaged by DDP (the behaviour before token weighting).
    old = max_difference(whole, two_processes("per-micro-batch")["params"])
    print(f"{family}: max |(1 process x 8) - (2 processes x 4)| parameter difference: token-weighted "
          f"{difference:.3g}, per-process means {old:.3g}")
    assert difference <= TOLERANCE
    assert old >= MIN_OLD_DIFFERENCE


def _worker(family: str, out: str, mode: str) -> None:
    """One process of the 2-process run (see the module docstring); ``mode`` ``per-micro-batch`` switches the
    token weighting off."""
    if mode == "per-micro-batch":
        from specgraft.train.trainer import RecipeTrainer

        RecipeTrainer._prepare_step = lambda self, group: (group, None)
    params, logs = train_one_step(family, Path(out).parent, 4, 1)
    logs.pop("initial")
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"params": params, "logs": logs}, out)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
