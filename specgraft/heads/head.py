"""Draft heads as adapters (PEFT-style): a head never owns the target, and saves only itself.

A head is built against a :class:`~specgraft.target.Target` (it may *borrow* the target's frozen embeddings,
final norm or lm_head by reference; borrowed modules are not registered as sub-modules, so they never appear in
``parameters()``, ``state_dict()`` or the saved file). ``save_pretrained`` writes

* ``head.safetensors``: the head's own weights (and buffers such as EAGLE-3's ``d2t``/``t2d``),
* ``head_config.json``: the head type, its hyper-parameters and the target's identity,
* ``recipe.yaml``: the resolved recipe it was trained with (when given),

and :func:`load_saved_head` rebuilds it (its class resolved by the caller: :func:`specgraft.heads.base.load_head`
looks it up in the registry) and refuses a head made for another target with a one-line message.

This module is the part of the head-family contract a family's ``model.py`` builds on: it never looks a family up.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specgraft.errors import SpecgraftError
from specgraft.target import Target, TargetIdentity, TargetOutput
from specgraft.utils.io import atomic_path, read_json_meta
from specgraft.utils.recipe_io import save_recipe

HEAD_CONFIG_NAME = "head_config.json"
HEAD_WEIGHTS_NAME = "head.safetensors"
RECIPE_NAME = "recipe.yaml"
ADAPTER_DIR = "adapter"  # Medusa-2's LoRA adapter (peft format) inside a head folder
FORMAT_VERSION = 1

#: Rank of a token the draft cannot propose (outside its vocabulary, or a depth it does not draft).
UNRANKED = 2**62


def token_ranks(logits: torch.Tensor, tokens: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """Rank of ``tokens`` [...] among ``logits`` [..., V'] (0 = the argmax; ties ranked first): how many candidates
    score strictly higher. ``columns`` [V] maps a token id to its logits column (-1: not a candidate, ranked
    :data:`UNRANKED`); None when the columns are the token ids."""
    index = tokens if columns is None else columns.to(tokens.device)[tokens]
    present = index >= 0
    score = logits.gather(-1, index.clamp_min(0).unsqueeze(-1))
    ranks = (logits > score).sum(-1)
    return torch.where(present, ranks, torch.full_like(ranks, UNRANKED))


def draft_columns(draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """The ``columns`` of :func:`token_ranks` for a draft whose logit column ``c`` is target id ``draft_ids[c]``:
    [vocab_size] long, each target id's column, -1 for ids outside the draft vocabulary; None when ``draft_ids`` is
    None or the whole vocabulary in order (the columns are the token ids)."""
    if draft_ids is None or (draft_ids.numel() == vocab_size
                             and torch.equal(draft_ids.cpu(), torch.arange(vocab_size))):
        return None
    columns = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    columns[draft_ids.long()] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return columns


def depth_ranks(logits_by_depth: Any, tokens: torch.Tensor, depth: int,
                columns: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, depth] ranks for :meth:`DraftHead.acceptance_ranks` from each depth's draft logits [B, T, V'] at the
    anchor (an iterable, read one depth at a time; depths it does not reach are :data:`UNRANKED`): depth ``d``
    ranks ``tokens[:, i + d]``, and anchors whose depth ``d`` is past the sequence's end are :data:`UNRANKED`."""
    batch, length = tokens.shape
    out = torch.full((batch, length, depth), UNRANKED, dtype=torch.long, device=tokens.device)
    for d, logits in enumerate(logits_by_depth, start=1):
        if d > depth:
            break
        if d >= length:
            continue
        out[:, : length - d, d - 1] = token_ranks(logits[:, : length - d].float(), tokens[:, d:], columns)
    return out


@dataclass
class HeadLoss:
    """What a head's training step returns: the scalar to minimise and detached metrics to log."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> 0-dim tensor, e.g. ``loss/head0``, ``top1/head0``; averaged over processes by the trainer."""


class DraftHead(nn.Module):
    """Base class of every draft head family.

    Subclasses define ``head_type``, a hyper-parameter dataclass ``Config`` (JSON-serialisable fields; the family's
    typed recipe section, with ``resolve(target)`` filling target-derived fields), and implement :meth:`build`,
    :meth:`required_layers` and :meth:`training_loss`.
    """

    head_type: ClassVar[str] = ""
    Config: ClassVar[type] = object
    #: Whether training needs the target's logits (soft targets) or only its hidden states.
    needs_target_logits: ClassVar[bool] = False

    def __init__(self, config: Any, target: Target) -> None:
        super().__init__()
        self.config = config
        self.target_identity: TargetIdentity = target.identity
        #: Whether ``training_loss`` computes its accuracy metrics (the trainer enables them only on logged steps,
        #: since a top-5 rank over the vocabulary costs as much as the loss itself on small heads).
        self.metrics_enabled = True
        #: The optimizer step being trained (set by the trainer's step; a head whose loss draws per-row random
        #: choices, such as DFlash's anchors, derives them from it so that they do not depend on batching).
        self.current_step = 0
        # Borrowed, frozen, never saved: hidden from nn.Module registration on purpose.
        object.__setattr__(self, "_target", target)

    # -- training --------------------------------------------------------------------------------------------
    def compiled_modules(self) -> list[nn.Module]:
        """The submodules ``training.compile`` compiles: the draft layers, whose many small element-wise ops
        (norms, rotary, gated MLP) fuse. Default none (a family whose training cost is its matmuls gains nothing)."""
        return []

    def wants_target_sample(self) -> bool:
        """Whether :meth:`prepare_from_target` needs the target's hidden states on a few training rows before
        training. Default no."""
        return False

    def prepare_from_target(self, hidden_states: dict[int, torch.Tensor], mask: torch.Tensor, *,
                            warm_started: bool = False) -> dict[str, Any]:
        """Data-dependent set-up from the target's hidden states (``required_layers``, [B, T, h]) on a few training
        rows, ``mask`` [B, T] their real tokens; called before training when :meth:`wants_target_sample`. Returns
        facts worth logging. Default nothing."""
        return {}

    def optimizer_groups(self, learning_rate: float) -> list[dict[str, Any]]:
        """AdamW parameter groups (``{"params": [...], "lr": float}``) of the trainable parameters at the recipe's
        ``learning_rate``. Default one group; a family overrides it to give some parameters a rate of their own."""
        return [{"params": trainable_parameters(self), "lr": learning_rate}]

    def compile_for_training(self) -> int:
        """``torch.compile`` each of :meth:`compiled_modules` in place (``nn.Module.compile``: parameter names and
        saved weights unchanged). Returns how many were compiled."""
        modules = self.compiled_modules()
        for module in modules:
            module.compile()
        return len(modules)

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def build(cls, target: Target, config: Any) -> DraftHead:
        """A freshly initialised head for ``target`` (subclasses initialise from the target's weights)."""
        return cls(config, target)

    @property
    def target(self) -> Target:
        return self._target

    def required_layers(self) -> tuple[int, ...]:
        """output_hidden_states indices of the target that training and drafting need."""
        raise NotImplementedError

    def prepare_from_data(self, token_counts: torch.Tensor | None, heldout_counts: torch.Tensor | None = None,
                          *, keep_vocabulary: bool = False) -> dict[str, Any]:
        """Called once by the trainer before training with the counts [V] of loss (assistant) tokens in the
        training data, and those of the rows held out of them (None when none are). Heads that derive state from
        data (EAGLE-3's draft vocabulary) set it here from ``token_counts`` and return facts worth logging (e.g.
        draft-vocab coverage, measured on ``heldout_counts``). ``keep_vocabulary``: the head was warm-started and
        keeps the vocabulary it came with (its output rows are trained for it); only its coverage of this data is
        reported. Default: nothing."""
        return {}

    def training_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                      num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        """Loss for one batch. ``batch`` has input_ids/attention_mask/loss_mask [B, T]; ``target_out`` has the
        hidden states of :meth:`required_layers` (and logits when ``needs_target_logits``).

        ``num_items`` (the :meth:`loss_item_counts` of the whole optimiser step, summed over its micro-batches and
        processes) replaces this batch's own counts as each term's denominator, so the trainer's sum of the
        micro-batch losses is the token mean of the whole batch; metrics are divided the same way. Without it each
        term is this batch's own mean."""
        raise NotImplementedError

    def loss_item_counts(self, batch: dict[str, torch.Tensor],
                         target_out: TargetOutput | None = None) -> dict[str, torch.Tensor] | None:
        """``term -> number of items`` (0-dim tensors) each loss term of :meth:`training_loss` averages over in
        ``batch``; cheap (masks and shifts). ``target_out`` is given only when :meth:`loss_item_counts_need_target`.
        None (the default) means the family does not count: the trainer then averages per-micro-batch means."""
        return None

    def loss_item_counts_need_target(self) -> bool:
        """Whether :meth:`loss_item_counts` needs the target's output (e.g. EAGLE-3's reduced draft vocabulary)."""
        return False

    # -- held-out acceptance -----------------------------------------------------------------------------------
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], target_out: TargetOutput, tokens: torch.Tensor,
                         depth: int) -> torch.Tensor | None:
        """Teacher-forced draft ranks for the trainer's simulated tau (:mod:`specgraft.train.acceptance_eval`):
        ``[B, T, depth]`` long, entry ``[b, i, d - 1]`` the rank (0 = the draft's top-1) of ``tokens[b, i + d]``
        among the draft's depth-``d`` candidates when drafting from anchor ``i`` (the target has read tokens
        ``0..i``; the drafter's root is token ``i + 1``, and the tokens between the root and depth ``d`` are the
        batch's own), :data:`UNRANKED` where the head cannot draft that token or that depth. ``tokens`` are the
        target's greedy tokens (``tokens[b, j]`` = its argmax after reading ``0..j``). Runs under ``no_grad``.
        None (the default): the family has no simulated acceptance."""
        return None

    # -- save / load -----------------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        """The config saved in head_config.json: the config's ``recipe_only_fields`` (default ``init_from``;
        Medusa: its ``lora`` too) left out."""
        data = dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else dict(self.config)
        for name in getattr(type(self.config), "recipe_only_fields", ("init_from",)):
            data.pop(name, None)
        return data

    def save_pretrained(self, path: str | Path, recipe: Any = None, extra: dict[str, Any] | None = None) -> Path:
        """Write the head (weights, config with the target identity, resolved recipe) atomically to ``path``."""
        path = Path(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        meta = {
            "format_version": FORMAT_VERSION,
            "head_type": self.head_type,
            "config": self.config_dict(),
            "target": self.target_identity.to_dict(),
            "num_parameters": sum(p.numel() for p in self.parameters()),
        }
        if extra:
            meta.update(extra)
        with atomic_path(path) as tmp:
            tmp.mkdir(parents=True)
            save_file(state, str(tmp / HEAD_WEIGHTS_NAME), metadata={"head_type": self.head_type})
            (tmp / HEAD_CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            if recipe is not None:
                save_recipe(recipe, tmp / RECIPE_NAME)
        return path

    @classmethod
    def subclass_of_type(cls, head_type: str) -> type[DraftHead]:
        """This class or the imported subclass of it whose ``head_type`` is ``head_type``."""
        pending: list[type[DraftHead]] = [cls]
        while pending:
            candidate = pending.pop()
            if candidate.head_type == head_type:
                return candidate
            pending.extend(candidate.__subclasses__())
        raise SpecgraftError(f"the saved head is a {head_type} head, not a {cls.head_type}; load it with "
                             "specgraft.heads.load_head")

    @classmethod
    def from_pretrained(cls, target: Target, path: str | Path) -> DraftHead:
        """Load a saved head onto ``target`` (refuses a head made for another target); its class is this one or,
        called on :class:`DraftHead`, the imported subclass whose ``head_type`` it names (``load_head`` looks every
        registered family up)."""
        head = load_saved_head(target, path, cls.subclass_of_type)
        if cls is not DraftHead and not isinstance(head, cls):
            raise SpecgraftError(f"{path} holds a {head.head_type} head, not {cls.head_type}; "
                                 f"use load_head() or {type(head).__name__}.from_pretrained")
        return head


def read_head_config(path: str | Path) -> dict[str, Any]:
    """The ``head_config.json`` of a saved head folder, with clear errors for a missing or broken one."""
    path = Path(path)
    cfg_file = path / HEAD_CONFIG_NAME
    if not path.is_dir():
        raise SpecgraftError(f"head folder {path} does not exist; pass a folder written by save_pretrained/train")
    if not cfg_file.is_file():
        raise SpecgraftError(f"{path} has no {HEAD_CONFIG_NAME}, so it is not a specgraft head folder; "
                             "pass the output folder of `specgraft train` or an exported `native` folder")
    meta = read_json_meta(cfg_file, ("head_type", "config", "target"),
                          "the head folder is corrupt or from another tool, re-save it")
    for key, kind in (("head_type", str), ("config", dict), ("target", dict)):
        if not isinstance(meta[key], kind):
            raise SpecgraftError(f"{cfg_file}: {key!r} is {type(meta[key]).__name__}, expected a JSON "
                                 f"{'string' if kind is str else 'object'}; the head folder is corrupt or was edited, "
                                 "re-save it")
    version = meta.get("format_version", FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise SpecgraftError(f"{cfg_file}: format_version {version!r} is not one this specgraft reads (1.."
                             f"{FORMAT_VERSION}); a newer specgraft wrote it, upgrade specgraft")
    if not isinstance(meta["target"].get("name_or_path"), str):
        raise SpecgraftError(f"{cfg_file}: the target has no name_or_path; the head folder is corrupt or was edited, "
                             "re-save it")
    return meta


def read_head_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a head folder's ``head.safetensors``, with one-line errors for a missing or broken file."""
    path = Path(path)
    weights = path / HEAD_WEIGHTS_NAME
    if not weights.is_file():
        raise SpecgraftError(f"{path} has no {HEAD_WEIGHTS_NAME}; the head folder is incomplete, re-save it")
    try:
        return load_file(str(weights))
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        raise SpecgraftError(f"{weights} is not a readable safetensors file ({type(exc).__name__}); "
                             "the file is truncated or corrupt, re-save the head") from None


