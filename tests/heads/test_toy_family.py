"""A new head family is one folder declaring one :class:`HeadFamily`: this test module plays that folder for a toy
family (a single vocabulary projection that predicts the token two positions ahead, drafting a chain of one),
registers its ``FAMILY``, and trains, evaluates (losslessly) and exports it through the CLI without touching any
package file.

What a family declares (the list CONTRIBUTING.md walks through): a config dataclass (``type`` class attribute,
``check_recipe``, ``resolve``, ``validate``), a :class:`DraftHead` subclass, a drafter with its setting functions,
and optionally a tuning search, engine exporters and card text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from specgraft.cli import main as cli_main
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.tree import DraftTree
from specgraft.errors import SpecgraftError
from specgraft.export import load_export
from specgraft.export.engine import EngineCheckpoint
from specgraft.export.layouts import Dims, TensorRule
from specgraft.heads.base import load_head
from specgraft.heads.family import EngineExporter, HeadFamily
from specgraft.heads.head import DraftHead, HeadLoss
from specgraft.heads.losses import masked_cross_entropy
from specgraft.heads.registry import builtin_family_modules, get_family, register_head, unregister_head
from specgraft.target import Target, TargetOutput, load_target
from specgraft.testing import TINY_CORPUS_TEXT, recipe_writer, tiny_model, tiny_tokenizer

NAME = "toy_skip"


@dataclass
class ToyConfig:
    """The toy family's recipe section and saved config."""

    type: ClassVar[str] = NAME

    hidden_size: int = 0
    """The target's hidden size (resolved)."""
    vocab_size: int = 0
    """The target's vocabulary size (resolved)."""

    def check_recipe(self, path: str) -> None:
        if self.hidden_size < 0 or self.vocab_size < 0:
            raise SpecgraftError(f"{path}: sizes are resolved from the target; leave them unset")

    def resolve(self, target: Target) -> ToyConfig:
        config = dataclasses.replace(self, hidden_size=target.hidden_size, vocab_size=target.vocab_size)
        config.validate()
        return config

    def validate(self) -> None:
        if self.hidden_size <= 0 or self.vocab_size <= 0:
            raise SpecgraftError("toy sizes must be positive; resolve the config against the target")


class ToyHead(DraftHead):
    """logits(t + 2) = proj(h_t), h_t the target's last hidden state."""

    head_type = NAME
    Config = ToyConfig

    def __init__(self, config: ToyConfig, target: Target) -> None:
        super().__init__(config, target)
        self.proj = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=target.device)

    def required_layers(self) -> tuple[int, ...]:
        return (self.target.num_layers,)

    @staticmethod
    def _mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["loss_mask"][:, 2:] * batch["attention_mask"][:, 2:]  # [B, T-2]: token t+2 is a loss token

    def loss_item_counts(self, batch: dict[str, torch.Tensor], target_out: Any = None) -> dict[str, torch.Tensor]:
        return {"tokens": self._mask(batch).sum()}

    def training_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                      num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        hidden = target_out.hidden_states[self.target.num_layers][:, :-2]  # [B, T-2, h]
        labels = batch["input_ids"][:, 2:]  # [B, T-2]
        loss = masked_cross_entropy(self.proj(hidden.float()), labels, self._mask(batch),
                                    None if num_items is None else num_items["tokens"])
        return HeadLoss(loss, {"loss/toy": loss.detach()})


class ToyDrafter(Drafter):
    """A chain of one: the argmax of the head on the state that produced the root."""

    def __init__(self, head: ToyHead) -> None:
        self.head = head
        self.needs_hidden_states = head.required_layers()

    def propose(self, ctx: DraftContext) -> DraftTree:
        states = ctx.hidden_states[self.needs_hidden_states[0]]
        if states.shape[0] == 0:
            return DraftTree.empty(ctx.token_ids.device)
        with torch.no_grad():
            token = int(self.head.proj(states[-1].float()).argmax())
        return DraftTree.from_lists([token], [-1], device=ctx.token_ids.device)


def toy_to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: Any, base_model: str,
                  speculative_tokens: int) -> EngineCheckpoint:
    dims = Dims(hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]))
    return EngineCheckpoint({"skip_head.weight": state["proj.weight"]},
                            {"architectures": ["ToySkip"], "hidden_size": dims.hidden, "vocab_size": dims.vocab}, dims)


def toy_from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                    cfg: Mapping[str, Any], want: Mapping[str, torch.Tensor], used: set[str],
                    target_lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    used.add("skip_head.weight")
    return {"proj.weight": tensors["skip_head.weight"]}


def _setting(*, mode: str | None = None, k: int | None = None, tree_size: int | None = None,
             top_k: int | None = None) -> dict[str, Any]:
    if any(v is not None for v in (k, tree_size, top_k)) or mode not in (None, "chain"):
        raise SpecgraftError("the toy drafter drafts a chain of one; it takes no setting flags")
    return {"mode": "chain"}


