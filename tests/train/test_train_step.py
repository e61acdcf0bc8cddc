"""The trainer by composition: one RecipeTrainer runs a TrainStep; the numbers that change results are recipe fields
and reach the step; the shared building blocks (pad id, seeds, batched generation) follow one rule."""

from __future__ import annotations

import inspect

import datasets
import pytest
import torch

from specgraft.config import DataConfig, ModelConfig, OutputConfig, Recipe, TrainingConfig
from specgraft.heads.medusa.config import LoraConfig, MedusaConfig
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

#: Trainer hooks that existed before the composition (subclasses overrode them); none may come back.
OLD_HOOKS = ("save_model", "load_model_state", "on_optimizer_step", "before_final_save", "feature_layers",
             "token_counts", "label", "find_unused_parameters")


def test_trainers_are_the_one_loop_with_a_step():
    from specgraft.distill.trainer import DistillTrainer, DistillTrainStep
    from specgraft.train.step import HeadTrainStep, TrainStep
    from specgraft.train.trainer import HeadTrainer, RecipeTrainer

    assert not [name for name in OLD_HOOKS if hasattr(RecipeTrainer, name)]
    # The named trainers only choose the step (and expose its results): no loop logic, no overrides.
    loop = {name for name, _ in inspect.getmembers(RecipeTrainer, inspect.isfunction)}
    for cls in (HeadTrainer, DistillTrainer):
        assert not (set(vars(cls)) & loop - {"__init__"}), cls
    for step in (HeadTrainStep, DistillTrainStep):
        for name in ("check", "build", "feature_layers", "save", "load", "after_optimizer_step", "finalize"):
            assert callable(getattr(step, name)), (step, name)
    assert {"build", "save", "load", "finalize"} <= set(vars(TrainStep))


def _medusa2_recipe(tmp_path, **lora) -> Recipe:
    return Recipe(model=ModelConfig("tiny"), data=DataConfig("unused"), output=OutputConfig(str(tmp_path / "o")),
                  head=MedusaConfig(num_heads=2, lora=LoraConfig(enabled=True, r=2, alpha=4, dropout=0.0,
                                                                  target_modules=["q_proj"], **lora)),
                  training=TrainingConfig(learning_rate=1e-2))


@pytest.mark.parametrize("lora,expected", [({}, 1e-2 / 4), ({"learning_rate_divisor": 10.0}, 1e-3),
                                           ({"learning_rate": 3e-4, "learning_rate_divisor": 10.0}, 3e-4)])
def test_adapter_learning_rate_is_a_recipe_field(tmp_path, lora, expected):
    from specgraft.train.trainer import HeadTrainer

    target = Target(tiny_model("llama"), tiny_tokenizer())
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 5, 6, 7]], "loss_mask": [[0, 1, 1, 1]]})
    trainer = HeadTrainer(_medusa2_recipe(tmp_path, **lora), target=target, dataset=ds, show_progress=False)
    module, groups = trainer.build_model(target)
    heads, adapter = groups
    assert heads["lr"] == 1e-2 and adapter["lr"] == pytest.approx(expected, rel=1e-12)
    # The adapter group is exactly the LoRA weights; the heads group exactly the head's parameters.
    assert {id(p) for p in adapter["params"]} == {id(p) for n, p in module.peft_model.named_parameters()
                                                  if "lora_" in n}
    assert {id(p) for p in heads["params"]} == {id(p) for p in trainer.head.parameters()}


def test_train_metrics_reads_the_configured_number_of_batches(tmp_path, monkeypatch):
    from specgraft.heads.registry import get_family
    from specgraft.train.trainer import HeadTrainer

    seen = {}

    def fake_metrics(head, target, batches, max_batches, measured_on):
        seen.update(max_batches=max_batches, measured_on=measured_on, rows=sum(len(b["input_ids"]) for b in batches))
        return {"measured": True}

    monkeypatch.setattr(get_family("medusa"), "train_metrics", fake_metrics)
    target = Target(tiny_model("llama"), tiny_tokenizer())
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 5, 6, 7]] * 5, "loss_mask": [[0, 1, 1, 1]] * 5})
    recipe = Recipe(model=ModelConfig("tiny"), data=DataConfig("unused"), output=OutputConfig(str(tmp_path / "o")),
                    head=MedusaConfig(num_heads=2), training=TrainingConfig(train_metrics_batches=3,
                                                                            micro_batch_size=2))
    trainer = HeadTrainer(recipe, target=target, dataset=ds, show_progress=False)
    trainer.build_model(target)
    assert trainer.train_step.finalize(trainer) == {"measured": True}
    assert seen == {"max_batches": 3, "measured_on": "training", "rows": 5}


