"""Dry-run a real-model recipe on this machine: same architecture, tiny random weights, one step.

``specgraft train RECIPE --dry-run`` resolves the recipe, builds a tiny random model of the recipe target's
architecture (its real config when it is available locally, otherwise the family guessed from the model name),
builds the head and optimizer exactly as the recipe says, and runs one training step on synthetic conversations,
so users are never the first to execute a recipe. Nothing is downloaded and nothing is written outside a
temporary folder.
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from specgraft.config import DistillRecipe, Recipe
from specgraft.errors import SpecgraftError
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

logger = logging.getLogger(__name__)

#: Name fragments -> transformers model_type, checked in order (more specific first).
FAMILY_HINTS: tuple[tuple[str, str], ...] = (
    ("qwen3", "qwen3"), ("qwen2", "qwen2"), ("qwq", "qwen2"), ("gemma-3", "gemma3_text"), ("gemma3", "gemma3_text"),
    ("gemma-2", "gemma2"), ("gemma2", "gemma2"), ("phi-3", "phi3"), ("phi3", "phi3"), ("phi-4", "phi3"),
    ("mistral", "mistral"), ("zephyr", "mistral"), ("llama", "llama"), ("vicuna", "llama"), ("stories", "llama"),
    ("smollm", "llama"),
)


def guess_model_type(name_or_path: str) -> str:
    """The transformers model_type of a target: its local config (or GGUF metadata) if present, else a guess
    from its name."""
    from specgraft.gguf import gguf_config, is_gguf_path

    if is_gguf_path(name_or_path) and Path(name_or_path).expanduser().is_file():
        return gguf_config(name_or_path).model_type  # metadata only: a dry run does not dequantize
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True).model_type
    except (OSError, ValueError):
        pass
    lowered = name_or_path.lower()
    for fragment, model_type in FAMILY_HINTS:
        if fragment in lowered:
            return model_type
    raise SpecgraftError(f"cannot tell the architecture of {name_or_path} offline; download its config.json next to "
                         "the recipe's model.name_or_path or dry-run on a machine with Hub access")


SYNTHETIC_CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"},
                  {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}. " * 3}]}
    for i in range(24)
]


def dry_run_recipe(recipe: Recipe | DistillRecipe, trainer_cls: Any = None) -> dict[str, Any]:
    """Run one training step of ``recipe`` against a tiny random stand-in of its target; returns a summary."""
    from specgraft.train.trainer import HeadTrainer

    trainer_cls = trainer_cls or HeadTrainer
    # The stand-in trains on synthetic data from a fresh head, so a missing data file or source head cannot fail the
    # dry run; the real run needs them, so say so (recipes are often dry-run on a laptop before the data is
    # downloaded).
    problems = _input_problems(recipe)
    model_type = guess_model_type(recipe.model.name_or_path)
    needed = max(getattr(getattr(recipe, "head", None), "feature_layers", None) or [0])
    layers = max(4, needed + 3)
    model = tiny_model(model_type, num_hidden_layers=layers)
    target = Target(model, tiny_tokenizer(), name_or_path=f"dry-run stand-in for {recipe.model.name_or_path}")

    with tempfile.TemporaryDirectory(prefix="specgraft-dry-run-") as tmp:
        data = Path(tmp) / "conversations.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in SYNTHETIC_CONVERSATIONS), encoding="utf-8")
        stand_in = copy.deepcopy(recipe)
        stand_in.data.path, stand_in.data.format = str(data), "messages"
        stand_in.data.max_length = min(stand_in.data.max_length, 96)
        # Regeneration / sequence-level KD need a trained target: a random one answers with empty replies.
        stand_in.data.regenerate = False
        if getattr(stand_in, "distill", None) is not None:
            stand_in.distill.seq_kd = False
        stand_in.data.cache_dir = str(Path(tmp) / "cache")
        stand_in.data.num_samples = None
        stand_in.data.eval_fraction = 0.0
        if stand_in.data.replay_path:  # the replay mixing runs too, on the same synthetic rows
            stand_in.data.replay_path = str(data)
        if getattr(getattr(stand_in, "head", None), "init_from", None):
            stand_in.head.init_from = None  # a head for the real target does not fit the stand-in
        stand_in.model.dtype = "float32"
        stand_in.training.max_steps = 1
        stand_in.training.micro_batch_size = min(stand_in.training.micro_batch_size, 2)
        stand_in.training.gradient_accumulation_steps = 1
        stand_in.training.mixed_precision = "no"
        stand_in.training.feature_cache_dir = str(Path(tmp) / "features")
        if getattr(getattr(stand_in, "head", None), "draft_vocab_size", None):
            stand_in.head.draft_vocab_size = min(stand_in.head.draft_vocab_size, target.vocab_size)
        stand_in.output.dir = str(Path(tmp) / "out")
        stand_in.tracking.backend = "none"
        if getattr(stand_in, "distill", None) is not None and stand_in.distill.student:
            stand_in.distill.student = None  # the real student is as unavailable offline as the target
        trainer = trainer_cls(stand_in, target=target, show_progress=False)
        try:
            trainer.setup()
            n_params = sum(p.numel() for p in trainer.unwrapped().parameters() if p.requires_grad)
            groups = len(trainer.optimizer.param_groups)
            summary = trainer.train()
        finally:
            trainer.cleanup()
    return {"model_type": model_type, "stand_in_layers": layers, "trainable_parameters": n_params,
            "optimizer_groups": groups, "steps": summary["steps"], "input_problems": problems}


def _input_problems(recipe: Recipe | DistillRecipe) -> list[str]:
    """What the real run would fail on among the recipe's inputs that the stand-in replaces (its data files and
    the head it warm-starts from), each as its error message."""
    from specgraft.data.readers import source_files
    from specgraft.heads.base import read_head_config

    problems = []
    for key, path in (("data.path", recipe.data.path), ("data.replay_path", recipe.data.replay_path)):
        if not path:
            continue
        try:
            source_files(path, key=key)
        except SpecgraftError as exc:
            problems.append(str(exc))
    init_from = getattr(getattr(recipe, "head", None), "init_from", None)
    if init_from:
        try:
            head_type = read_head_config(init_from)["head_type"]
        except SpecgraftError as exc:
            problems.append(f"head.init_from: {exc}")
        else:
            if head_type != recipe.head.type:
                problems.append(f"head.init_from {init_from} is a {head_type} head but head.type is "
                                f"{recipe.head.type}; start from a {recipe.head.type} head")
    return problems
