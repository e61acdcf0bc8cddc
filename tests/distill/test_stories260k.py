"""Distillation on the real (tiny) stories260K target: the shipped recipe runs, alpha rises, drafts stay lossless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specgraft.config import load_recipe
from specgraft.decoding.decoder import SpeculativeDecoder, generate_reference
from specgraft.distill.output import draft_drafter
from specgraft.distill.trainer import DistillTrainer
from specgraft.target import load_target

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "distill" / "stories260k.yaml"
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"
NEW = 40


@pytest.fixture(scope="module")
def distilled(stories260k_dir, tinystories_path, tmp_path_factory):
    """The shipped recipe on a small budget: 12 steps of 4 x 64 tokens, half of them on-policy."""
    out = tmp_path_factory.mktemp("distill-stories")
    recipe = load_recipe(RECIPE, [
        f"model.name_or_path={stories260k_dir}", f"data.path={tinystories_path}", "data.max_length=64",
        "data.num_samples=120", "data.eval_fraction=0.1", f"data.cache_dir={out / 'cache'}",
        "distill.lmbda=0.5", "distill.onpolicy_max_new_tokens=16", "distill.alpha_eval_every=6",
        "training.max_steps=12", "training.micro_batch_size=4", "training.warmup_steps=0",
        "training.checkpoint_every=12", f"output.dir={out / 'run'}", "tracking.backend=none",
    ])
    trainer = DistillTrainer(recipe, show_progress=False)
    trainer.setup()
    try:
        before = trainer.evaluate_alpha()
        summary = trainer.train()
    finally:
        trainer.cleanup()
    return stories260k_dir, out / "run", before, summary


def test_recipe_distills_a_two_layer_draft_and_alpha_rises(distilled):
    _, run, before, summary = distilled
    model = AutoModelForCausalLM.from_pretrained(run / "draft")
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 512
    assert summary["best_alpha_exact"] > before["alpha_exact"] + 0.05
    assert (run / "best" / "specgraft_distill.json").is_file()


def test_draft_is_lossless_with_the_eval_decoder_and_assistant_model(distilled):
    target_dir, run, _, _ = distilled
    target = load_target(target_dir)
    decoder = SpeculativeDecoder(target, drafter=draft_drafter(run / "best", target, k=4), ignore_eos=True)
    result = decoder.generate(PROMPT, NEW)
    assert result.generated_ids == generate_reference(target.model, PROMPT, NEW, ignore_eos=True)
    assert result.tau > 1.0

    draft = AutoModelForCausalLM.from_pretrained(run / "best").eval()
    ids = torch.tensor([PROMPT])
    plain = target.model.generate(ids, max_new_tokens=NEW, do_sample=False)
    assisted = target.model.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == plain.tolist()