class HeadWeightsMismatch(SpecgraftError):
    """A head's weights do not fit a head of its config: tensors missing, unexpected, or of another shape."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str], bad_shape: str | None,
                 shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
        super().__init__(message)
        self.missing, self.unexpected, self.bad_shape = missing, unexpected, bad_shape
        #: (found, expected) shape of ``bad_shape``.
        self.shapes = shapes


def load_checked_state(head: DraftHead, state: dict[str, torch.Tensor], where: str) -> None:
    """Load ``state`` into ``head`` after :func:`check_head_state`."""
    check_head_state(head, state, where)
    head.load_state_dict(state, strict=True)


def check_head_state(head: DraftHead, state: dict[str, torch.Tensor], where: str) -> None:
    """Check that ``state`` holds exactly ``head``'s tensors with their shapes (raises :class:`HeadWeightsMismatch`
    naming the first differences)."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadWeightsMismatch(f"{where} does not match a {head.head_type} head with this config "
                                  f"(missing {missing[:5]}, unexpected {unexpected[:5]}); the checkpoint is "
                                  "incomplete or its head_config.json was edited", missing, unexpected, None)
    for name, tensor in expected.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            found, want = tuple(state[name].shape), tuple(tensor.shape)
            raise HeadWeightsMismatch(f"{where}: tensor {name} has shape {found}, expected {want}; the head config "
                                      "and weights disagree", [], [], name, (found, want))


