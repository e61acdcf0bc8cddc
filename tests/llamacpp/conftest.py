"""Fixtures of the llama.cpp tier: the pinned build (skipped, naming the build command, when absent), stories260K
as a llama.cpp GGUF, heads trained by the shipped CPU recipes on a short budget, and TinyStories prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specgraft.errors import SpecgraftError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def llamacpp_bin() -> Path:
    from specgraft.export.llamacpp_engine import llamacpp_bin

    try:
        return llamacpp_bin()
    except SpecgraftError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def stories_target(stories260k_dir):
    from specgraft.target import load_target

    return load_target(stories260k_dir)


@pytest.fixture(scope="session")
def stories260k_gguf(shared_data, stories_target, tmp_path_factory) -> Path:
    """stories260K as llama.cpp's ``llama`` GGUF: the converted weights, the llama2.c tokenizer's pieces, scores
    (llama.cpp's SentencePiece merge order) and token types."""
    from specgraft.export.llamacpp import (
        TOKEN_BYTE,
        TOKEN_CONTROL,
        TOKEN_NORMAL,
        TOKEN_UNKNOWN,
        write_target_gguf,
    )
    from specgraft.llama2c import read_llama2c_vocab

    tokenizer = stories_target.tokenizer
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    _, scores = read_llama2c_vocab(shared_data / "models" / "stories260K" / "tok512.bin")
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL, *([TOKEN_BYTE] * 256)]
    types += [TOKEN_NORMAL] * (len(tokens) - len(types))
    return write_target_gguf(stories_target.model, tokens, tmp_path_factory.mktemp("gguf") / "stories260K.gguf",
                             scores=scores, token_types=types, bos_id=1, eos_id=2, unk_id=0, name="stories260K")


def run_trainer(trainer: Any) -> None:
    """setup -> train -> cleanup, the way the CLI runs a trainer."""
    trainer.setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()


def train_short(recipe_name: str, stories260k_dir: Path, tinystories_path: Path, out: Path,
                overrides: list[str]) -> Path:
    """A shipped stories260K recipe on a short budget (a head good enough to accept, not the recipe's quality)."""
    from specgraft.config import load_recipe
    from specgraft.train.trainer import HeadTrainer

    recipe = load_recipe(REPO / "recipes" / recipe_name, [
        f"model.name_or_path={stories260k_dir}", f"data.path={tinystories_path}", f"data.cache_dir={out / 'cache'}",
        f"output.dir={out / 'head'}", "tracking.backend=none", *overrides,
    ])
    run_trainer(HeadTrainer(recipe, show_progress=False))
    return out / "head" / "head"


@pytest.fixture(scope="session")
def eagle3_head(stories260k_dir, tinystories_path, tmp_path_factory) -> Path:
    """recipes/eagle3/stories260k.yaml cut to 160 steps on 384 self-distilled continuations (the recipe: 600 steps
    on 1536)."""
    return train_short("eagle3/stories260k.yaml", stories260k_dir, tinystories_path,
                       tmp_path_factory.mktemp("eagle3-stories"),
                       ["data.num_samples=384", "data.regenerate_max_new_tokens=96", "training.max_steps=160",
                        "training.checkpoint_every=160", "training.warmup_steps=10"])


@pytest.fixture(scope="session")
def dflash_head(stories260k_dir, tinystories_path, tmp_path_factory) -> Path:
    """recipes/dflash/stories260k.yaml (Qwen3-layout draft layer, blocks of 5) cut to 200 steps on 384
    self-distilled continuations (the recipe: 600 steps on 1536)."""
    return train_short("dflash/stories260k.yaml", stories260k_dir, tinystories_path,
                       tmp_path_factory.mktemp("dflash-stories"),
                       ["data.num_samples=384", "data.regenerate_max_new_tokens=96", "training.max_steps=200",
                        "training.checkpoint_every=200", "training.warmup_steps=10"])


@pytest.fixture(scope="session")
def story_prompts(tinystories_path, stories_target) -> list[list[int]]:
    """Token ids of the first sentence of eight TinyStories paragraphs from the END of the file (the short
    training run's continuations come from its start)."""
    paragraphs = [p.strip() for p in tinystories_path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    firsts = [p.split(". ")[0] + "." for p in paragraphs[-8:]]
    return [stories_target.tokenizer(text)["input_ids"] for text in firsts]


@pytest.fixture(scope="session")
def distilled_draft(stories260k_dir, tinystories_path, tmp_path_factory) -> Path:
    """recipes/distill/stories260k.yaml cut to 60 steps of 8 x 128 tokens (the recipe: 400 of 8 x 256): a
    2-layer draft cut from the target's layers 0 and 3, good enough to be accepted often."""
    from specgraft.config import load_recipe
    from specgraft.distill.trainer import DistillTrainer

    out = tmp_path_factory.mktemp("distill-stories")
    recipe = load_recipe(REPO / "recipes" / "distill" / "stories260k.yaml", [
        f"model.name_or_path={stories260k_dir}", f"data.path={tinystories_path}", f"data.cache_dir={out / 'cache'}",
        "data.max_length=128", "data.num_samples=600", "distill.alpha_eval_every=60", "training.max_steps=60",
        "training.checkpoint_every=60", "training.warmup_steps=5", f"output.dir={out / 'run'}",
        "tracking.backend=none",
    ])
    run_trainer(DistillTrainer(recipe, show_progress=False))
    return out / "run" / "draft"


@pytest.fixture(scope="session")
def plain(llamacpp_bin, stories260k_gguf, story_prompts) -> list:
    """llama.cpp's plain greedy completions of the story prompts (the reference every oracle test compares with)."""
    from .oracle import engine_runs

    return engine_runs(["-m", stories260k_gguf], story_prompts)
