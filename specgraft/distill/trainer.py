"""DistillTrainer: a standalone draft model trained on the target's outputs (DistillSpec / GKD), on the shared loop.

Everything of :class:`~specgraft.train.trainer.RecipeTrainer` carries over (accelerate single/multi-process and
DeepSpeed configs, trackers, progress, atomic checkpoints, exact resume, NaN guard): the loop runs the job's
:class:`DistillTrainStep` (it builds the student, writes draft folders, measures held-out alpha), whose step module
:class:`DistillStep` holds the student (trainable) and borrows the frozen target. Each micro-batch:

1. with probability ``distill.lmbda`` the batch is replaced by the student's own continuations of its prompts
   (on-policy, GKD); the draw and the sampling are seeded by (seed, step, process, batch content), so a resumed run
   repeats them exactly and the global RNG stream is untouched;
2. the target scores the sequence (no grad), the student runs on it, and the divergence ``distill.loss`` between
   their next-token distributions is averaged over the label tokens (assistant replies, text, or the generated
   continuation).

With ``distill.seq_kd`` the training rows also include target-generated ones (:mod:`specgraft.distill.data`).
Every ``distill.alpha_eval_every`` steps (and at the end) the held-out ``alpha_exact`` (mean over label positions of
sum_x min(p, q) at ``distill.temperature``) and greedy top-1 agreement are measured on the eval split (or a slice
of train when there is none), logged as ``eval/alpha_exact`` and ``eval/top1``, and the best student so far is
written atomically to ``best/``. The final student goes to ``draft/``; both are normal transformers folders
(:mod:`specgraft.distill.output`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn

from specgraft.config import DistillRecipe, to_dict
from specgraft.data.collate import pad_token_id
from specgraft.data.generate import ids_past_tokenizer
from specgraft.data.tokenize import stop_token_ids
from specgraft.distill import data as ddata
from specgraft.distill.losses import alpha_exact, distill_loss, top1_agreement
from specgraft.distill.output import DRAFT_META, save_draft
from specgraft.distill.student import Student, build_student, precheck_student_tokenizer
from specgraft.errors import ConfigError, SpecgraftError
from specgraft.heads.base import HeadLoss
from specgraft.heads.losses import divide_by_count, masked_cross_entropy
from specgraft.target import Target
from specgraft.train.trainer import RecipeTrainer

logger = logging.getLogger(__name__)

#: Folder (inside output.dir) of the best student by held-out alpha_exact.
BEST_DIR = "best"
#: Label positions per micro-batch that the logged training alpha/top-1 look at (vocab-sized float32 copies).
TRAIN_METRIC_POSITIONS = 2048
#: Key of the 0-dim on-policy flag in a batch that has had its on-policy draw (DistillStep.prepare).
ONPOLICY_KEY = "onpolicy"
#: Objectives: distillation against the target (the recipe's loss) or plain next-token CE on the data (baseline).
OBJECTIVE_DISTILL, OBJECTIVE_DATA_CE = "distill", "data_ce"


class DistillStep(nn.Module):
    """One distillation step: optional on-policy resampling, frozen target forward, student forward, divergence.

    Args:
        student: the trainable draft model.
        target: the frozen target (borrowed: never wrapped, never saved).
        loss_fn: ``fn(student_logits, teacher_logits, mask, temperature=...)`` from :mod:`specgraft.distill.losses`.
        temperature: applied to both distributions in the loss and the metrics; also the on-policy sampling
            temperature.
        lmbda: probability that a micro-batch is replaced by student samples.
        max_new_tokens: length of on-policy continuations.
        pad_id, stop_ids: padding id and tokens that end a continuation.
        suppress_tokens: ids on-policy sampling never emits (the student's output rows past the tokenizer).
        seed, process_index: seed the on-policy draws.
        objective: ``distill`` or ``data_ce`` (the baseline: CE on the data's own next tokens).
    """

    def __init__(self, student: nn.Module, target: Target, loss_fn: Any, *, temperature: float = 1.0,
                 lmbda: float = 0.0, max_new_tokens: int = 64, pad_id: int = 0, stop_ids: tuple[int, ...] = (),
                 seed: int = 0, process_index: int = 0, objective: str = OBJECTIVE_DISTILL,
                 suppress_tokens: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.student = student
        object.__setattr__(self, "_target", target)  # frozen and borrowed
        self.loss_fn = loss_fn
        self.temperature = float(temperature)
        self.lmbda = float(lmbda)
        self.max_new_tokens = int(max_new_tokens)
        self.pad_id = int(pad_id)
        self.stop_ids = tuple(int(s) for s in stop_ids)
        self.seed = int(seed)
        self.process_index = int(process_index)
        self.objective = objective
        self.suppress_tokens = tuple(suppress_tokens) if suppress_tokens else None

    def batch_seed(self, batch: dict[str, torch.Tensor], step: int) -> int:
        """A seed fixed by (seed, step, process, batch content): identical when a resumed run replays the batch."""
        content = hashlib.sha256(batch["input_ids"].detach().cpu().numpy().tobytes()).hexdigest()
        return ddata.derive_seed(self.seed, step, self.process_index, int(content[:15], 16))

    def _resample(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """The batch this step trains on: with probability ``lmbda`` the student's own continuations (on-policy),
        marked by an ``onpolicy`` flag (a 0-dim tensor) so that :meth:`forward` does not draw again."""
        onpolicy = False
        if self.lmbda > 0:
            seed = self.batch_seed(batch, step)
            draw = torch.rand((), generator=torch.Generator().manual_seed(seed)).item()
            if draw < self.lmbda:
                sampled = ddata.onpolicy_batch(self.student, batch, self.max_new_tokens, self.temperature,
                                               self.pad_id, self.stop_ids, seed, self.suppress_tokens)
                if sampled is not None:
                    batch, onpolicy = sampled, True
        return {**batch, ONPOLICY_KEY: torch.tensor(float(onpolicy), device=batch["input_ids"].device)}

    @staticmethod
    def _label_masks(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T-1] bool label positions (logits at t predict token t+1, so the mask shifts with the labels), and
        the first :data:`TRAIN_METRIC_POSITIONS` of them that the logged batch metrics read (full copies would
        double peak memory)."""
        mask = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).bool()  # [B, T-1]
        seen = (mask.flatten().cumsum(0) <= TRAIN_METRIC_POSITIONS).view_as(mask) & mask
        return mask, seen

    def prepare(self, batch: dict[str, torch.Tensor], step: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the batch to train on, after the on-policy draw; its loss items): ``labels`` (the divergence's
        positions), ``metric_positions`` (those the batch metrics read) and ``micro_batches`` (1, for the on-policy
        fraction)."""
        batch = self._resample(batch, step)
        mask, seen = self._label_masks(batch)
        return batch, {"labels": mask.sum(), "metric_positions": seen.sum(),
                       "micro_batches": torch.ones((), dtype=torch.long, device=mask.device)}

    def forward(self, batch: dict[str, torch.Tensor], step: int,
                num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        """The divergence (divided by ``num_items["labels"]`` when given, else by this batch's label count) and
        metrics divided likewise. A batch from :meth:`prepare` has had its on-policy draw; others draw here."""
        if ONPOLICY_KEY not in batch:
            batch = self._resample(batch, step)
        onpolicy = batch[ONPOLICY_KEY]
        ids, attention = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            teacher = self._target(ids, attention).logits[:, :-1]  # [B, T-1, V]
        student = self.student(input_ids=ids, attention_mask=attention).logits[:, :-1]  # [B, T-1, V]
        mask, seen = self._label_masks(batch)
        labels = None if num_items is None else num_items["labels"]
        if self.objective == OBJECTIVE_DATA_CE:
            loss = masked_cross_entropy(student, ids[:, 1:], mask, labels)
        else:
            loss = self.loss_fn(student, teacher, mask, temperature=self.temperature, num_items=labels)
        positions = None if num_items is None else num_items["metric_positions"]
        metrics = {
            "alpha": alpha_exact(teacher, student.detach(), seen, temperature=self.temperature, num_items=positions),
            "top1": top1_agreement(teacher, student.detach(), seen, num_items=positions),
            "onpolicy": onpolicy.float() if num_items is None else divide_by_count(onpolicy.float(),
                                                                                   num_items["micro_batches"]),
        }
        return HeadLoss(loss=loss, metrics=metrics)


class DistillTrainStep:
    """The distillation job's :class:`~specgraft.train.step.TrainStep`: builds the student and its
    :class:`DistillStep`, writes draft folders, measures held-out alpha_exact every ``distill.alpha_eval_every``
    steps and keeps the best student in ``best/``.

    Args:
        recipe: the distillation recipe.
        eval_dataset: held-out tokenised rows for alpha_exact when the trainer's dataset is given directly.
        objective: ``distill`` (default) or ``data_ce``: train on the data's next tokens with plain CE, ignoring
            the target (the baseline the benchmark compares against; alpha_exact is still measured).

    Attributes:
        best_alpha, best_step: the best held-out alpha_exact so far and its step (what ``best/`` holds).
        alpha_history: ``(step, alpha_exact, top1)`` of every evaluation of this process's run.
        eval_rows: the rows alpha_exact is measured on (set by :meth:`build`).
    """

    label = "distill"
    final_dir = "draft"
    find_unused_parameters = False

    def __init__(self, recipe: DistillRecipe, eval_dataset: Any = None, objective: str = OBJECTIVE_DISTILL) -> None:
        if objective not in (OBJECTIVE_DISTILL, OBJECTIVE_DATA_CE):
            raise SpecgraftError(f"unknown objective {objective!r}; use {OBJECTIVE_DISTILL} or {OBJECTIVE_DATA_CE}")
        self.recipe = recipe
        self.objective = objective
        self.given_eval = eval_dataset
        self.eval_rows: Any = None
        self.student_info: Student | None = None
        self.best_alpha: float | None = None
        self.best_step: int | None = None
        self.alpha_history: list[tuple[int, float, float]] = []

    def check(self, trainer: RecipeTrainer) -> None:
        """A student with another tokenizer fails before the target and the data are loaded."""
        if self.recipe.training.compile:
            raise ConfigError("training.compile compiles a draft head's layers; distillation does not compile its "
                              "student: set training.compile=false")
        if trainer.target is None:
            precheck_student_tokenizer(self.recipe.model, self.recipe.distill)

    def build(self, trainer: RecipeTrainer, target: Target) -> tuple[nn.Module, list[dict[str, Any]]]:
        r, d, tr = self.recipe, self.recipe.distill, self.recipe.training
        loss_fn = distill_loss(d.loss, d.beta)  # an unknown name fails here, before any work
        student = build_student(target, d)
        self.student_info = student
        tokenizer = target.tokenizer
        stop_ids = tuple(stop_token_ids(tokenizer, getattr(target.model, "generation_config", None),
                                        r.data.use_chat_template)) if tokenizer is not None else ()
        pad_id = pad_token_id(tokenizer, stop_ids)

        # Held-out rows for alpha_exact: the eval split, else a slice of train (taken before any seq_kd rows).
        rows = self.given_eval if self.given_eval is not None else trainer.eval_dataset
        if rows is None or len(rows) == 0:
            rows = trainer.dataset.select(range(min(d.alpha_eval_train_rows, len(trainer.dataset))))
            logger.info("no eval split: alpha_exact is measured on %d training rows", len(rows))
        elif len(rows) > d.alpha_eval_max_rows:
            rows = rows.select(range(d.alpha_eval_max_rows))
        self.eval_rows = rows

        if d.seq_kd:
            extra = ddata.seq_kd_dataset(r.data, target, trainer.dataset, stop_ids,
                                         batch_size=max(tr.micro_batch_size, ddata.SEQ_KD_BATCH_SIZE))
            if extra is not None and len(extra):
                columns = ["input_ids", "attention_mask", "loss_mask"]
                fixed = trainer.dataset.select_columns(columns).cast(extra.features)
                trainer.dataset = datasets.concatenate_datasets([fixed, extra.select_columns(columns)])
                logger.info("seq_kd: %d target-generated rows added to %d fixed rows", len(extra), len(fixed))
                trainer.data_facts["seq_kd_rows"] = len(extra)
        trainer.data_facts.update({
            "student_origin": student.origin,
            "student_parameters": student.num_parameters,
            "training_rows": len(trainer.dataset),
        })
        best_meta = trainer.output_dir / BEST_DIR / DRAFT_META
        if trainer.resume and best_meta.is_file():
            metrics = json.loads(best_meta.read_text(encoding="utf-8")).get("metrics", {})
            if metrics.get("alpha_exact") is not None:
                self.best_alpha, self.best_step = float(metrics["alpha_exact"]), metrics.get("step")
                self._record_best_facts(trainer)
        step = DistillStep(student.model, target, loss_fn, temperature=d.temperature, lmbda=d.lmbda,
                           max_new_tokens=d.onpolicy_max_new_tokens, pad_id=pad_id, stop_ids=stop_ids,
                           seed=tr.seed, process_index=trainer.accelerator.process_index, objective=self.objective,
                           suppress_tokens=ids_past_tokenizer(student.model, tokenizer))
        params = [p for p in student.model.parameters() if p.requires_grad]
        return step, [{"params": params, "lr": tr.learning_rate}]

    def feature_layers(self) -> None:
        """Distillation runs the student on tokens, not on cached target features."""
        return None

    @staticmethod
    def student(trainer: RecipeTrainer) -> nn.Module:
        """The student being trained (without its DDP/DeepSpeed wrapper)."""
        return trainer.unwrapped().student

    def save(self, trainer: RecipeTrainer, folder: Path, extra: dict[str, Any] | None = None) -> None:
        """The student as a draft folder. Checkpoints (no ``extra``) keep the training dtype (exact resume); the
        final draft is cast to the target's dtype, as served."""
        self._save_draft(trainer, folder, metrics=self._best_metrics(),
                         training=(extra or {}).get("training", {}), final=extra is not None)

    def _save_draft(self, trainer: RecipeTrainer, folder: Path, metrics: dict[str, Any],
                    training: dict[str, Any], final: bool) -> None:
        save_draft(
            folder, self.student(trainer), trainer.target.tokenizer, trainer.target.identity,
            student=self.student_info.describe() if self.student_info is not None else {},
            distill=to_dict(self.recipe.distill), metrics=metrics, training=training,
            dtype=trainer.target.dtype if final else None,
        )

    def load(self, trainer: RecipeTrainer, folder: Path) -> None:
        load_weights(self.student(trainer), folder)

    def after_optimizer_step(self, trainer: RecipeTrainer) -> None:
        d, tr = self.recipe.distill, self.recipe.training
        if trainer.step % d.alpha_eval_every == 0 or trainer.step == tr.max_steps:
            self.evaluate_and_keep_best(trainer)

    def finalize(self, trainer: RecipeTrainer) -> dict[str, Any]:
        """Nothing more to measure: the last held-out evaluation ran after the last step."""
        return {}

    # -- held-out alpha --------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_alpha(self, trainer: RecipeTrainer) -> dict[str, float]:
        """Held-out alpha_exact and top-1 agreement over label positions (every process scores its share)."""
        from specgraft.data import pad_collate

        acc, d = trainer.accelerator, self.recipe.distill
        student = self.student(trainer)
        was_training = student.training
        student.eval()
        rows = self.eval_rows
        mine = list(range(acc.process_index, len(rows), acc.num_processes))
        sums = torch.zeros(3, dtype=torch.float64, device=acc.device)  # alpha sum, top1 sum, positions
        pad_id = pad_token_id(trainer.target.tokenizer)
        batch_size = self.recipe.training.micro_batch_size
        try:
            for start in range(0, len(mine), batch_size):
                chunk = rows.select(mine[start: start + batch_size])
                batch = pad_collate([chunk[i] for i in range(len(chunk))], pad_id)
                ids = batch["input_ids"].to(acc.device)
                attention = batch["attention_mask"].to(acc.device)
                mask = (batch["loss_mask"][:, 1:].to(acc.device) * attention[:, 1:]).bool()
                n = int(mask.sum())
                if n == 0:
                    continue
                with acc.autocast():
                    q = student(input_ids=ids, attention_mask=attention).logits[:, :-1]
                    p = trainer.target(ids, attention).logits[:, :-1]
                sums[0] += float(alpha_exact(p, q, mask, temperature=d.temperature)) * n
                sums[1] += float(top1_agreement(p, q, mask)) * n
                sums[2] += n
        finally:
            student.train(was_training)
        sums = acc.reduce(sums, "sum")
        count = max(float(sums[2]), 1.0)
        return {"alpha_exact": float(sums[0]) / count, "top1": float(sums[1]) / count, "positions": float(sums[2])}

    def evaluate_and_keep_best(self, trainer: RecipeTrainer) -> dict[str, float]:
        """Evaluate, log ``eval/alpha_exact`` and ``eval/top1``, and write ``best/`` when alpha_exact improved."""
        acc = trainer.accelerator
        result = self.evaluate_alpha(trainer)
        self.alpha_history.append((trainer.step, result["alpha_exact"], result["top1"]))
        acc.log({"eval/alpha_exact": result["alpha_exact"], "eval/top1": result["top1"]}, step=trainer.step)
        logger.info("step %d: held-out alpha_exact %.4f, top-1 agreement %.4f", trainer.step, result["alpha_exact"],
                    result["top1"])
        trainer.data_facts["last_alpha_exact"] = result["alpha_exact"]
        trainer.data_facts["last_top1"] = result["top1"]
        if self.best_alpha is None or result["alpha_exact"] > self.best_alpha:
            self.best_alpha, self.best_step = result["alpha_exact"], trainer.step
            self._record_best_facts(trainer)
            if acc.is_main_process:
                self._save_draft(trainer, trainer.output_dir / BEST_DIR, metrics=self._best_metrics(), training={},
                                 final=True)
            acc.wait_for_everyone()
        return result

    def _best_metrics(self) -> dict[str, Any]:
        return {"alpha_exact": self.best_alpha, "step": self.best_step,
                "temperature": self.recipe.distill.temperature}

    def _record_best_facts(self, trainer: RecipeTrainer) -> None:
        trainer.data_facts["best_alpha_exact"] = self.best_alpha
        if self.best_step is not None:
            trainer.data_facts["best_step"] = int(self.best_step)


class DistillTrainer(RecipeTrainer):
    """:class:`~specgraft.train.trainer.RecipeTrainer` with a :class:`DistillTrainStep`: distil a standalone draft
    model from a recipe (see the module docstring).

    Args:
        recipe, resume, target, dataset, show_progress: as for :class:`~specgraft.train.trainer.RecipeTrainer`.
        eval_dataset, objective: as for :class:`DistillTrainStep`.
    """

    #: The recipe schema this trainer runs (the CLI reads recipes with it).
    recipe_schema = DistillRecipe
    #: The command whose output folders this trainer writes.
    command = "distill"

    def __init__(self, recipe: DistillRecipe, resume: bool = False, target: Target | None = None, dataset: Any = None,
                 show_progress: bool = True, eval_dataset: Any = None, objective: str = OBJECTIVE_DISTILL) -> None:
        super().__init__(recipe, DistillTrainStep(recipe, eval_dataset=eval_dataset, objective=objective),
                         resume=resume, target=target, dataset=dataset, show_progress=show_progress)

    @property
    def student(self) -> nn.Module:
        return self.train_step.student(self)

    @property
    def best_alpha(self) -> float | None:
        return self.train_step.best_alpha

    @property
    def alpha_history(self) -> list[tuple[int, float, float]]:
        return self.train_step.alpha_history

    def evaluate_alpha(self) -> dict[str, float]:
        """Held-out alpha_exact and top-1 agreement of the student now (see :meth:`DistillTrainStep.evaluate_alpha`)."""
        return self.train_step.evaluate_alpha(self)


def load_weights(model: nn.Module, folder: Path) -> None:
    """Load the ``*.safetensors`` of a saved model folder into ``model`` exactly (tied weights may be absent)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SpecgraftError(f"{folder} holds no .safetensors weights; the checkpoint is incomplete")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    result = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    # A key may be missing only when it shares storage with a loaded one (tied embeddings).
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
    if missing or result.unexpected_keys:
        raise SpecgraftError(f"the weights in {folder} do not match the student (missing {missing[:3]}, "
                             f"unexpected {list(result.unexpected_keys)[:3]}); resume with the original recipe")