def config_from_dict(cls: type[DraftHead], raw_config: dict[str, Any], where: str) -> Any:
    """The typed config of ``cls`` from a saved dict; refuses fields this version does not know (written by a newer
    specgraft) and values the config cannot take."""
    if not dataclasses.is_dataclass(cls.Config):
        return raw_config
    unknown = set(raw_config) - {f.name for f in dataclasses.fields(cls.Config)}
    if unknown:
        raise SpecgraftError(f"{where} has unknown {cls.head_type} fields {sorted(unknown)}; it was written by a "
                             "newer specgraft, upgrade specgraft")
    try:
        return cls.Config(**raw_config)
    except TypeError as exc:
        raise SpecgraftError(f"{where} has an invalid {cls.head_type} config ({exc}); re-save the head") from None


def rebuild_as(cls: type[DraftHead], target: Target, raw_config: dict[str, Any], state: dict[str, torch.Tensor],
               where: str, load: bool = True) -> DraftHead:
    """``cls`` with its typed config from ``raw_config``, built on ``target``, holding exactly ``state``
    (:func:`check_head_state`); ``load=False`` only checks (see :func:`specgraft.heads.base.rebuild_head`)."""
    head = cls(config_from_dict(cls, raw_config, where), target)
    if load:
        load_checked_state(head, state, where)
    else:
        check_head_state(head, state, where)
    return head