#: What the toy folder's ``__init__.py`` would declare.
FAMILY = HeadFamily(
    name=NAME, config=ToyConfig, head=ToyHead, drafter=lambda head, setting: ToyDrafter(head),
    setting_from_flags=_setting, describe_drafter=lambda drafter: {"k": 1, "tree_size": 2},
    exporters={"vllm": EngineExporter("model.safetensors", (TensorRule("skip_head.weight", ("vocab", "hidden")),),
                                      toy_to_engine, toy_from_engine, ("hidden_size", "vocab_size"))},
    description="toy: one projection, a chain of one")


@pytest.fixture
def toy_family():
    family = register_head(FAMILY)
    yield family
    unregister_head(NAME)


def test_a_taken_name_is_refused(toy_family):
    with pytest.raises(SpecgraftError, match=f"a head family named '{NAME}' is already registered"):
        register_head(dataclasses.replace(FAMILY, drafter=ToyDrafter, describe_drafter=dict))
    with pytest.raises(SpecgraftError, match="already registered"):
        register_head(dataclasses.replace(FAMILY, name=get_family("medusa").name))
    assert get_family(NAME) is toy_family and toy_family.formats == ("vllm", "native")


def test_toy_family_trains_evaluates_and_exports_through_the_cli(toy_family, tmp_path, capsys):
    target_dir = tmp_path / "target"
    tiny_model("llama").save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    (tmp_path / "corpus.txt").write_text(TINY_CORPUS_TEXT)
    recipe = recipe_writer(tmp_path, {
        "model": {"name_or_path": str(target_dir)},
        "data": {"path": str(tmp_path / "corpus.txt"), "format": "text", "max_length": 64, "packing": True,
                 "cache_dir": str(tmp_path / "cache")},
        "head": {"type": NAME},
        "training": {"max_steps": 30, "micro_batch_size": 4, "learning_rate": 3e-2, "checkpoint_every": 30,
                     "log_every": 10, "seed": 0},
        "output": {"dir": str(tmp_path / "run")},
        "tracking": {"backend": "none"},
    })()
    assert cli_main(["train", str(recipe), "--no-progress"]) == 0
    head_dir = tmp_path / "run" / "head"
    meta = json.loads((head_dir / "head_config.json").read_text())
    assert meta["head_type"] == NAME and meta["config"] == {"hidden_size": 64, "vocab_size": 320}

    target = load_target(target_dir)
    head = load_head(target, head_dir)
    assert isinstance(head, ToyHead)
    # It learned the corpus: top-1 of token t+2 well above chance (1/320) on training text.
    ids = torch.tensor([target.tokenizer(TINY_CORPUS_TEXT[:400])["input_ids"][:60]])
    hidden = target(ids, layers=head.required_layers(), logits=False).hidden_states[target.num_layers]
    with torch.no_grad():
        accuracy = (head.proj(hidden[0, :-2]).argmax(-1) == ids[0, 2:]).float().mean().item()
    assert accuracy > 0.3

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "toy", "turns": [t]}) + "\n"
                               for i, t in enumerate(["Once upon a time", "The cat sat"])))
    assert cli_main(["eval", "--target", str(target_dir), "--head", str(head_dir), "--prompts", str(prompts),
                     "--out", str(tmp_path / "eval"), "--max-new-tokens", "12", "--warmup", "0",
                     "--no-progress"]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["drafter"]["type"] == NAME
    assert report["overall"]["lossless_passed"] is True and report["overall"]["lossless_checked"] == 2
    assert report["overall"]["tau"] >= 1.0

    for fmt in ("vllm", "native"):
        out = tmp_path / f"export-{fmt}"
        assert cli_main(["export", str(head_dir), "--format", fmt, "--out", str(out)]) == 0
        back = load_export(out, target)
        assert torch.equal(back.proj.weight, head.proj.weight)
    assert cli_main(["export", str(head_dir), "--format", "sglang", "--out", str(tmp_path / "no")]) == 2
    assert f"the sglang format cannot hold a {NAME} head; export it as one of vllm, native" in capsys.readouterr().err


def test_files_a_new_family_needs() -> None:
    """The built-in families follow the same shape: one folder each, found by scanning ``specgraft/heads``, whose
    ``__init__.py`` declares its ``FAMILY`` (no registration call, no list of names elsewhere), with the same files;
    EAGLE-3 drafts and tunes with EAGLE's drafter and search, imported."""
    import specgraft.heads as heads

    root = Path(heads.__file__).parent
    found = {module.rsplit(".", 1)[1] for module in builtin_family_modules()}
    assert found == {p.parent.name for p in root.glob("*/__init__.py")}
    assert {"medusa", "eagle", "eagle3", "dflash"} <= found
    for name in found:
        folder = root / name
        init = (folder / "__init__.py").read_text()
        assert init.count("FAMILY = HeadFamily(") == 1 and "registry" not in init
        family = get_family(name)
        for member, file in (("head", "model"), ("config", "config"), ("drafter", "drafter"), ("search", "tune"),
                             ("exporters", "export")):
            value = getattr(family, member)
            module = (type(value) if member == "search" else next(iter(value.values())).to_engine
                      if member == "exporters" else value).__module__
            owner = module.split(".")[2]
            assert module.endswith(f".{file}"), (name, member, module)
            # A family's member lives in its own folder's file of that name, or is another family's, imported.
            assert owner == name or (folder / f"{file}.py").exists() is False, (name, member, module)
            if owner == name:
                assert (folder / f"{file}.py").is_file()
