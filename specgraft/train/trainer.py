"""Head training on accelerate: one recipe class with a setup -> train -> cleanup lifecycle.

The same code runs single-process, under ``accelerate launch`` with several processes (DDP), and with a DeepSpeed
accelerate config. Each step the frozen target runs without grad (online features) and feeds the head; the head's
loss is computed on assistant tokens only. Checkpoints are atomic and resume exactly (optimizer, scheduler, RNG,
data position). Only the main process writes files.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs
from accelerate.utils import (
    DistributedType,
    GradientAccumulationPlugin,
    gather_object,
    parse_choice_from_env,
    set_seed,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from specgraft.config import DistillRecipe, Recipe, save_recipe, to_dict
from specgraft.data.collate import pad_token_id
from specgraft.errors import SpecgraftError
from specgraft.heads.base import RECIPE_NAME, DraftHead
from specgraft.heads.registry import family_names, get_family
from specgraft.target import Target, target_from_config
from specgraft.train import checkpoint as ckpt
from specgraft.train.step import HeadTrainStep, TrainStep
from specgraft.utils.io import CARRIED_OVER, atomic_write_json, folder_has_content
from specgraft.utils.outputs import check_output, mark_output, require_utf8_path

logger = logging.getLogger(__name__)

#: Inside a checkpoint: DeepSpeed's own engine checkpoint (partitioned optimizer state), when DeepSpeed is used.
DEEPSPEED_DIR = "deepspeed"

#: Recipe fields that may change between a run and its resumption without changing what is trained.
RESUMABLE_CHANGES = ("training.max_steps", "training.checkpoint_every", "training.keep_checkpoints",
                     "training.log_every", "training.eval_every", "training.compile", "output", "tracking",
                     "description")


#: Recipe fields added after checkpoints were first written, with the value every earlier run had implicitly: at
#: that value they are left out of the fingerprint, so a checkpoint written before the field existed still resumes.
FIELDS_ADDED_LATER = {"lora.learning_rate_divisor": 4.0, "training.train_metrics_batches": 16,
                      "distill.alpha_eval_train_rows": 32, "distill.alpha_eval_max_rows": 512,
                      "training.eval_batches": 8, "training.eval_prompts": 0, "training.eval_max_new_tokens": 32,
                      "training.eval_setting": None, "training.eval_best_by": "sim_tau",
                      "data.replay_path": None, "data.replay_share": 0.1, "head.lm_head_lr_scale": 1.0,
                      "head.feature_scaling": "none", "head.target_temperature": 1.0,
                      "head.feature_loss_weight": 0.0, "head.layer_init": "random"}

#: Inside output.dir: the head with the best held-out tau so far (``training.eval_every``).
BEST_DIR = "best"
#: Inside output.dir: one JSON line per held-out acceptance measurement.
METRICS_FILE = "metrics.jsonl"
_ALWAYS = object()  # drop(): remove the field whatever its value


def _hash_legacy_sections_where_they_were(recipe: Recipe, data: dict[str, Any]) -> None:
    """A family section that recipes once held at recipe level (Medusa-2's ``lora``, then in every head recipe at
    its defaults) is hashed where it was, so a checkpoint written before it moved into ``head:`` still resumes."""
    head = data["head"]
    for name in family_names():
        config = get_family(name).config
        for key in getattr(config, "legacy_recipe_sections", ()):
            if key in head and isinstance(recipe.head, config):
                data[key] = head.pop(key)
            elif key not in data:
                default = next(f for f in dataclasses.fields(config) if f.name == key)
                data[key] = to_dict(default.default_factory() if default.default is dataclasses.MISSING
                                    else default.default)


def recipe_fingerprint(recipe: Recipe | DistillRecipe) -> str:
    """Hash of the parts of a recipe that determine the training trajectory."""
    data = to_dict(recipe)
    if isinstance(recipe, Recipe):
        _hash_legacy_sections_where_they_were(recipe, data)

    def drop(dotted: str, when_equal_to: Any = _ALWAYS) -> None:
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and (when_equal_to is _ALWAYS or node[leaf] == when_equal_to):
            del node[leaf]

    for dotted in RESUMABLE_CHANGES:
        drop(dotted)
    for dotted, earlier_value in FIELDS_ADDED_LATER.items():
        drop(dotted, earlier_value)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


#: Tracking backend -> the packages accelerate's tracker needs (any one of them).
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}


def _require_tracker_package(tracker: str | None) -> None:
    """accelerate silently drops a tracker whose package is missing: the run would track nothing."""
    import importlib.util

    packages = TRACKER_PACKAGES.get(tracker or "", ())
    if packages and not any(importlib.util.find_spec(name) is not None for name in packages):
        raise SpecgraftError(f"tracking.backend is {tracker} but {' or '.join(packages)} is not installed; "
                             f"`pip install {packages[0]}` or set tracking.backend=none")


def _cpu_only_multiprocess() -> bool:
    has_accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not has_accelerator


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: accelerator memory on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def make_adamw(groups: list[dict[str, Any]], tr: Any) -> torch.optim.Optimizer:
    """AdamW with the fused kernel where torch has one for the parameters' device (same maths, fewer passes)."""
    kwargs = dict(lr=tr.learning_rate, betas=tuple(tr.adam_betas), eps=tr.adam_eps, weight_decay=tr.weight_decay)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, **kwargs)


