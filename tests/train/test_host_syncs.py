"""Host syncs in the training hot loop: a fixed, small number per optimizer step, not one per micro-step.

On an accelerator every read of a tensor's value on the host (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``,
``.tolist()``) waits for the device to finish all queued work. The trainer keeps the non-finite-loss flag and the
token counts on the device and reads them once per optimizer step (the flag) or on log/checkpoint steps (tokens,
metrics). This test counts, with a ``TorchFunctionMode``, the reads made by specgraft's own code (torch's AdamW reads
its CPU step counters, which is no device sync) during each optimizer step of a short run with gradient
accumulation, for each head family trained by HeadTrainer. Negative control: a head whose loss reads one value
per micro-batch is caught (the count rises by the accumulation steps).

Not counted: boolean-mask row selection (``rows[mask]``), whose output shape depends on the data; the losses
project only the labelled rows onto the vocabulary, which is the point of selecting them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import specgraft

#: Tensor methods that read a value on the host.
HOST_READS = frozenset({torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
                        torch.Tensor.__index__, torch.Tensor.tolist})
SPECGRAFT_DIR = str(Path(specgraft.__file__).resolve().parent)
TORCH_DIR = str(Path(torch.__file__).resolve().parent)
#: Optimizer steps of each run and the micro-batches per step (syncs per micro-step would show as multiples).
STEPS, ACCUMULATION = 6, 3
#: Host reads per optimizer step that is neither logged nor checkpointed: the non-finite-loss flag, read once.
READS_PER_PLAIN_STEP = 1
HEAD_SECTIONS: dict[str, dict[str, Any]] = {
    "medusa": {"type": "medusa", "num_heads": 2},
    "eagle": {"type": "eagle"},
    "eagle3": {"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 96},  # reduced: counts need the target
}


class HostReadCounter(TorchFunctionMode):
    """Counts host reads whose caller (the first frame outside torch) is in one of ``roots`` (files or folders)."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        super().__init__()
        self.roots = roots
        self.count = 0
        self.where: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in HOST_READS:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(self.roots):
                self.count += 1
                self.where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


def rows() -> list[dict[str, list[int]]]:
    """Rows of unequal lengths (the collate pads them, so the attention masks hold padding)."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for length in (9, 17, 12, 20, 14, 11):
        ids = torch.randint(6, 262, (length,), generator=generator).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * length, "loss_mask": [0] * 3 + [1] * (length - 3)})
    return out


def reads_per_step(family: str, folder: Path, extra_read_in_loss: bool = False) -> tuple[list[int], list[str]]:
    """(specgraft's host reads during each optimizer step, where the first plain step's came from)."""
    import datasets

    from specgraft.config import Recipe, from_dict
    from specgraft.target import Target
    from specgraft.testing import tiny_model
    from specgraft.train.trainer import HeadTrainer

    corpus = folder / "corpus.txt"  # never read: the rows are given to the trainer
    corpus.write_text("unused\n")
    recipe = from_dict(Recipe, {
        "model": {"name_or_path": "tiny"},
        "data": {"path": str(corpus), "format": "text", "max_length": 32},
        "head": HEAD_SECTIONS[family],
        # Logged and checkpointed at the last step only: steps 2..STEPS-1 are plain.
        "training": {"max_steps": STEPS, "micro_batch_size": 2, "gradient_accumulation_steps": ACCUMULATION,
                     "log_every": 100, "checkpoint_every": 100, "seed": 1},
        "output": {"dir": str(folder / f"out-{family}-{extra_read_in_loss}"), "overwrite": True},
        "tracking": {"backend": "none"},
    })
    trainer = HeadTrainer(recipe, target=Target(tiny_model("llama")), dataset=datasets.Dataset.from_list(rows()),
                          show_progress=False)
    trainer.setup()
    # The negative control's read is made in this file, so that file is counted too.
    counter = HostReadCounter((SPECGRAFT_DIR, __file__) if extra_read_in_loss else (SPECGRAFT_DIR,))
    per_step: list[int] = []
    wheres: list[list[str]] = []
    seen = 0

    def after_step(_trainer: Any) -> None:
        nonlocal seen
        per_step.append(counter.count - seen)
        wheres.append(counter.where[seen:])
        seen = counter.count

    trainer.train_step.after_optimizer_step = after_step
    if extra_read_in_loss:  # negative control: one host read per micro-batch, as `if not torch.isfinite(loss)` was
        head = trainer.head
        plain_loss = head.training_loss

        def loss_with_a_read(*args: Any, **kwargs: Any) -> Any:
            result = plain_loss(*args, **kwargs)
            assert bool(torch.isfinite(result.loss))
            return result

        head.training_loss = loss_with_a_read
    try:
        with counter:
            trainer.train()
    finally:
        trainer.cleanup()
    return per_step, wheres[1]


@pytest.mark.parametrize("family", sorted(HEAD_SECTIONS))
def test_one_host_read_per_plain_optimizer_step(family, tmp_path):
    per_step, where = reads_per_step(family, tmp_path)
    assert len(per_step) == STEPS
    # Step 1 reads the token count once (the throughput starts after it); the last step logs and checkpoints.
    assert per_step[1:-1] == [READS_PER_PLAIN_STEP] * (STEPS - 2), where
    assert per_step[0] == READS_PER_PLAIN_STEP + 1
    assert per_step[-1] > READS_PER_PLAIN_STEP  # the log line reads the window's values


def test_counter_catches_a_read_per_micro_batch(tmp_path):
    per_step, where = reads_per_step("medusa", tmp_path, extra_read_in_loss=True)
    assert per_step[1:-1] == [READS_PER_PLAIN_STEP + ACCUMULATION] * (STEPS - 2), where
