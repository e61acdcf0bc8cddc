"""Warm start (``head.init_from``): the trained head starts as the source head, and heads of another family or
another target architecture are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from specgraft.cli import main as cli_main
from specgraft.config import load_recipe
from specgraft.heads import load_head
from specgraft.target import load_target
from specgraft.train.trainer import HeadTrainer

from .test_trainer import tiny_run  # noqa: F401  (fixture)


def _source(write_recipe, tmp_path: Path, head: dict, name: str) -> Path:
    recipe = write_recipe(f"{name}.yaml", head=head, output={"dir": str(tmp_path / name)},
                          training={"max_steps": 4})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 0
    return tmp_path / name / "head"


def test_warm_start_reproduces_the_source_head_at_step_0(tiny_run, tmp_path):  # noqa: F811
    model_dir, write_recipe = tiny_run
    head_cfg = {"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 64}
    source = _source(write_recipe, tmp_path, head_cfg, "source")
    other = tmp_path / "other.txt"  # new data whose tokens would choose another draft vocabulary
    other.write_text("\n\n".join(f"Zebras {i} quietly graze near seven old windmills today." for i in range(60)))
    recipe = load_recipe(write_recipe("warm.yaml", head={**head_cfg, "init_from": str(source)},
                                      data={"path": str(other)}, output={"dir": str(tmp_path / "warm")}))
    trainer = HeadTrainer(recipe, show_progress=False)
    trainer.setup()
    saved = load_file(source / "head.safetensors")
    state = trainer.head.state_dict()
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k].cpu()) for k in saved)
    # The source's draft vocabulary is kept (its lm_head rows were trained for it), and the facts logged are its
    # coverage of the new data, not that of the vocabulary the new data would have chosen.
    from specgraft.heads.draft_vocab import build_draft_vocab, vocab_coverage
    from specgraft.train.step import loss_token_counts

    counts, heldout = loss_token_counts(trainer.dataset, trainer.target.vocab_size,
                                        recipe.head.draft_vocab_heldout_every)
    assert not torch.equal(build_draft_vocab(counts, 64)[1], saved["t2d"].bool())
    assert trainer.data_facts["draft_vocab_train_coverage"] == vocab_coverage(saved["t2d"], counts) < \
        build_draft_vocab(counts, 64)[2]
    # The same loss as the source head on a batch (EAGLE-3's draft vocabulary included).
    target = trainer.target
    reference = load_head(target, source)
    batch = next(iter(trainer.loader))
    out = target(batch["input_ids"], batch["attention_mask"], layers=reference.required_layers(), logits=True)
    with torch.no_grad():
        assert trainer.head.training_loss(batch, out).loss == reference.training_loss(batch, out).loss
    trainer.cleanup()
    # The trained head's config does not carry init_from; its recipe records where it started.
    assert cli_main(["train", str(tmp_path / "warm.yaml"), "training.max_steps=2", "--no-progress"]) == 0
    meta = json.loads((tmp_path / "warm" / "head" / "head_config.json").read_text())
    assert "init_from" not in meta["config"]
    assert yaml.safe_load((tmp_path / "warm" / "head" / "recipe.yaml").read_text())["head"]["init_from"] == \
        str(source)
    load_head(load_target(model_dir), tmp_path / "warm" / "head")


def test_warm_start_refuses_another_family_and_another_architecture(tiny_run, tmp_path, capsys):  # noqa: F811
    model_dir, write_recipe = tiny_run
    source = _source(write_recipe, tmp_path, {"type": "medusa", "num_heads": 2}, "medusa")
    capsys.readouterr()
    recipe = write_recipe("other.yaml", head={"type": "eagle3", "ttt_steps": 2, "init_from": str(source)},
                          output={"dir": str(tmp_path / "other")})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: head.init_from") and "is a medusa head but head.type is eagle3" in err[-1]

    # A target of another width: the head was trained for another architecture.
    from specgraft.testing import tiny_model, tiny_tokenizer

    wide = tmp_path / "wide"
    tiny_model("llama", hidden_size=96).save_pretrained(wide)
    tiny_tokenizer().save_pretrained(wide)
    recipe = write_recipe("wide.yaml", model={"name_or_path": str(wide)},
                          head={"type": "medusa", "num_heads": 2, "init_from": str(source)},
                          output={"dir": str(tmp_path / "wide-out")})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "another target architecture" in err[-1] and "hidden_size" in err[-1]
    assert not (tmp_path / "wide-out" / "head").exists()


def test_a_renamed_target_of_the_same_architecture_warns(tiny_run, tmp_path, caplog):  # noqa: F811
    model_dir, write_recipe = tiny_run
    source = _source(write_recipe, tmp_path, {"type": "medusa", "num_heads": 2}, "src")
    copy = tmp_path / "finetuned"
    import shutil

    shutil.copytree(model_dir, copy)
    recipe = write_recipe("ft.yaml", model={"name_or_path": str(copy)},
                          head={"type": "medusa", "num_heads": 2, "init_from": str(source)},
                          output={"dir": str(tmp_path / "ft")}, training={"max_steps": 2})
    with caplog.at_level("WARNING"):
        assert cli_main(["train", str(recipe), "--no-progress"]) == 0
    assert any("same architecture and tokenizer" in r.message and "name_or_path" in r.message
               for r in caplog.records)


def test_replay_share_is_honoured(tiny_run, tmp_path):  # noqa: F811
    """data.replay_path mixes rows of the original data in: they make data.replay_share of the training rows."""
    from specgraft.data import build_dataset
    from specgraft.data.dataset import mix_replay

    _, write_recipe = tiny_run
    original = tmp_path / "original.txt"
    original.write_text("\n\n".join(f"The red fox number {i} jumps over the lazy dog again." for i in range(40)))
    recipe = load_recipe(write_recipe("replay.yaml", data={"replay_path": str(original), "replay_share": 0.25},
                                      output={"dir": str(tmp_path / "replay")}))
    trainer = HeadTrainer(recipe, show_progress=False)
    trainer.setup()
    new, replayed = trainer.data_facts["new_rows"], trainer.data_facts["replay_rows"]
    assert replayed == round(0.25 / 0.75 * new) > 0 and len(trainer.dataset) == new + replayed
    assert replayed / len(trainer.dataset) == pytest.approx(0.25, abs=0.5 / len(trainer.dataset))
    import dataclasses

    replay_rows = build_dataset(dataclasses.replace(recipe.data, path=str(original), eval_fraction=0.0,
                                                    replay_path=None), trainer.target.tokenizer)["train"]
    pool = {tuple(r) for r in replay_rows["input_ids"]}
    assert all(tuple(r) in pool for r in trainer.dataset.select(range(new, len(trainer.dataset)))["input_ids"])
    trainer.cleanup()

    # Too few replay rows: the shuffled rows repeat whole; a share of 0 adds none.
    from datasets import Dataset

    train = Dataset.from_dict({"input_ids": [[i] for i in range(9)]})
    replay = Dataset.from_dict({"input_ids": [[100 + i] for i in range(2)]})
    mixed = mix_replay(train, replay, 0.5, seed=0)
    from collections import Counter

    assert len(mixed) == 18
    assert sorted(Counter(r[0] for r in mixed["input_ids"][9:]).items(), key=lambda kv: kv[0])[0][0] == 100
    assert sorted(Counter(r[0] for r in mixed["input_ids"][9:]).values()) == [4, 5]
    assert len(mix_replay(train, replay, 0.0, seed=0)) == 9


def test_the_same_recorded_weights_under_another_name_do_not_warn(tmp_path, caplog):
    """A shipped head names its target by Hub id while the user's copy is a local folder: when both record the same
    weights (a GGUF's checksum) the warm start is silent; another checksum still warns."""
    import dataclasses

    from specgraft.heads.head import warm_start
    from specgraft.testing import tiny_model, tiny_tokenizer

    folder = tmp_path / "target"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    target = load_target(folder)
    from specgraft.heads.medusa.model import MedusaHead

    def build() -> MedusaHead:
        return MedusaHead.build(target, MedusaHead.Config(num_heads=2).resolve(target))

    head = build()
    weights = "gguf:model.gguf sha256:0123"
    head.target_identity = dataclasses.replace(target.identity, source=weights, name_or_path="org/model")
    shipped = head.save_pretrained(tmp_path / "shipped")
    user_head = build()
    for source, warns in ((weights, False), ("gguf:model.gguf sha256:4567", True)):
        user_head.target_identity = dataclasses.replace(target.identity, source=source)
        caplog.clear()
        with caplog.at_level("WARNING"):
            facts = warm_start(user_head, shipped)
        assert any("same architecture and tokenizer" in r.message for r in caplog.records) is warns
        assert "name_or_path 'org/model'" in facts["warm_start_target_differs"]


def test_missing_replay_data_and_source_head_are_named(tiny_run, tmp_path, capsys):  # noqa: F811
    """A missing data.replay_path fails the run in one line naming that field (not data.path), before the main data
    is tokenised or anything is written; the dry run (whose stand-in trains on synthetic rows from a fresh head)
    passes but names each input the real run would fail on."""
    _, write_recipe = tiny_run
    recipe = write_recipe("noreplay.yaml", data={"replay_path": str(tmp_path / "gone.jsonl")},
                          head={"type": "eagle3", "ttt_steps": 2, "init_from": str(tmp_path / "no-head")},
                          output={"dir": str(tmp_path / "out")})
    assert cli_main(["train", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: data replay path {tmp_path / 'gone.jsonl'} does not exist; set data.replay_path to a "
                       ".json/.jsonl/.txt file, a folder saved with datasets' save_to_disk, or a folder of such files")
    assert not (tmp_path / "out" / "head").exists() and not (tmp_path / "out" / "checkpoints").exists()

    assert cli_main(["train", str(recipe), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "dry run passed except for its inputs" in captured.out
    warnings = [line for line in captured.err.splitlines() if line.startswith("WARNING: the real run will fail")]
    assert len(warnings) == 2
    assert "set data.replay_path" in warnings[0]
    assert warnings[1].endswith(f"head.init_from: head folder {tmp_path / 'no-head'} does not exist; pass a folder "
                                "written by save_pretrained/train")