class RecipeTrainer:
    """The one training loop (accelerate, data, AdamW + schedule, checkpoints, exact resume, logging); what it
    trains is the job's :class:`~specgraft.train.step.TrainStep` (head training: :class:`HeadTrainStep`;
    distillation: :class:`~specgraft.distill.trainer.DistillTrainStep`).

    Token weighting: an optimiser step is ``training.gradient_accumulation_steps`` micro-batches on each process
    (also across an epoch's end). When the step module has ``prepare(batch, step) -> (batch, counts)`` returning
    each loss term's item count (:meth:`~specgraft.heads.base.DraftHead.loss_item_counts`), all micro-batches of
    the step are prepared first, their counts are summed over the step and over processes, and every micro-batch's
    loss is divided by those global counts (TRL's ``num_items_in_batch``): the gradient is that of the token mean
    of the whole batch, so micro-batch 4 x accumulation 2 x 1 process, 8 x 1 x 1 and 4 x 1 x 2 are the same step.
    A module without counts gets today's per-micro-batch means averaged over micro-batches and processes.

    Usage (one lifecycle per job)::

        trainer = RecipeTrainer(recipe, HeadTrainStep(recipe))   # or HeadTrainer(recipe)
        trainer.setup()
        summary = trainer.train()
        trainer.cleanup()

    Args:
        recipe: the resolved recipe.
        train_step: what is trained (built, saved, loaded and finalised by it).
        resume: continue from the newest good checkpoint in ``recipe.output.dir``.
        target: an already loaded target (tests, demo); loaded from ``recipe.model`` when None.
        dataset: an already tokenised dataset with input_ids/attention_mask/loss_mask; built from
            ``recipe.data`` when None.
        show_progress: draw a progress bar on the main process.
        eval_dataset: held-out tokenised rows for ``training.eval_every`` when ``dataset`` is given (otherwise
            the eval split of ``recipe.data``).

    Acceptance during training (``training.eval_every``, head training): the main process measures the head's
    held-out simulated tau (and a decoder run, ``training.eval_prompts``; :mod:`specgraft.train.acceptance_eval`)
    while the others wait, logs it (tracker ``eval/...``, progress bar, ``metrics.jsonl``), keeps the best head in
    ``best/`` and records the best in every checkpoint, so a resumed run keeps the uninterrupted run's ``best/``.
    """

    def __init__(self, recipe: Recipe | DistillRecipe, train_step: TrainStep, resume: bool = False,
                 target: Target | None = None, dataset: Any = None, show_progress: bool = True,
                 eval_dataset: Any = None) -> None:
        self.recipe = recipe
        self.train_step = train_step
        self.final_dir = train_step.final_dir
        self.resume = resume
        self.target = target
        self.dataset = dataset
        #: Held-out rows of ``recipe.data`` (its eval split; None when the dataset was given or has none).
        self.eval_dataset: Any = eval_dataset
        #: The best held-out acceptance so far (``training.eval_every``): ``{"value", "step", "by"}``, or None.
        self.best_eval: dict[str, Any] | None = None
        #: Seconds this process spent in acceptance measurements (its share of the training time is reported).
        self.eval_seconds = 0.0
        self.show_progress = show_progress
        self.output_dir = Path(recipe.output.dir)
        self.fingerprint = recipe_fingerprint(recipe)
        self.step = 0
        self.micro_step = 0
        self.tokens_seen = 0
        self.accelerator: Accelerator | None = None
        # Made by setup(): the (accelerate-prepared) step module, optimizer, data loader and the hand-stepped
        # scheduler.
        self.step_module: torch.nn.Module | None = None
        self._bare_module: torch.nn.Module | None = None  # step_module without its wrapper (see unwrapped)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.loader: Any = None
        self.batches_per_epoch = 0
        #: Facts about the data and the model (logged, and copied into the summary).
        self.data_facts: dict[str, Any] = {}
        #: Whether the step module was found not to count its loss items (warned once; see _prepare_step).
        self.warned_no_item_counts = False

    def build_model(self, target: Target) -> tuple[torch.nn.Module, list[dict[str, Any]]]:
        """The job step's module and optimizer groups (what setup() trains; exposed for tests)."""
        return self.train_step.build(self, target)

    # -- setup -----------------------------------------------------------------------------------------------
    def setup(self) -> None:
        r = self.recipe
        tr = r.training
        self.train_step.check(self)
        self.check_output_dir()
        tracker = None if r.tracking.backend == "none" else r.tracking.backend
        _require_tracker_package(tracker)
        self.accelerator = Accelerator(
            # Without an accelerator, a multi-process (torchrun) job is CPU data parallel over gloo; accelerate
            # only detects it when told to use the CPU.
            cpu=_cpu_only_multiprocess(),
            # An optimiser step is always gradient_accumulation_steps micro-batches (a step may straddle an epoch's
            # end): the trainer gathers them before the first backward to count the step's loss items.
            # (accelerate launch's --gradient_accumulation_steps still wins over the recipe, as it always did.)
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=int(parse_choice_from_env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                                    tr.gradient_accumulation_steps)),
                sync_with_dataloader=False),
            mixed_precision=tr.mixed_precision,
            log_with=tracker,
            project_dir=str(self.output_dir),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            # Medusa-2's adapter is unused during the heads' warm-up.
            kwargs_handlers=[DistributedDataParallelKwargs(
                find_unused_parameters=self.train_step.find_unused_parameters)],
        )
        acc = self.accelerator
        set_seed(tr.seed)
        if self.target is None:
            self.target = target_from_config(r.model, device=acc.device)
        else:
            self.target.model.to(acc.device)
        target = self.target
        context = getattr(target.text_config, "max_position_embeddings", None)
        if isinstance(context, int) and r.data.max_length > context:
            raise SpecgraftError(f"data.max_length is {r.data.max_length} but the target {r.model.name_or_path} has "
                                 f"a context of {context} tokens; set data.max_length to at most {context}")
        if target.tokenizer is None and self.dataset is None:
            raise SpecgraftError("the target has no tokenizer, so the data cannot be tokenised; save the tokenizer "
                                 "beside the model")

        # Data: tokenised once (main process first so the cache is written once).
        if self.dataset is None:
            from specgraft.data import build_dataset
            from specgraft.data.readers import source_files

            if r.data.replay_path:  # checked before the main data is tokenised (or regenerated) for nothing
                source_files(r.data.replay_path, key="data.replay_path")

            # build_dataset coordinates processes itself; regeneration needs the target to generate with.
            splits = build_dataset(r.data, target.tokenizer, model=target.model if r.data.regenerate else None)
            self.dataset = splits["train"]
            self.eval_dataset = splits.get("eval") if hasattr(splits, "get") else None
            if r.data.replay_path:
                from specgraft.data.dataset import mix_replay

                replay_cfg = dataclasses.replace(r.data, path=r.data.replay_path, eval_fraction=0.0, replay_path=None)
                replay = build_dataset(replay_cfg, target.tokenizer,
                                       model=target.model if replay_cfg.regenerate else None)["train"]
                before = len(self.dataset)
                self.dataset = mix_replay(self.dataset, replay, r.data.replay_share, r.data.seed)
                self.data_facts.update({"replay_rows": len(self.dataset) - before, "new_rows": before})
                logger.info("data.replay_path: %d of %d training rows replayed from %s", len(self.dataset) - before,
                            len(self.dataset), r.data.replay_path)
        if len(self.dataset) == 0:
            raise SpecgraftError(f"the training data {r.data.path} is empty after filtering; check data.path and "
                                 "that conversations have assistant turns")
        self._check_acceptance_eval()

        step_module, groups = self.train_step.build(self, target)
        step_module.to(acc.device)
        collate = None
        if tr.features == "offline":
            collate = self._use_offline_features(target)
        optimizer = make_adamw(groups, tr)
        scheduler = get_scheduler(
            "constant_with_warmup" if tr.lr_scheduler == "constant" else tr.lr_scheduler,
            optimizer=optimizer, num_warmup_steps=tr.warmup_steps, num_training_steps=tr.max_steps,
        )
        from specgraft.data import pad_collate

        pad_id = pad_token_id(target.tokenizer)
        if collate is None:
            def collate(feats):
                return pad_collate(feats, pad_id)
        else:
            collate = functools.partial(collate, pad_token_id=pad_id)
        loader = DataLoader(self.dataset.with_format("torch") if hasattr(self.dataset, "with_format")
                            else self.dataset, batch_size=tr.micro_batch_size, shuffle=True,
                            collate_fn=collate, drop_last=False)
        # The scheduler is stepped by hand once per optimizer step (accelerate would step it once per process).
        self.scheduler = scheduler
        self.step_module, self.optimizer, self.loader = acc.prepare(step_module, optimizer, loader)
        # Unwrapped once: accelerate's unwrap_model looks up installed packages' metadata on every call, a cost
        # that is a sizeable share of a small head's step when paid twice per optimizer step.
        self._bare_module = acc.unwrap_model(self.step_module)
        self.batches_per_epoch = len(self.loader)

        if acc.is_main_process:
            mark_output(self.output_dir, self.command)
            save_recipe(r, self.output_dir / RECIPE_NAME)
            if not self.resume:  # a fresh run (output.overwrite): an earlier run's measurements are not this one's
                (self.output_dir / METRICS_FILE).unlink(missing_ok=True)
                if (self.output_dir / BEST_DIR).is_dir():
                    shutil.rmtree(self.output_dir / BEST_DIR)
        if tracker is not None:
            acc.init_trackers(r.tracking.project, config=_flatten(to_dict(r)),
                              init_kwargs={"wandb": {"name": r.tracking.run_name}} if tracker == "wandb" else {})
        if self.resume:
            self._load_latest_checkpoint()

    def check_output_dir(self) -> None:
        """Refuse output.dir unless it is new, empty, this recipe's run (--resume) or an earlier output of this
        command (output.overwrite); called before anything is loaded."""
        out = self.output_dir
        require_utf8_path(out, "output.dir")
        if self.resume:
            # Refuse a checkpoint of another recipe before loading anything heavy.
            folder = ckpt.latest_good_checkpoint(out)
            if folder is not None:
                state = json.loads((folder / ckpt.STATE).read_text(encoding="utf-8"))
                if state.get("recipe_fingerprint") != self.fingerprint:
                    raise SpecgraftError(
                        f"checkpoint {folder} was made by a different recipe (only max_steps, logging, "
                        "checkpointing and output may change on resume); resume with the original recipe or "
                        "start a new output.dir")
                done = int(state.get("step", 0))
                if self.recipe.training.max_steps < done:
                    raise SpecgraftError(
                        f"training.max_steps is {self.recipe.training.max_steps} but checkpoint {folder} is already "
                        f"at step {done}; resume with training.max_steps >= {done}, or export that checkpoint's run")
            return
        if out.exists() and not out.is_dir():
            raise SpecgraftError(f"output.dir {out} is a file; set output.dir to a folder (it is created)")
        if not folder_has_content(out):
            return
        if self.recipe.output.overwrite:
            # Only into an earlier output of this command, and never over an input.
            r = self.recipe
            inputs = [r.model.name_or_path, r.data.path, getattr(getattr(r, "distill", None), "student", None)]
            check_output(out, self.command, overwrite=True, inputs=inputs, flag="output.dir")
            return
        if self._only_leftovers_of_a_failed_start(out):
            logger.info("%s holds only the recipe of a run that stopped before its first checkpoint; starting afresh",
                        out)
            return
        raise SpecgraftError(f"output folder {out} is not empty; pass --resume to continue that run, "
                             "output.overwrite=true to write into it, or choose another output.dir")

    def _only_leftovers_of_a_failed_start(self, out: Path) -> bool:
        """True when ``out`` holds nothing but what a run that failed before its first checkpoint wrote (the
        resolved recipe and the tracker's log folder): nothing to resume, so the plain rerun may start over."""
        allowed = {RECIPE_NAME, self.recipe.tracking.project, *CARRIED_OVER}
        if not ckpt.list_checkpoints(out):
            allowed.add(ckpt.CHECKPOINTS_DIR)  # created before a first checkpoint that was never completed
        if any(p.name not in allowed for p in out.iterdir()) or not (out / RECIPE_NAME).is_file():
            return False
        from specgraft.config import load_recipe

        try:
            written = load_recipe(out / RECIPE_NAME, schema=type(self.recipe))
        except SpecgraftError:
            return False  # not a recipe we wrote: the user's file, keep refusing
        return Path(written.output.dir).resolve() == out.resolve()

    def _use_offline_features(self, target: Target):
        """Build (main process, resumable) or open the feature cache and train from it."""
        from specgraft.train.features import (
            CachedFeatureDataset,
            build_feature_cache,
            cache_layers,
            open_feature_cache,
        )

        tr = self.recipe.training
        wanted = self.train_step.feature_layers()
        if wanted is None:
            raise SpecgraftError(f"{type(self).__name__} does not support training.features=offline; use online")
        layers, needs_logits = wanted
        stored = cache_layers(layers, needs_logits, target.num_layers)
        cache_dir = Path(tr.feature_cache_dir or self.output_dir / "features")
        with self.accelerator.main_process_first():
            if self.accelerator.is_main_process:
                build_feature_cache(target, self.dataset, cache_dir, stored, dtype=tr.feature_dtype,
                                    show_progress=self.show_progress, vq_bits=tr.feature_vq_bits)
            cache = open_feature_cache(cache_dir, target, stored, dtype=tr.feature_dtype, vq_bits=tr.feature_vq_bits)
        info = cache.info
        self.data_facts.update({"feature_cache_bytes": info.bytes,
                                "feature_cache_bytes_per_token": round(info.bytes_per_token, 2),
                                "feature_cache_payload_bytes_per_token": info.payload_bytes_per_token,
                                "feature_cache_dtype": info.dtype,
                                "eagle1_fp16_bytes_per_token": info.eagle1_bytes_per_token})
        logger.info("training from the feature cache %s (%.1f B/token vs EAGLE-1's %d)", cache_dir,
                    info.bytes_per_token, info.eagle1_bytes_per_token)
        self.dataset = CachedFeatureDataset(self.dataset, cache)
        return cache.collate

    # -- checkpoints -----------------------------------------------------------------------------------------
    def unwrapped_head(self) -> DraftHead | None:
        """The head being trained, if the trained module has one."""
        return getattr(self.unwrapped(), "head", None)

    def unwrapped(self) -> torch.nn.Module:
        """The step module without its DDP/DeepSpeed wrapper."""
        if self._bare_module is None:
            return self.accelerator.unwrap_model(self.step_module)
        return self._bare_module

    @property
    def uses_deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    def save_checkpoint(self) -> Path | None:
        acc = self.accelerator
        rng_states = gather_object([ckpt.capture_rng_state()])  # every rank's RNG, written by rank 0
        staging = None
        if self.uses_deepspeed:
            # DeepSpeed's partitioned optimizer state is saved collectively in its own format; it is moved into
            # the checkpoint (and covered by its manifest) below.
            staging = self.output_dir / ckpt.CHECKPOINTS_DIR / f".deepspeed-staging-{self.step}"
            acc.save_state(str(staging))
            acc.wait_for_everyone()
        if not acc.is_main_process:
            acc.wait_for_everyone()
            return None

        def write_payload(folder: Path) -> None:
            self.train_step.save(self, folder / "model")
            if staging is not None:
                os.replace(staging, folder / DEEPSPEED_DIR)
        state = {
            "step": self.step,
            "micro_step": self.micro_step,
            "tokens_seen": self.tokens_seen,
            "recipe_fingerprint": self.fingerprint,
            "scheduler": _jsonable(self.scheduler.state_dict()),
            "rng": rng_states,
            "num_processes": acc.num_processes,
            "best_eval": self.best_eval,
        }
        path = ckpt.save_checkpoint(
            self.output_dir, self.step,
            write_payload=write_payload,
            optimizer_state={"state": {}, "param_groups": []} if staging else self.optimizer.state_dict(),
            trainer_state=state,
            keep=self.recipe.training.keep_checkpoints,
        )
        acc.wait_for_everyone()
        return path

    def _load_latest_checkpoint(self) -> None:
        folder = ckpt.latest_good_checkpoint(self.output_dir)
        if folder is None:
            logger.info("no checkpoint in %s: starting from scratch", self.output_dir)
            if self.accelerator.is_main_process:
                self._drop_metrics_after(0)
            return
        state, optimizer_state = ckpt.load_checkpoint_state(folder)
        if self.uses_deepspeed:
            if not (folder / DEEPSPEED_DIR).is_dir():
                raise SpecgraftError(f"checkpoint {folder} was not written by a DeepSpeed run; resume it with the "
                                     "accelerate config it was trained with")
            self.accelerator.load_state(str(folder / DEEPSPEED_DIR))
        if state.get("num_processes") != self.accelerator.num_processes:
            logger.warning("resuming a %s-process run with %s processes: the data order changes",
                           state.get("num_processes"), self.accelerator.num_processes)
        self.train_step.load(self, folder / "model")
        if not self.uses_deepspeed:
            self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.micro_step = int(state["micro_step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.best_eval = state.get("best_eval")
        if self.accelerator.is_main_process:
            self._drop_metrics_after(self.step)
        rng = state["rng"]
        ckpt.restore_rng_state(rng[min(self.accelerator.process_index, len(rng) - 1)])
        logger.info("resumed from %s (step %d)", folder, self.step)

    # -- training --------------------------------------------------------------------------------------------
    def _batches(self):
        """Micro-batches from the current data position on, epoch after epoch (deterministic order)."""
        epoch, offset = divmod(self.micro_step, self.batches_per_epoch)
        while True:
            self.loader.set_epoch(epoch)
            loader = self.accelerator.skip_first_batches(self.loader, offset) if offset else self.loader
            yield from loader
            epoch, offset = epoch + 1, 0

    def train(self) -> dict[str, Any]:
        """Run until ``training.max_steps`` optimizer steps; returns a summary (also saved as JSON)."""
        acc, tr = self.accelerator, self.recipe.training
        step_module = self.step_module
        step_module.train()
        bar = tqdm(total=tr.max_steps, initial=self.step, desc=self.train_step.label, unit="step",
                   disable=not (self.show_progress and acc.is_local_main_process), dynamic_ncols=True)
        # Per optimizer step of the current log window: key -> this process's value (see _reduce_window).
        window: list[dict[str, torch.Tensor]] = []
        # Device tensors until they are read (log lines, checkpoints, the end): no host sync per micro-step.
        # step_tokens: this process's tokens in the current optimizer step; unread_tokens: all processes' tokens
        # not yet added to self.tokens_seen; log_tokens: all processes' tokens since the last log line.
        step_tokens = torch.zeros((), dtype=torch.long, device=acc.device)
        unread_tokens = torch.zeros((), dtype=torch.long, device=acc.device)
        log_tokens, window_start = 0, time.perf_counter()
        start_tokens, start_time = self.tokens_seen, time.perf_counter()
        last_good = None
        steady_start, steady_tokens = None, 0
        batches = self._batches()

        def read_tokens() -> int:
            """Add the unread token count to tokens_seen (one host sync); returns it."""
            nonlocal unread_tokens
            count = int(unread_tokens)
            self.tokens_seen += count
            unread_tokens = torch.zeros_like(unread_tokens)
            return count

        while self.step < tr.max_steps:
            group = [next(batches) for _ in range(acc.gradient_accumulation_steps)]
            group, num_items = self._prepare_step(group)
            # With global counts each micro-batch's loss is its share of the batch's token mean: undo accelerate's
            # division by the accumulation steps and DDP's (and DeepSpeed's) average over processes.
            loss_scale = acc.gradient_accumulation_steps * acc.num_processes if num_items is not None else 1
            head = self.unwrapped_head()
            if head is not None:
                # Accuracy metrics only on steps that are logged (the loss is logged as a window average).
                next_step = self.step + 1
                head.metrics_enabled = next_step % tr.log_every == 0 or next_step == tr.max_steps
            micro_values: dict[str, list[torch.Tensor]] = {}
            # Whether a micro-batch's loss of this optimizer step was inf/NaN, kept on the device and read once,
            # before the step's last backward: no parameter (hence no checkpoint) ever takes a non-finite update.
            non_finite = torch.zeros((), dtype=torch.bool, device=acc.device)
            for batch in group:
                self.micro_step += 1
                with acc.accumulate(step_module):
                    with acc.autocast():
                        if num_items is None:
                            result = step_module(batch, self.step)
                        else:
                            result = step_module(batch, self.step, num_items=num_items)
                    loss = result.loss
                    micro_values.setdefault("loss", []).append(loss.detach())
                    non_finite |= ~torch.isfinite(loss.detach())
                    if acc.sync_gradients and bool(non_finite):
                        bad = next(v for v in micro_values["loss"] if not torch.isfinite(v))
                        raise SpecgraftError(
                            f"the loss became {bad.item()} at step {self.step + 1}; the last good checkpoint is "
                            f"{last_good or 'none (no checkpoint written yet)'}; lower training.learning_rate or "
                            "check the data")
                    acc.backward(loss * loss_scale if loss_scale != 1 else loss)
                    if acc.sync_gradients and tr.max_grad_norm > 0:
                        acc.clip_grad_norm_(step_module.parameters(), tr.max_grad_norm)
                    self.optimizer.step()
                    if acc.sync_gradients:
                        self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                step_tokens += batch["attention_mask"].sum()
                for key, value in result.metrics.items():
                    micro_values.setdefault(key, []).append(value.detach())
            # Token-weighted values are shares of the step's global value (summed); per-micro means are averaged.
            window.append({k: torch.stack(v).float().sum() if num_items is not None else torch.stack(v).float().mean()
                           for k, v in micro_values.items()})
            self.step += 1
            unread_tokens += acc.reduce(step_tokens, "sum")
            step_tokens = torch.zeros_like(step_tokens)
            if steady_start is None:  # throughput after the first (warm-up) step
                log_tokens += read_tokens()
                steady_start, steady_tokens = time.perf_counter(), self.tokens_seen
            bar.update(1)
            if self.step % tr.log_every == 0 or self.step == tr.max_steps:
                log_tokens += read_tokens()
                logs = self._reduce_window(window, token_weighted=num_items is not None)
                elapsed = time.perf_counter() - window_start
                logs["lr"] = self.scheduler.get_last_lr()[0]
                logs["tokens_per_s"] = log_tokens / max(elapsed, 1e-9)
                acc.log(logs, step=self.step)
                bar.set_postfix(loss=f"{logs['loss']:.3f}", tok_s=f"{logs['tokens_per_s']:.0f}")
                window, window_start, log_tokens = [], time.perf_counter(), 0
            self.train_step.after_optimizer_step(self)
            if tr.eval_every and (self.step % tr.eval_every == 0 or self.step == tr.max_steps):
                record = self.evaluate_acceptance(started_at=start_time)
                if record is not None:
                    bar.set_postfix(tau=f"{record['sim_tau']:.3f}", best=f"{self.best_eval['value']:.3f}")
            if self.step % tr.checkpoint_every == 0 or self.step == tr.max_steps:
                log_tokens += read_tokens()  # the checkpoint records tokens_seen
                last_good = self.save_checkpoint() or last_good
        bar.close()
        elapsed = time.perf_counter() - start_time
        summary = {
            "steps": self.step,
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": (self.tokens_seen - start_tokens) / max(elapsed, 1e-9),
            "steady_tokens_per_s": ((self.tokens_seen - steady_tokens) / max(time.perf_counter() - steady_start, 1e-9)
                                    if steady_start is not None else 0.0),
            "peak_memory_bytes": peak_memory_bytes(acc.device),
            "num_processes": acc.num_processes,
            **{k: v for k, v in self.data_facts.items() if isinstance(v, (int, float, str))},
        }
        if tr.eval_every:
            summary["eval_time_fraction"] = self.eval_seconds / max(elapsed, 1e-9)
            if self.best_eval is not None:
                summary.update({"best_eval_step": self.best_eval["step"], f"best_{self.best_eval['by']}":
                                self.best_eval["value"]})
        summary.update(self.train_step.finalize(self))
        self.save_final(summary)
        return summary

    # -- acceptance during training ----------------------------------------------------------------------------
    def _check_acceptance_eval(self) -> None:
        """``training.eval_every`` needs a head whose family measures simulated acceptance, and held-out rows."""
        if not self.recipe.training.eval_every:
            return
        if not isinstance(self.recipe, Recipe):
            raise SpecgraftError("training.eval_every measures a draft head's tau; distillation measures its held-out "
                                 "alpha every distill.alpha_eval_every steps: set training.eval_every=0")
        head_type = self.recipe.head.type
        family = get_family(head_type)
        if (family.head.acceptance_ranks is DraftHead.acceptance_ranks
                or family.search is None or not family.search.simulates_acceptance):
            raise SpecgraftError(f"the {head_type} family does not measure held-out acceptance during training; set "
                                 "training.eval_every=0 and evaluate the result with `specgraft eval`")
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            raise SpecgraftError("training.eval_every measures acceptance on held-out rows but the data has none; set "
                                 "data.eval_fraction (e.g. 0.02) or training.eval_every=0")

    def evaluate_acceptance(self, started_at: float) -> dict[str, Any] | None:
        """Measure the head's held-out acceptance on the main process (the others wait), log it, keep ``best/``;
        returns the record (None on the other processes). The RNG state is restored afterwards, so measuring
        does not change the training trajectory. ``started_at``: ``time.perf_counter()`` when this process began
        training (``eval_time_fraction`` is the share of the time since then spent measuring)."""
        acc = self.accelerator
        started = time.perf_counter()
        record = None
        if acc.is_main_process:
            rng = ckpt.capture_rng_state()
            try:
                record = self._measure_acceptance()
            finally:
                ckpt.restore_rng_state(rng)
        acc.wait_for_everyone()
        seconds = time.perf_counter() - started
        self.eval_seconds += seconds
        if record is None:
            return None
        by = self.recipe.training.eval_best_by
        value = record[by]
        if value == value and (self.best_eval is None or value > self.best_eval["value"]):  # NaN never wins
            self.best_eval = {"value": value, "step": self.step, "by": by}
            self.train_step.save(self, self.output_dir / BEST_DIR, extra={"training": {"step": self.step,
                                                                                        "eval": record}})
        record.update({"eval_s": seconds,
                       "eval_time_fraction": self.eval_seconds / max(time.perf_counter() - started_at, 1e-9),
                       "best_step": self.best_eval["step"] if self.best_eval else None})
        acc.log({f"eval/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                step=self.step)
        with open(self.output_dir / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        logger.info("step %d: held-out simulated tau %.3f%s (measured in %.1f s)", self.step, record["sim_tau"],
                    f", decoder tau {record['decoder_tau']:.3f} ({record['decoder_identical']}/"
                    f"{record['decoder_prompts']} token-identical)" if "decoder_tau" in record else "", seconds)
        return record

    def _measure_acceptance(self) -> dict[str, Any]:
        from specgraft.train.acceptance_eval import (
            collect_rank_statistics,
            decoder_tau,
            prompt_ids,
            served_setting,
            setting_widths,
            simulated_tau,
        )
        from specgraft.train.step import collate_tokens

        tr, head, target = self.recipe.training, self.train_step.head, self.target
        setting = served_setting(head, tr.eval_setting)
        rows = self.eval_dataset
        pad_id = pad_token_id(target.tokenizer)
        loader = DataLoader(rows.with_format("torch") if hasattr(rows, "with_format") else rows,
                            batch_size=tr.micro_batch_size, collate_fn=functools.partial(collate_tokens, pad_id=pad_id))
        statistics = collect_rank_statistics(head, target, loader, setting_widths(setting), tr.eval_batches)
        record: dict[str, Any] = {"step": self.step, "setting": setting, **simulated_tau(head, setting, statistics)}
        if tr.eval_prompts:
            prompts = [prompt_ids(rows[i]) for i in range(min(tr.eval_prompts, len(rows)))]
            record.update(decoder_tau(head, target, setting, prompts, tr.eval_max_new_tokens))
        return record

    def _drop_metrics_after(self, step: int) -> None:
        """Forget measurements a killed run made after the checkpoint it resumes from (they are made again)."""
        path = self.output_dir / METRICS_FILE
        if not path.is_file():
            return
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            from specgraft.utils.io import atomic_write_text

            atomic_write_text(path, "".join(line + "\n" for line in kept))

    def _prepare_step(self, group: list[dict[str, Any]]
                      ) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor] | None]:
        """(the step's micro-batches as the step module prepared them, each loss term's item count summed over them
        and over processes), or (the batches, None) when the step module does not count its loss items."""
        acc = self.accelerator
        module = self.unwrapped()
        prepare = getattr(module, "prepare", None)
        if prepare is None:
            return group, None
        prepared, counts = [], []
        with torch.no_grad(), acc.autocast():
            for batch in group:
                batch, batch_counts = prepare(batch, self.step)
                prepared.append(batch)
                counts.append(batch_counts)
        if any(c is None for c in counts):
            if not self.warned_no_item_counts:
                logger.warning("%s does not count its loss items: each micro-batch takes its own token mean, so "
                               "the result depends on the micro-batch size", type(module).__name__)
                self.warned_no_item_counts = True
            return prepared, None
        terms = sorted(counts[0])
        local = torch.stack([torch.stack([torch.as_tensor(c[t], device=acc.device).long() for t in terms])
                             for c in counts]).sum(0)  # [terms]
        total = acc.reduce(local, "sum")
        return prepared, dict(zip(terms, total.unbind()))

    def _reduce_window(self, window: list[dict[str, torch.Tensor]], token_weighted: bool) -> dict[str, float]:
        """The logged value of every key: per optimizer step, the sum over processes of their token-weighted shares
        (the step's global value), or the mean over processes of per-micro-batch means; then the mean over the
        window's steps that have the key (accuracy metrics exist only on logged steps)."""
        acc = self.accelerator
        keys = sorted({k for values in window for k in values})
        if acc.num_processes > 1:  # a key may be missing on one process (e.g. an empty batch has no metrics)
            keys = sorted({k for part in gather_object([keys]) for k in part})
        values = torch.zeros(len(window), len(keys), dtype=torch.float64)
        present = torch.zeros_like(values)
        for i, step_values in enumerate(window):
            for j, key in enumerate(keys):
                if key in step_values:
                    values[i, j], present[i, j] = float(step_values[key]), 1.0
        values = acc.reduce(values.to(acc.device), "sum").cpu()
        present = acc.reduce(present.to(acc.device), "sum").cpu()
        if not token_weighted:
            values = values / present.clamp_min(1.0)
        has_key = (present > 0).to(values.dtype)
        means = (values * has_key).sum(0) / has_key.sum(0).clamp_min(1.0)
        return {key: float(mean) for key, mean in zip(keys, means)}

    def save_final(self, summary: dict[str, Any]) -> None:
        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            self.train_step.save(self, self.output_dir / self.final_dir, extra={"training": summary})
            atomic_write_json(self.output_dir / "train_summary.json", summary)
            logger.info("saved the result to %s", self.output_dir / self.final_dir)
        acc.wait_for_everyone()

    def cleanup(self) -> None:
        if self.accelerator is not None:
            self.accelerator.end_training()


class HeadTrainer(RecipeTrainer):
    """:class:`RecipeTrainer` with a :class:`~specgraft.train.step.HeadTrainStep`: train a draft head (Medusa,
    EAGLE-1/2, EAGLE-3, DFlash; Medusa-2 with ``head.lora.enabled``) from a recipe."""

    #: The recipe schema this trainer runs (the CLI reads recipes with it).
    recipe_schema = Recipe
    #: The command whose output folders this trainer writes (their marker; see :mod:`specgraft.utils.outputs`).
    command = "train"

    def __init__(self, recipe: Recipe, resume: bool = False, target: Target | None = None, dataset: Any = None,
                 show_progress: bool = True, eval_dataset: Any = None) -> None:
        super().__init__(recipe, HeadTrainStep(recipe), resume=resume, target=target, dataset=dataset,
                         show_progress=show_progress, eval_dataset=eval_dataset)

    @property
    def head(self) -> DraftHead | None:
        """The head being trained (None before setup)."""
        return self.train_step.head


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if torch.is_tensor(obj):
        return obj.tolist()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return None  # functions (lr lambdas) are rebuilt from the recipe, not saved


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
