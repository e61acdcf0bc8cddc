"""DFlash through the product: a recipe with ``head.type: dflash`` trains with the shared trainer, evaluates
losslessly through ``specgraft eval --head``, exports as vLLM/speculators, SGLang and native and loads back, and a
DFlash export is refused where another family's is expected."""

from __future__ import annotations

import json

import pytest
import torch

from specgraft.cli import main as cli_main
from specgraft.errors import SpecgraftError
from specgraft.export import load_export
from specgraft.export.convert import from_engine
from specgraft.heads.base import load_head
from specgraft.heads.registry import get_family
from specgraft.target import load_target
from specgraft.testing import TINY_CORPUS_TEXT, recipe_writer, tiny_model, tiny_tokenizer


@pytest.fixture
def trained(tmp_path):
    target_dir = tmp_path / "target"
    tiny_model("qwen3").save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    (tmp_path / "corpus.txt").write_text(TINY_CORPUS_TEXT)
    recipe = recipe_writer(tmp_path, {
        "model": {"name_or_path": str(target_dir)},
        "data": {"path": str(tmp_path / "corpus.txt"), "format": "text", "max_length": 64, "packing": True,
                 "cache_dir": str(tmp_path / "cache")},
        "head": {"type": "dflash", "block_size": 4, "max_anchors": 16},
        "training": {"max_steps": 20, "micro_batch_size": 4, "learning_rate": 1e-2, "checkpoint_every": 20,
                     "log_every": 10, "seed": 0},
        "output": {"dir": str(tmp_path / "run")},
        "tracking": {"backend": "none"},
    })()
    assert cli_main(["train", str(recipe), "--no-progress"]) == 0
    return target_dir, tmp_path / "run" / "head"


def test_dflash_trains_evaluates_and_exports_through_the_cli(trained, tmp_path, capsys):
    target_dir, head_dir = trained
    meta = json.loads((head_dir / "head_config.json").read_text())
    assert meta["head_type"] == "dflash" and meta["config"]["block_size"] == 4
    assert meta["config"]["aux_layer_ids"] and meta["config"]["mask_token_id"] >= 0  # resolved against the target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "toy", "turns": [t]}) + "\n"
                               for i, t in enumerate(["Once upon a time", "The cat sat"])))
    assert cli_main(["eval", "--target", str(target_dir), "--head", str(head_dir), "--prompts", str(prompts),
                     "--out", str(tmp_path / "eval"), "--max-new-tokens", "12", "--warmup", "0",
                     "--no-progress"]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["drafter"]["type"] == "dflash" and report["drafter"]["k"] == 3
    assert report["overall"]["lossless_passed"] is True and report["overall"]["lossless_checked"] == 2

    target = load_target(target_dir)
    head = load_head(target, head_dir)
    for fmt in ("vllm", "sglang", "native"):
        out = tmp_path / f"export-{fmt}"
        assert cli_main(["export", str(head_dir), "--format", fmt, "--out", str(out)]) == 0
        back = load_export(out, target)
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), head.state_dict().values()))
    config = json.loads((tmp_path / "export-vllm" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert "dflash" in (tmp_path / "export-vllm" / "README.md").read_text()
    assert json.loads((tmp_path / "export-sglang" / "config.json").read_text())["dflash_config"]["target_layer_ids"] \
        == [i - 1 for i in meta["config"]["aux_layer_ids"]]
    assert "--speculative-algorithm DFLASH" in (tmp_path / "export-sglang" / "README.md").read_text()
    capsys.readouterr()
    assert cli_main(["export", str(head_dir), "--format", "trtllm", "--out", str(tmp_path / "no")]) == 2
    assert "the trtllm format cannot hold a dflash head; export it as one of vllm, sglang, llamacpp, native" in \
        capsys.readouterr().err

    # A DFlash export read as EAGLE-3 is refused in one line.
    with pytest.raises(SpecgraftError, match="DFlash draft .* not EAGLE-3"):
        from_engine("eagle3", "vllm", {}, config, {"num_layers": 1, "draft_vocab_size": 8}, {})


def test_dflash_recipe_errors_name_the_field(tmp_path):
    from specgraft.config import load_recipe

    base = {"model": {"name_or_path": "org/m"}, "data": {"path": "d.jsonl"}, "output": {"dir": "o"}}
    for head, message in (({"block_size": 1}, r"head\.block_size must be in \[2, inf\)"),
                          ({"sample_from_anchor": True}, r"head\.sample_from_anchor=true"),
                          ({"aux_layer_ids": [1, 99999]}, r"head\.aux_layer_ids\[1\] must be in"),
                          ({"draft_layers": "llama"}, r"head\.draft_layers must be one of target, qwen3")):
        path = tmp_path / "r.yaml"
        path.write_text(json.dumps({**base, "head": {"type": "dflash", **head}}))
        with pytest.raises(SpecgraftError, match=message):
            load_recipe(path)
    assert get_family("dflash").formats == ("vllm", "sglang", "llamacpp", "native")