def load_saved_head(target: Target, path: str | Path, resolve: Callable[[str], type[DraftHead]]) -> DraftHead:
    """Rebuild the head saved in ``path`` onto ``target`` as the class ``resolve(head_type)``: identity check,
    typed config, strict weights.

    A Medusa-2 head (an ``adapter/`` folder beside the weights) is built on a copy of ``target`` with its LoRA
    adapter merged, which the returned head's :attr:`~DraftHead.target` holds: decode with ``head.target``. The
    caller's ``target`` is left as it was."""
    path = Path(path)
    meta = read_head_config(path)
    TargetIdentity.from_dict(meta["target"]).require_compatible(target.identity, what=f"{meta['head_type']} head")
    cls = resolve(meta["head_type"])
    raw, where = meta["config"], f"{path}/{HEAD_CONFIG_NAME}"
    config_from_dict(cls, raw, where)  # before reading weights
    state = read_head_weights(path)
    if (path / ADAPTER_DIR).is_dir():
        target = merged_target(target, path / ADAPTER_DIR)
    head = rebuild_as(cls, target, raw, state, str(path / HEAD_WEIGHTS_NAME))
    head.to(device=target.device)
    return head


def merged_target(target: Target, adapter_path: Path) -> Target:
    """Medusa-2: the heads were trained with a LoRA adapter on the target, so they draft for the ADAPTED target
    (the model decoding and export must use). Returns a new frozen :class:`Target` whose model is a copy of
    ``target``'s with the adapter merged (peft ``merge_and_unload``); ``target`` itself is not changed."""
    import copy
    import logging

    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(copy.deepcopy(target.model), str(adapter_path))
    merged = Target(peft_model.merge_and_unload(), target.tokenizer, name_or_path=target.name_or_path,
                    source=target.identity.source)
    logging.getLogger(__name__).info("merged the LoRA adapter %s into a copy of the target", adapter_path)
    return merged


