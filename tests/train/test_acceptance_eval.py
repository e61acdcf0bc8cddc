"""Acceptance during training (``training.eval_every``): the held-out simulated tau, the decoder run, best/ and
resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from specgraft.config import Recipe, from_dict
from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.errors import SpecgraftError
from specgraft.heads.base import UNRANKED
from specgraft.heads.registry import get_family
from specgraft.target import Target
from specgraft.testing import tiny_model
from specgraft.train.acceptance_eval import count_ranks, decoding_anchors, simulated_tau
from specgraft.train.checkpoint import CHECKPOINTS_DIR, checkpoint_name
from specgraft.train.trainer import BEST_DIR, METRICS_FILE, HeadTrainer
from specgraft.tuning.simulate import predict


def _walk_reference(accepted: list[int], can_anchor: list[bool]) -> list[int]:
    anchors, i = [], 0
    while i < len(accepted):
        if can_anchor[i]:
            anchors.append(i)
            i += accepted[i] + 1
        else:
            i += 1
    return anchors


def test_chain_simulation_replays_the_decoder_walk_and_equals_simulate():
    """On rows that follow the target's greedy path, a chain's simulated tau is exactly the tokens per step of
    the decoder's walk over the rows (anchor i, then i + accepted + 1), and equals `specgraft simulate` of the
    per-depth acceptance profile."""
    gen = torch.Generator().manual_seed(0)
    batch, length, depth = 3, 40, 4
    greedy = torch.randint(3, 50, (batch, length), generator=gen)
    tokens = torch.zeros_like(greedy)
    tokens[:, 1:] = greedy[:, :-1]  # every token is the target's greedy choice
    labels = torch.ones_like(tokens, dtype=torch.bool)
    labels[:, :5] = False  # a 5-token prompt per row: the first anchor is position 4 (its root is token 5)
    ranks = torch.randint(0, 3, (batch, length, depth), generator=gen)
    for d in range(1, depth + 1):
        ranks[:, length - d :, d - 1] = UNRANKED  # past the row's end
    attempts, accepts, steps = count_ranks(ranks, tokens, greedy, labels, [1] * depth)

    # Direct loop: accepted drafts from every anchor, the walk, tokens per step.
    emitted = walked = 0
    for b in range(batch):
        accepted = []
        for i in range(length):
            n = 0
            while n < depth and i + n + 1 < length and bool(labels[b, i + n + 1]) and ranks[b, i, n] == 0:
                n += 1
            accepted.append(n)
        can = [i + 1 < length and bool(labels[b, i + 1]) for i in range(length)]
        anchors = _walk_reference(accepted, can)
        walked += len(anchors)
        emitted += sum(accepted[i] + 1 for i in anchors)
    assert steps == walked
    stats = {"verdicts": steps, "rank_attempts": attempts.tolist(), "rank_accepts": accepts.tolist()}

    class Head:
        head_type = "eagle3"

    sim = simulated_tau(Head(), {"mode": "chain", "depth": depth}, stats)
    assert sim["sim_tau"] == pytest.approx(emitted / walked, rel=1e-12)
    profile = [a[0] / t[0] for a, t in zip(stats["rank_accepts"], stats["rank_attempts"])]
    assert sim["sim_tau"] == pytest.approx(predict(profile=profile, cost_ratio=0.0).tau, rel=1e-12)


def test_anchors_skip_positions_off_the_greedy_path():
    accepted = torch.tensor([[2, 0, 0, 1, 0, 0, 0]])
    can = torch.tensor([[True, True, True, False, True, True, False]])
    assert decoding_anchors(accepted, can)[0].nonzero().flatten().tolist() == [0, 4, 5]


# -- end to end on a tiny target -----------------------------------------------------------------------------------
PROMPT, ANSWER, VOCAB = 6, 40, 24


@pytest.fixture(scope="module")
def self_distilled():
    """A tiny Llama target and rows of its own greedy continuations of random prompts (train, held out)."""
    model = tiny_model("llama", seed=1, vocab_size=VOCAB).eval()
    target = Target(model)
    decoder = SpeculativeDecoder(target, ignore_eos=True)

    def rows(seed: int, count: int) -> Dataset:
        prompts = torch.randint(3, model.config.vocab_size, (count, PROMPT),
                                generator=torch.Generator().manual_seed(seed))
        out = []
        for prompt in prompts.tolist():
            ids = prompt + decoder.generate(prompt, ANSWER).generated_ids
            out.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                        "loss_mask": [0] * PROMPT + [1] * ANSWER})
        return Dataset.from_list(out)

    return target, rows(0, 48), rows(1, 8)


#: A small head of each family that drafts a chain of 3 (DFlash: a block of 4 slots, the anchor and 3 drafts; the
#: tiny target has no tokenizer to pick a mask token from, so id 0 is embedded in the predicted slots).
HEADS = {"eagle3": {"type": "eagle3", "ttt_steps": 2},
         "eagle": {"type": "eagle", "ttt_steps": 2},
         "dflash": {"type": "dflash", "block_size": 4, "max_anchors": 32, "mask_token_id": 0}}


def _recipe(tmp_path, name: str, head: str = "eagle3", **training) -> Recipe:
    return from_dict(Recipe, {
        "model": {"name_or_path": "tiny"}, "data": {"path": "in-memory", "max_length": PROMPT + ANSWER},
        "head": HEADS[head],
        "training": {"max_steps": 24, "micro_batch_size": 8, "learning_rate": 1e-2, "lr_scheduler": "constant",
                     "eval_every": 8, "eval_batches": 1, "eval_prompts": 8, "eval_max_new_tokens": ANSWER,
                     "eval_setting": {"mode": "chain", "depth": 3}, "checkpoint_every": 8, "keep_checkpoints": 10,
                     "log_every": 4, "seed": 0, **training},
        "output": {"dir": str(tmp_path / name)}, "tracking": {"backend": "none"}})


def _train(recipe: Recipe, data, resume: bool = False) -> dict:
    target, train, held_out = data
    trainer = HeadTrainer(recipe, target=target, dataset=train, eval_dataset=held_out, show_progress=False,
                          resume=resume)
    trainer.setup()
    summary = trainer.train()
    trainer.cleanup()
    return summary


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


@pytest.mark.parametrize("head", list(HEADS))
def test_simulated_tau_agrees_with_the_decoder_and_best_is_the_best_checkpoint(tmp_path, self_distilled, head):
    summary = _train(_recipe(tmp_path, "run", head), self_distilled)
    out = tmp_path / "run"
    records = _records(out)
    assert [r["step"] for r in records] == [8, 16, 24]
    last = records[-1]
    # The decoder on the held-out prompts is lossless, and its tau is what the held-out rows simulate (the rows
    # are the target's greedy answers to those prompts; the simulation replays the decoder's steps teacher-forced).
    assert last["decoder_identical"] == last["decoder_prompts"] == 8
    assert last["decoder_tau"] > 1.2, "the head learned nothing: the comparison would be vacuous"
    assert last["sim_tau"] == pytest.approx(last["decoder_tau"], rel=0.10)
    assert 0 < summary["eval_time_fraction"] < 1 and 0 < last["eval_time_fraction"] < 1

    # best/ is the checkpoint of the step with the best simulated tau.
    best = max(records, key=lambda r: r["sim_tau"])
    assert summary["best_eval_step"] == best["step"] and summary["best_sim_tau"] == best["sim_tau"]
    meta = json.loads((out / BEST_DIR / "head_config.json").read_text())
    assert meta["training"]["step"] == best["step"]
    saved = load_file(out / BEST_DIR / "head.safetensors")
    at_step = load_file(out / CHECKPOINTS_DIR / checkpoint_name(best["step"]) / "model" / "head.safetensors")
    assert saved.keys() == at_step.keys() and all(torch.equal(saved[k], at_step[k]) for k in saved)


@pytest.mark.slow
def test_resume_keeps_the_uninterrupted_runs_best_state(tmp_path, self_distilled):
    _train(_recipe(tmp_path, "whole"), self_distilled)
    _train(_recipe(tmp_path, "split", max_steps=16), self_distilled)
    summary = _train(_recipe(tmp_path, "split"), self_distilled, resume=True)
    whole, split = _records(tmp_path / "whole"), _records(tmp_path / "split")
    keys = ("step", "sim_tau", "decoder_tau", "best_step")
    assert [{k: r[k] for k in keys} for r in split] == [{k: r[k] for k in keys} for r in whole]
    state = json.loads((tmp_path / "split" / CHECKPOINTS_DIR / checkpoint_name(24) / "trainer_state.json")
                       .read_text())
    assert state["best_eval"]["step"] == summary["best_eval_step"]
    a = load_file(tmp_path / "whole" / BEST_DIR / "head.safetensors")
    b = load_file(tmp_path / "split" / BEST_DIR / "head.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert math.isfinite(summary["eval_time_fraction"])


def test_refusals(tmp_path, self_distilled, monkeypatch):
    target, train, _ = self_distilled
    with pytest.raises(SpecgraftError, match="held-out rows"):
        trainer = HeadTrainer(_recipe(tmp_path, "none"), target=target, dataset=train, show_progress=False)
        trainer.setup()
    recipe = _recipe(tmp_path, "eagle1")
    recipe.head = from_dict(Recipe, {"model": {"name_or_path": "x"}, "data": {"path": "x"},
                                     "output": {"dir": "x"}, "head": {"type": "eagle"}}).head
    # Every built-in family measures it; a family whose search cannot simulate acceptance (a plug-in) is refused.
    monkeypatch.setattr(type(get_family("eagle").search), "simulates_acceptance", property(lambda self: False))
    with pytest.raises(SpecgraftError, match="does not measure held-out acceptance"):
        HeadTrainer(recipe, target=target, dataset=train, eval_dataset=train, show_progress=False).setup()
    from specgraft.errors import ConfigError

    with pytest.raises(ConfigError, match="eval_prompts is 0"):
        _recipe(tmp_path, "bad", eval_best_by="decoder_tau", eval_prompts=0)
