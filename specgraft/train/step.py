"""What a training job trains: the :class:`TrainStep` protocol and the head-training step.

:class:`~specgraft.train.trainer.RecipeTrainer` is the one training loop (accelerate, data, AdamW + schedule,
checkpoints, exact resume, token weighting, logging). What it trains is a :class:`TrainStep` object, one per job,
given to it at construction:

* :meth:`~TrainStep.build` makes the *step module*: an ``nn.Module`` whose ``forward(batch, step, num_items=None)``
  returns a :class:`~specgraft.heads.base.HeadLoss` and which may have ``prepare(batch, step) -> (batch, counts)``
  (each loss term's item count, for the trainer's token weighting), plus its optimizer parameter groups;
* :meth:`~TrainStep.save` / :meth:`~TrainStep.load` write and read what a checkpoint and the final result hold;
* :meth:`~TrainStep.after_optimizer_step` (periodic work such as distillation's held-out alpha) and
  :meth:`~TrainStep.finalize` (measurements before the final save) are the only other calls.

:class:`HeadTrainStep` trains a registered head family (a family's own step, Medusa-2's joint LoRA step,
comes from its :attr:`~specgraft.heads.family.HeadFamily.train_step`, the post-training measurement from its
``train_metrics``); distillation's step is :class:`specgraft.distill.trainer.DistillTrainStep`.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from specgraft.config import Recipe
from specgraft.errors import SpecgraftError
from specgraft.heads.base import DraftHead, HeadLoss, head_class
from specgraft.heads.registry import get_family
from specgraft.target import Target, TargetOutput

if TYPE_CHECKING:  # annotations only
    from specgraft.train.trainer import RecipeTrainer

logger = logging.getLogger(__name__)

#: Parameter groups handed to AdamW: ``{"params": [...], "lr": float}``.
ParamGroups = list[dict[str, Any]]


class TrainStep(Protocol):
    """One job's training step (see the module docstring). ``trainer`` is the running
    :class:`~specgraft.train.trainer.RecipeTrainer` (its recipe, accelerator, target, datasets, ``data_facts``)."""

    label: str
    """Progress-bar label."""
    final_dir: str
    """Folder (inside output.dir) of the final result."""
    find_unused_parameters: bool
    """DDP setting for step modules with parameters unused in some steps (Medusa-2's adapter during warm-up)."""

    def check(self, trainer: RecipeTrainer) -> None:
        """Cheap checks before the target and the data are loaded."""

    def build(self, trainer: RecipeTrainer, target: Target) -> tuple[nn.Module, ParamGroups]:
        """(the step module, its optimizer parameter groups); may replace ``trainer.dataset`` (extra rows)."""

    def feature_layers(self) -> tuple[tuple[int, ...], bool] | None:
        """(target layers the step module reads, whether it needs the target's logits) for an offline feature
        cache; None when the step cannot train from cached features. Called after :meth:`build`."""

    def save(self, trainer: RecipeTrainer, folder: Path, extra: dict[str, Any] | None = None) -> None:
        """Write what is trained into ``folder`` (``extra`` is given for the final result only)."""

    def load(self, trainer: RecipeTrainer, folder: Path) -> None:
        """Load what :meth:`save` wrote (a checkpoint's ``model/``) into the built step module, exactly."""

    def after_optimizer_step(self, trainer: RecipeTrainer) -> None:
        """Called on every process after each optimizer step."""

    def finalize(self, trainer: RecipeTrainer) -> dict[str, Any]:
        """Last measurements before the final result is written; the facts returned go into the summary."""


class HeadTrainStep:
    """Train a draft head of a registered family (Medusa, EAGLE-1/2, EAGLE-3, DFlash; Medusa-2 with
    ``head.lora.enabled``) from a head-training recipe."""

    final_dir = "head"

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.label = f"train {recipe.head.type}"
        # Medusa-2's adapter is unused during the heads' warm-up: the head's config says when DDP must look for that.
        self.find_unused_parameters = bool(getattr(recipe.head, "find_unused_parameters", False))
        #: The head being trained and Medusa-2's peft-wrapped target (set by :meth:`build`).
        self.head: DraftHead | None = None
        self.peft_model: nn.Module | None = None

    def check(self, trainer: RecipeTrainer) -> None:
        """Nothing to check before loading: the recipe's head section was validated when it was read."""

    def build(self, trainer: RecipeTrainer, target: Target) -> tuple[nn.Module, ParamGroups]:
        r, tr = self.recipe, self.recipe.training
        config = r.head.resolve(target)
        init_from = getattr(config, "init_from", None)
        head = head_class(r.head.type).build(target, config)
        self.head = head
        counts, heldout = loss_token_counts(trainer.dataset, target.vocab_size,
                                            getattr(r.head, "draft_vocab_heldout_every", 0))
        facts: dict[str, Any] = {}
        if init_from:
            from specgraft.heads.base import warm_start

            facts = warm_start(head, init_from)
        # A warm-started head keeps its draft vocabulary (its output rows were trained for it): the facts then say
        # how well that vocabulary covers the new data.
        facts = {**(head.prepare_from_data(counts, heldout, keep_vocabulary=bool(init_from)) or {}), **facts}
        if head.wants_target_sample():
            hidden, mask = sample_hidden_states(trainer.dataset, target, head.required_layers())
            facts.update(head.prepare_from_target(hidden, mask, warm_started=bool(init_from)))
        trainer.data_facts.update(facts)
        for key, value in facts.items():
            logger.info("%s: %s", key, value)
        if tr.compile:
            compiled = head.compile_for_training()
            logger.info("training.compile: %d module(s) of the %s head compiled with torch.compile%s", compiled,
                        r.head.type, "" if compiled else " (none: its training cost is its matmuls)")
        groups: ParamGroups = head.optimizer_groups(tr.learning_rate)
        if not any(group["params"] for group in groups):
            raise SpecgraftError(f"the {r.head.type} head has no trainable parameters; check the head recipe")
        family = get_family(r.head.type)
        custom = family.train_step(head, target, r) if family.train_step is not None else None
        if custom is None:
            return HeadLossStep(head, target), groups
        step, self.peft_model = custom.step, custom.adapter
        lora_params = [p for p in self.peft_model.parameters() if p.requires_grad]
        groups.append({"params": lora_params, "lr": custom.adapter_learning_rate})
        return step, groups

    def feature_layers(self) -> tuple[tuple[int, ...], bool]:
        return tuple(self.head.required_layers()), type(self.head).needs_target_logits

    def save(self, trainer: RecipeTrainer, folder: Path, extra: dict[str, Any] | None = None) -> None:
        """The head (and Medusa-2's LoRA adapter, in ``adapter/``) into ``folder``."""
        from specgraft.heads.base import save_adapter

        self.head.save_pretrained(folder, recipe=self.recipe, extra=extra)
        if self.peft_model is not None:
            save_adapter(self.peft_model, folder)

    def load(self, trainer: RecipeTrainer, folder: Path) -> None:
        from specgraft.heads.base import load_adapter_state, load_head_weights

        load_head_weights(self.head, folder)
        if self.peft_model is not None:
            load_adapter_state(self.peft_model, folder)

    def after_optimizer_step(self, trainer: RecipeTrainer) -> None:
        """Head training has no periodic work between optimizer steps."""

    def finalize(self, trainer: RecipeTrainer) -> dict[str, Any]:
        """The family's ``train_metrics`` (Medusa: each head's top-k accuracy, for its static tree) on
        ``training.train_metrics_batches`` held-out batches, or training rows when there is no eval split."""
        hook = get_family(self.recipe.head.type).train_metrics
        if hook is None:
            return {}
        from specgraft.data.collate import pad_token_id

        held_out = trainer.eval_dataset
        source = held_out if held_out is not None and len(held_out) else trainer.dataset
        pad_id = pad_token_id(trainer.target.tokenizer)
        loader = DataLoader(source.with_format("torch") if hasattr(source, "with_format") else source,
                            batch_size=self.recipe.training.micro_batch_size,
                            collate_fn=lambda feats: collate_tokens(feats, pad_id))
        return hook(self.head, trainer.target, loader, max_batches=self.recipe.training.train_metrics_batches,
                    measured_on="held-out" if source is held_out else "training")


def loss_token_counts(dataset: Any, vocab_size: int, heldout_every: int = 0
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Counts [V] of the loss tokens in ``dataset`` without every ``heldout_every``-th row, and the counts [V] of
    those held-out rows (None when none is held out; see draft_vocab.heldout_rows)."""
    try:
        from specgraft.data import token_frequencies
    except ImportError:
        return None, None
    from specgraft.heads.draft_vocab import heldout_rows

    counted, held = heldout_rows(len(dataset), heldout_every)
    if not held:
        return token_frequencies(dataset, vocab_size, only_loss_tokens=True), None
    return (token_frequencies(dataset.select(counted), vocab_size, only_loss_tokens=True),
            token_frequencies(dataset.select(held), vocab_size, only_loss_tokens=True))


#: Training rows a head's :meth:`~DraftHead.prepare_from_target` sees (the first ones: every process the same).
TARGET_SAMPLE_ROWS = 8


@torch.no_grad()
def sample_hidden_states(dataset: Any, target: Target, layers: tuple[int, ...], rows: int = TARGET_SAMPLE_ROWS
                         ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The target's hidden states at ``layers`` ({layer: [B, T, h]}) on the first ``rows`` training rows, and
    their real-token mask [B, T]."""
    from specgraft.data.collate import pad_token_id

    count = min(rows, len(dataset))
    sample = dataset.select(range(count)) if hasattr(dataset, "select") else [dataset[i] for i in range(count)]
    batch = collate_tokens(list(sample), pad_token_id(target.tokenizer))
    input_ids = batch["input_ids"].to(target.device)
    attention_mask = batch["attention_mask"].to(target.device)
    out = target(input_ids, attention_mask, layers=tuple(layers), logits=False)
    return out.hidden_states, attention_mask


def collate_tokens(features: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    from specgraft.data import pad_collate

    # Cached-feature rows carry their features too; accuracy is measured from the target itself.
    return pad_collate([{k: v for k, v in f.items() if k != "features"} for f in features], pad_id)


class HeadLossStep(nn.Module):
    """One head training step (frozen target forward without grad, then the head's loss), routed through
    ``forward`` so DDP/DeepSpeed wrappers see every step."""

    def __init__(self, head: DraftHead, target: Target) -> None:
        super().__init__()
        self.head = head
        object.__setattr__(self, "_target", target)  # frozen and borrowed: never wrapped, never saved
        self.layers = head.required_layers()
        self.need_logits = type(head).needs_target_logits
        # (input_ids, target output) of batches prepare() ran the target on, in order, until their forward.
        self._kept_outputs: collections.deque[tuple[torch.Tensor, TargetOutput]] = collections.deque()

    @torch.no_grad()
    def _target_output(self, batch: dict[str, Any]) -> TargetOutput:
        if "features" in batch:  # offline: cached hidden states; logits recomputed with the frozen lm_head
            cached = batch["features"]
            logits = self._target.logits_from_hidden(cached[self._target.num_layers]) if self.need_logits else None
            return TargetOutput(logits=logits, hidden_states={i: cached[i] for i in self.layers})
        return self._target(batch["input_ids"], batch["attention_mask"], layers=self.layers,
                            logits=self.need_logits)

    def prepare(self, batch: dict[str, Any], step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """(the batch, the head's loss item counts). A head whose counts need the target's output (EAGLE-3 with a
        reduced draft vocab) gets it here; it is kept for this batch's :meth:`forward` (no second target pass),
        which costs the target outputs of one optimizer step's micro-batches in memory."""
        self.head.current_step = step
        if not self.head.loss_item_counts_need_target():
            return batch, self.head.loss_item_counts(batch)
        target_out = self._target_output(batch)
        self._kept_outputs.append((batch["input_ids"], target_out))
        return batch, self.head.loss_item_counts(batch, target_out)

    def forward(self, batch: dict[str, Any], step: int, num_items: dict[str, torch.Tensor] | None = None
                ) -> HeadLoss:
        self.head.current_step = step
        target_out = None
        if self._kept_outputs:
            ids, kept = self._kept_outputs.popleft()
            if ids is batch["input_ids"] or (ids.shape == batch["input_ids"].shape
                                             and torch.equal(ids, batch["input_ids"])):
                target_out = kept
            else:  # not the batch prepare() saw (prepare without forward): forget what was kept
                self._kept_outputs.clear()
        if target_out is None:
            target_out = self._target_output(batch)
        return self.head.training_loss(batch, target_out, num_items)
