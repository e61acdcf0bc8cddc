"""EAGLE-3 ``head.feature_scaling``: fc's input scaled while training, folded into the saved weight.

The scaled layer is the same function as a plain Linear of the folded weight, learns every input feature at the same
speed whatever its size (the reason for it), and never shows outside the module: saved heads load into plain
heads, warm starts keep the source's function, and a resumed run is bitwise the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specgraft.cli import main as cli_main
from specgraft.config import load_recipe
from specgraft.heads import load_head
from specgraft.heads.layers import InputScaledLinear, power_of_two_scale
from specgraft.train.trainer import HeadTrainer

from ..train.test_trainer import tiny_run  # noqa: F401  (fixture)

EAGLE3 = {"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}


def _adam_steps(layer: nn.Linear, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(layer(x), y).backward()
        optimizer.step()


def test_the_scaled_layer_is_the_plain_layer_of_its_folded_weight_and_learns_every_feature_at_one_speed():
    torch.manual_seed(0)
    sizes = torch.tensor([1.0] * 4 + [64.0] * 4)  # two groups of features 64x apart (shallow vs deep layers)
    x = torch.randn(256, 8) * sizes
    y = torch.randn(256, 3)
    scale = power_of_two_scale(sizes)
    assert scale.tolist() == [1.0] * 4 + [1 / 64] * 4

    scaled = InputScaledLinear(8, 3)
    plain = nn.Linear(8, 3)
    plain.load_state_dict(scaled.state_dict())
    scaled.set_input_scale(scale, keep_function=True)  # the same function as before
    torch.testing.assert_close(scaled(x), plain(x), rtol=0, atol=1e-5)

    # Training the scaled layer is training a plain layer on the scaled inputs, and its state_dict is the folded
    # weight: a plain Linear loading it computes what the scaled layer computes.
    reference = nn.Linear(8, 3)
    with torch.no_grad():
        reference.weight.copy_(scaled.weight)
        reference.bias.copy_(scaled.bias)
    _adam_steps(scaled, x, y, 5)
    _adam_steps(reference, x * scale, y, 5)
    assert torch.equal(scaled.weight, reference.weight)
    saved = scaled.state_dict()
    assert set(saved) == {"weight", "bias"} and torch.equal(saved["weight"], reference.weight * scale)
    loaded = nn.Linear(8, 3)
    loaded.load_state_dict(saved)
    torch.testing.assert_close(loaded(x), scaled(x), rtol=0, atol=1e-5)
    # Loading a folded weight into a scaled layer unfolds it exactly (powers of two).
    again = InputScaledLinear(8, 3)
    again.set_input_scale(scale, keep_function=False)
    again.load_state_dict(saved)
    assert torch.equal(again.weight, scaled.weight)

    # Why: after one AdamW step from zero weights, each group's share of the output change is proportional to its
    # size raw (64x), and equal scaled. The raw layer is the negative control.
    moves = {}
    for name, input_scale in (("raw", None), ("scaled", scale)):
        layer = InputScaledLinear(8, 1, bias=False)
        nn.init.zeros_(layer.weight)
        layer.set_input_scale(input_scale, keep_function=False)
        _adam_steps(layer, x, y[:, :1], 1)
        folded = layer.state_dict()["weight"][0].abs()
        moves[name] = float((folded[4:] * 64).mean() / folded[:4].mean())
    assert moves["raw"] == pytest.approx(64.0, rel=0.05)
    assert moves["scaled"] == pytest.approx(1.0, rel=0.05)

    with pytest.raises(ValueError, match="powers of two"):
        InputScaledLinear(8, 3).set_input_scale(torch.full((8,), 0.3), keep_function=True)


def test_trained_with_scaling_the_head_saves_plain_weights_and_resumes_bitwise(tiny_run, tmp_path):  # noqa: F811
    model_dir, write_recipe = tiny_run
    head = {**EAGLE3, "feature_scaling": "dim"}

    def recipe(name: str, max_steps: int):
        return write_recipe(f"{name}.yaml", head=head, output={"dir": str(tmp_path / name)},
                            training={"max_steps": max_steps, "checkpoint_every": 4, "lr_scheduler": "constant"},
                            tracking={"backend": "none"})

    whole = load_recipe(recipe("whole", 8))
    trainer = HeadTrainer(whole, show_progress=False)
    trainer.setup()
    trainer.train()
    live = trainer.head
    exponents = trainer.data_facts["feature_scale_log2"]
    assert any(low != 0 or high != 0 for low, high in exponents.values()), "all scales 1: the test would be vacuous"
    assert live.fc.input_scale is not None

    # The saved head is an ordinary EAGLE-3 head (no extra tensor), and computes what the trained one computes.
    saved = load_head(trainer.target, tmp_path / "whole" / "head")
    assert saved.fc.input_scale is None
    assert set(load_file(tmp_path / "whole" / "head" / "head.safetensors")) == set(live.state_dict())
    batch = next(iter(trainer.loader))
    out = trainer.target(batch["input_ids"], batch["attention_mask"], layers=live.required_layers(), logits=True)
    with torch.no_grad():
        for a, b in zip(live.ttt_outputs(batch, out), saved.ttt_outputs(batch, out), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    trainer.cleanup()

    # Four steps, then resumed to eight: bitwise the uninterrupted run (a constant rate after the warm-up, so that the
    # shorter first run's schedule is the longer one's).
    assert cli_main(["train", str(recipe("split", 4)), "--no-progress"]) == 0
    assert cli_main(["train", str(recipe("split", 8)), "--resume", "--no-progress"]) == 0
    a = load_file(tmp_path / "whole" / "head" / "head.safetensors")
    b = load_file(tmp_path / "split" / "head" / "head.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A warm start with scaling starts from the source's function.
    warm = load_recipe(write_recipe("warm.yaml", head={**head, "init_from": str(tmp_path / "whole" / "head")},
                                    output={"dir": str(tmp_path / "warm")}, tracking={"backend": "none"}))
    trainer = HeadTrainer(warm, show_progress=False)
    trainer.setup()
    assert trainer.head.fc.input_scale is not None
    with torch.no_grad():
        for a, b in zip(trainer.head.ttt_outputs(batch, out), saved.ttt_outputs(batch, out), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    trainer.cleanup()


def test_feature_scaling_is_refused_in_one_line_when_unknown(tiny_run, capsys):  # noqa: F811
    _, write_recipe = tiny_run
    recipe = write_recipe(head={**EAGLE3, "feature_scaling": "global"})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "feature_scaling" in err[0] and "layer" in err[0]