#: The adapter's weights inside ``adapter/`` (peft's own file name).
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def save_adapter(peft_model: nn.Module, head_dir: Path) -> None:
    """Write Medusa-2's LoRA adapter (peft format) into ``head_dir/adapter``."""
    peft_model.save_pretrained(str(Path(head_dir) / ADAPTER_DIR), safe_serialization=True)


def load_adapter_state(peft_model: nn.Module, head_dir: Path) -> None:
    """Load the adapter :func:`save_adapter` wrote into the (already wrapped) ``peft_model``, e.g. on resume."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(peft_model, load_file(str(Path(head_dir) / ADAPTER_DIR / ADAPTER_WEIGHTS_NAME)))


def warm_start(head: DraftHead, path: str | Path) -> dict[str, Any]:
    """Load the weights (and buffers: EAGLE-3's draft vocabulary) of the head saved in ``path`` into ``head``
    (``head.init_from``). Refuses in one line a head of another family, one trained for another target architecture
    or tokenizer, or one of other sizes; a target that differs only in name or weights' source (a fine-tuned
    target of the same base) is accepted with a warning naming the difference. Returns facts worth logging."""
    import logging

    path = Path(path)
    meta = read_head_config(path)
    where = f"head.init_from {path}"
    if meta["head_type"] != head.head_type:
        raise SpecgraftError(f"{where} is a {meta['head_type']} head but head.type is {head.head_type}; start from a "
                             f"{head.head_type} head, or set head.type={meta['head_type']} with its settings")
    source = TargetIdentity.from_dict(meta["target"])
    diffs = source.mismatches(head.target_identity)
    if diffs:
        raise SpecgraftError(f"{where} was trained for another target architecture ({'; '.join(diffs)}); a head "
                             "warm-starts only on its own target's architecture and tokenizer: train a fresh head "
                             "(drop head.init_from)")
    differs = [f"{name} {getattr(source, name)!r} vs {getattr(head.target_identity, name)!r}"
               for name in ("name_or_path", "model_type", "source")
               if getattr(source, name) != getattr(head.target_identity, name)]
    # The same recorded weights (a GGUF's checksum) under another name is the same target moved or renamed (a
    # shipped head names its Hub id): nothing to warn about.
    same_weights = source.source is not None and source.source == head.target_identity.source
    if differs and not same_weights:
        logging.getLogger(__name__).warning(
            "%s was trained on another target of the same architecture and tokenizer (%s): warm-starting on it, as "
            "for a fine-tuned target of the same base", where, "; ".join(differs))
    state = read_head_weights(path)
    try:
        load_checked_state(head, state, where)
    except HeadWeightsMismatch as exc:
        raise SpecgraftError(f"{exc}; set this recipe's head: section to the source head's sizes (its "
                             f"{HEAD_CONFIG_NAME} config)") from None
    facts: dict[str, Any] = {"warm_started_from": str(path)}
    if differs:
        facts["warm_start_target_differs"] = "; ".join(differs)
    return facts


def load_head_weights(head: DraftHead, head_dir: Path) -> None:
    """Load a head folder's weights into the already built ``head`` (``--resume``: the optimizer holds its
    parameters), checked as :func:`rebuild_head` checks them."""
    load_checked_state(head, read_head_weights(head_dir), str(Path(head_dir) / HEAD_WEIGHTS_NAME))


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
