"""Medusa-2: heads + LoRA adapter trained jointly; the adapter is saved in peft format and applied on load."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from specgraft.cli import main as cli_main
from specgraft.heads import load_head
from specgraft.heads.medusa.medusa2 import kl_base_to_adapted
from specgraft.target import load_target

from .test_trainer import tiny_run  # noqa: F401  (fixture)


def test_kl_term_matches_reference():
    torch.manual_seed(0)
    base, adapted = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    p, q = base.softmax(-1), adapted.softmax(-1)
    expected = [(p[b, t] * (p[b, t].log() - q[b, t].log())).sum() for b in range(2) for t in range(3) if mask[b, t]]
    torch.testing.assert_close(kl_base_to_adapted(base, adapted, mask), torch.stack(expected).mean())


def test_medusa2_trains_adapter_and_load_applies_it(tiny_run, capsys):  # noqa: F811
    model_dir, write_recipe = tiny_run
    recipe = write_recipe(lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "head_warmup_steps": 2,
                                "target_modules": ["q_proj", "v_proj"], "learning_rate": 1e-2},
                          training={"max_steps": 6, "checkpoint_every": 3})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 0
    out = Path(yaml.safe_load(recipe.read_text())["output"]["dir"]) / "head"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not any("lora" in k for k in load_file(str(out / "head.safetensors")))

    ids = torch.tensor([[1, 70, 71, 72, 73, 74]])
    plain = load_target(model_dir)
    before = plain(ids).logits
    target = load_target(model_dir)
    head = load_head(target, out)  # the head's own target: a copy with the adapter merged
    after = head.target(ids).logits
    assert not torch.allclose(before, after), "the trained adapter must change the target the head decodes with"
    assert not any(p.requires_grad for p in head.target.model.parameters())
    assert "lora" not in " ".join(n for n, _ in head.target.model.named_parameters())
    # Loading does not change the caller's target.
    torch.testing.assert_close(target(ids).logits, before, rtol=0, atol=0)
    assert head.target.identity == target.identity


def test_lora_target_modules_that_do_not_exist(tiny_run, capsys):  # noqa: F811
    _, write_recipe = tiny_run
    recipe = write_recipe(lora={"enabled": True, "target_modules": ["q_proj", "c_attn"]})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "lora.target_modules ['c_attn'] do not exist in LlamaForCausalLM" in err and "q_proj" in err
