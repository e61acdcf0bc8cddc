"""EAGLE-3 ``head.layer_init: target``: a fresh draft that starts as the target's own next layers.

At step 0 the started draft must compute exactly what the target computes after the deepest fused layer (whatever
the token embedding), on every architecture, with one or two draft layers and under feature scaling; training then
moves the embedding's columns away from zero; the saved head is an ordinary EAGLE-3 head; a bad value is one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specgraft.cli import main as cli_main
from specgraft.config import load_recipe
from specgraft.target import Target
from specgraft.testing import tiny_model
from specgraft.train.trainer import HeadTrainer

from ..train.test_trainer import tiny_run  # noqa: F401  (fixture)
from .test_eagle3 import _head


def _step0(target: Target, ids: torch.Tensor, **config) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    head = _head(target, ttt_steps=1, draft_vocab_size=64, **config).eval()
    depth = max(head.config.feature_layers) + head.config.num_layers
    out = target(ids, torch.ones_like(ids), layers=(*head.required_layers(), depth))
    if head.config.feature_scaling != "none":
        head.prepare_from_target(out.hidden_states, torch.ones_like(ids))
        assert head.fc.input_scale is not None and not torch.all(head.fc.input_scale == 1)
    with torch.no_grad():
        step0 = head.ttt_outputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, out)[0]
    return step0, out.hidden_states[depth]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_the_started_draft_computes_the_targets_next_layers(tiny_arch, num_layers):
    target = Target(tiny_model(tiny_arch))  # 4 layers: fused (0, 1), the draft is the target's layers 1 (and 2)
    ids = torch.randint(6, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    step0, expected = _step0(target, ids, feature_layers=[0, 1], num_layers=num_layers, layer_init="target")
    # The target's hidden state at i has read tokens 0..i, the draft's step 0 there also the embedding of x_{i+1}:
    # equal, the embedding's q/k/v columns start at zero.
    torch.testing.assert_close(step0, expected, rtol=1e-5, atol=1e-5)
    # Negative control: the default, random start, is far from it.
    random_start, _ = _step0(target, ids, feature_layers=[0, 1], num_layers=num_layers)
    assert (random_start - expected).abs().max() > 0.1


def test_feature_scaling_keeps_the_started_function(tiny_llama):
    target = Target(tiny_llama)
    ids = torch.randint(6, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    step0, expected = _step0(target, ids, feature_layers=[0, 2], layer_init="target", feature_scaling="dim")
    torch.testing.assert_close(step0, expected, rtol=1e-5, atol=1e-5)


def test_trained_from_the_target_the_head_is_an_ordinary_head_that_learned_the_embedding(tiny_run, tmp_path):  # noqa: F811
    model_dir, write_recipe = tiny_run
    heads = {}
    for init in ("random", "target"):
        recipe = write_recipe(f"{init}.yaml", head={"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64,
                                                    "layer_init": init},
                              output={"dir": str(tmp_path / f"init_{init}")}, training={"max_steps": 4},
                              tracking={"backend": "none"})
        trainer = HeadTrainer(load_recipe(recipe), show_progress=False)
        trainer.setup()
        trainer.train()
        trainer.cleanup()
        heads[init] = load_file(tmp_path / f"init_{init}" / "head" / "head.safetensors")
    assert {k: v.shape for k, v in heads["target"].items()} == {k: v.shape for k, v in heads["random"].items()}
    q = heads["target"]["midlayer.self_attn.q_proj.weight"]
    assert q[:, : q.shape[1] // 2].abs().max() > 0  # the embedding's columns, zero at the start, were trained


def test_an_unknown_layer_init_is_refused_in_one_line(tiny_run, capsys):  # noqa: F811
    _, write_recipe = tiny_run
    recipe = write_recipe(head={"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64, "layer_init": "copy"})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "layer_init" in err[0] and "target" in err[0]