def test_pad_id_rule():
    from specgraft.data.collate import DEFAULT_PAD_ID, pad_token_id

    tok = tiny_tokenizer()
    assert pad_token_id(tok, (9,)) == tok.pad_token_id is not None
    tok.pad_token = None
    assert tok.pad_token_id is None
    assert pad_token_id(tok, (9, 4)) == 9  # generation pads finished rows with the first stop token
    assert pad_token_id(tok) == DEFAULT_PAD_ID == pad_token_id(None)


def test_derive_seed_is_one_stable_rule():
    from specgraft.data import regenerate
    from specgraft.distill import data as ddata
    from specgraft.utils.seeds import derive_seed

    assert ddata.derive_seed is derive_seed and regenerate.derive_seed is derive_seed
    assert derive_seed(3, 1, 2) == derive_seed(3, 1, 2) != derive_seed(3, 2, 1)
    assert 0 <= derive_seed(2**63, 7) < 2**60


def test_batched_generation_suppresses_ids_past_the_tokenizer_and_keeps_the_rng():
    from specgraft.data.generate import generate_batch, generation_config, ids_past_tokenizer
    from specgraft.distill.data import generate_continuations

    tok = tiny_tokenizer()
    model = tiny_model("llama")  # its embedding matrix has rows past the tokenizer's 262 ids
    vocab = model.get_output_embeddings().weight.shape[0]
    past = ids_past_tokenizer(model, tok)
    assert len(tok) < vocab and past == list(range(len(tok), vocab))
    # Make the padding rows the most likely tokens: unsuppressed greedy decoding would emit them.
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[len(tok):] = 50.0 * weight[: vocab - len(tok)]
    prompts = [[1, 5, 6], [7]]
    free = generate_batch(model, prompts, generation_config(6, 0.0, 0, ()), seed=0)
    assert any(t >= len(tok) for tokens, _ in free for t in tokens)  # negative control
    state = torch.random.get_rng_state()
    for temperature in (0.0, 1.0):
        kept = generate_continuations(model, prompts, 6, temperature, 0, (), seed=1, suppress_tokens=past)
        assert all(t < len(tok) for tokens in kept for t in tokens) and all(len(tokens) == 6 for tokens in kept)
    assert torch.equal(torch.random.get_rng_state(), state)  # sampling drew from a forked, seeded RNG


def test_fields_added_later_keep_old_checkpoints_resumable(tmp_path):
    """At the value every earlier run had, a new field leaves the fingerprint as it was (a checkpoint of before
    the field still resumes); any other value is a different trajectory."""
    import dataclasses
    import hashlib
    import json

    from specgraft.config import to_dict
    from specgraft.train.trainer import FIELDS_ADDED_LATER, RESUMABLE_CHANGES, recipe_fingerprint

    recipe = _medusa2_recipe(tmp_path)
    data = to_dict(recipe)  # the fingerprint of the recipe as written before the fields existed
    data["lora"] = data["head"].pop("lora")  # ... and before Medusa-2's lora moved into the head section
    for dotted in (*RESUMABLE_CHANGES, *(k for k in FIELDS_ADDED_LATER if not k.startswith("distill."))):
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node.pop(leaf, None)
    before = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    assert recipe_fingerprint(recipe) == before
    lora = dataclasses.replace(recipe.head.lora, learning_rate_divisor=8.0)
    changed = dataclasses.replace(recipe, head=dataclasses.replace(recipe.head, lora=lora))
    assert recipe_fingerprint(changed) != before
