"""DFlash hyper-parameters and their defaults resolved against a target.

Semantics follow speculators' ``DFlashSpeculatorConfig`` (vllm-project/speculators @c05b95b,
``src/speculators/models/dflash/config.py``): a block is ``[anchor, MASK x (block_size - 1)]``; with
``sample_from_anchor`` False (the only mode vLLM serves for DFlash) slot 0 is the anchor (the bonus token the target
just emitted) and slots ``1 .. block_size - 1`` are the speculative tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from specgraft.errors import SpecgraftError
from specgraft.heads.draft_vocab import check_draft_vocab_size
from specgraft.target import Target
from specgraft.utils.checks import MAX_LAYER_INDEX, check_choice, check_range

#: The smallest block: the anchor plus one predicted token.
MIN_BLOCK_SIZE = 2

#: Where the draft decoder layers come from: the target family's own class, or transformers' Qwen3 layer sized
#: like the target (the layout speculators and vLLM run DFlash drafts with, so any target's head can be exported).
DRAFT_LAYER_KINDS = ("target", "qwen3")


@dataclass
class DFlashConfig:
    """Hyper-parameters of a DFlash head: the recipe's ``head:`` section (``type: dflash``) and ``head_config.json``."""

    type: ClassVar[str] = "dflash"
    init_from: str | None = None
    """Training only: start from the head saved in this folder (the same family, trained on the same target
    architecture and tokenizer; a fine-tuned target of the same base is accepted with a warning naming what
    differs) instead of a fresh head: warm start or domain adaptation (often with a smaller
    training.learning_rate). Its sizes must be this section's. Not stored in the trained head's config."""

    block_size: int = 8
    """Slots per block: the anchor plus ``block_size - 1`` tokens drafted in one forward (>= 2)."""
    num_layers: int = 1
    """Draft decoder layers (built from the target family's own transformers decoder layer class)."""
    aux_layer_ids: list[int] = field(default_factory=list)
    """output_hidden_states indices of the target concatenated and projected by ``fc``; empty (unset): EAGLE-3's
    default (2, N//2, N-3) of the target. speculators calls them ``aux_hidden_state_layer_ids`` (same numbering)."""
    mask_token_id: int = -1
    """Token id embedded in the predicted slots; -1 (unset): the tokenizer's mask token, else the first embedding
    row the tokenizer never produces, else its unk token."""
    draft_vocab_size: int = 0
    """0: the draft predicts over the full target vocabulary with the target's own lm_head (borrowed, frozen).
    Else the size Vd of a reduced draft vocabulary with its own lm_head and ``d2t``/``t2d`` (as EAGLE-3)."""
    decay_gamma: float = 4.0
    """Slot ``k``'s loss weight is ``exp(-(k - 1) / decay_gamma)`` (speculators' ``dflash_decay_gamma``)."""
    max_anchors: int = 512
    """Anchors (blocks) sampled per training sequence (fewer when the sequence has fewer valid positions)."""
    sample_from_anchor: bool = False
    """Must be False: slot 0 is the anchor/bonus token (DSpark's True mode is not supported)."""
    draft_layers: str = "target"
    """``target``: decoder layers of the target's own family; ``qwen3``: transformers' Qwen3 decoder layer with
    the target's sizes (what speculators/vLLM serve; identical to ``target`` for Qwen3 targets)."""

    def validate(self) -> None:
        """Check the values on their own (target-dependent checks are in :func:`check_against_target`)."""
        for name, low in (("block_size", MIN_BLOCK_SIZE), ("num_layers", 1), ("max_anchors", 1),
                          ("draft_vocab_size", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SpecgraftError(f"dflash {name} must be an integer >= {low}, got {value!r}; set head.{name}"
                                     + (" (the anchor plus at least one drafted token)" if name == "block_size"
                                        else ""))
        if not self.aux_layer_ids:
            raise SpecgraftError("dflash aux_layer_ids is empty; list the target layers to fuse, e.g. [2, 16, 29], "
                                 "or leave head.aux_layer_ids unset for (2, N//2, N-3)")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in self.aux_layer_ids):
            raise SpecgraftError(f"dflash aux_layer_ids must be integers, got {self.aux_layer_ids!r}")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise SpecgraftError(f"dflash mask_token_id must be a token id >= 0, got {self.mask_token_id!r}; set "
                                 "head.mask_token_id to a token the tokenizer never produces")
        if not float(self.decay_gamma) > 0.0:
            raise SpecgraftError(f"dflash decay_gamma must be > 0, got {self.decay_gamma}; e.g. 4.0")
        if self.draft_layers not in DRAFT_LAYER_KINDS:
            raise SpecgraftError(f"dflash draft_layers must be one of {DRAFT_LAYER_KINDS}, got "
                                 f"{self.draft_layers!r}; use qwen3 for drafts that vLLM/speculators can serve")
        if self.sample_from_anchor:
            raise SpecgraftError("dflash sample_from_anchor=True (DSpark's mode: slot 0 also predicts) is not "
                                 "supported, and vLLM serves DFlash with slot 0 as the anchor; set it to false")

    def check_recipe(self, path: str) -> None:
        """The fields a recipe sets, before the target-dependent defaults (aux_layer_ids, mask_token_id) exist."""
        for name, low in (("block_size", MIN_BLOCK_SIZE), ("num_layers", 1), ("max_anchors", 1),
                          ("draft_vocab_size", 0)):
            check_range(f"{path}.{name}", getattr(self, name), low, None)
        check_range(f"{path}.decay_gamma", self.decay_gamma, 0.0, None, low_open=True)
        check_choice(f"{path}.draft_layers", self.draft_layers, DRAFT_LAYER_KINDS)
        for i, layer in enumerate(self.aux_layer_ids):
            check_range(f"{path}.aux_layer_ids[{i}]", layer, 0, MAX_LAYER_INDEX)
        if self.sample_from_anchor:
            raise SpecgraftError(f"{path}.sample_from_anchor=true (DSpark's mode: slot 0 also predicts) is not "
                                 "supported, and vLLM serves DFlash with slot 0 as the anchor; set it to false")

    def resolve(self, target: Target) -> DFlashConfig:
        """A complete copy for ``target``: default aux layers and mask token filled in, checked against it."""
        fields_given = dataclasses.asdict(self)
        if not fields_given["aux_layer_ids"]:
            fields_given.pop("aux_layer_ids")
        if fields_given["mask_token_id"] < 0:
            fields_given.pop("mask_token_id")
        return resolve_dflash_config(target, **fields_given)

    def check_against_target(self, target: Target) -> None:
        """Raise SpecgraftError when the config cannot work with ``target``."""
        self.validate()
        target.check_layer_indices(self.aux_layer_ids, what="dflash aux_layer_ids index")
        vocab = target.vocab_size
        if not self.mask_token_id < vocab:
            raise SpecgraftError(f"dflash mask_token_id {self.mask_token_id} is outside the target vocabulary "
                                 f"(0..{vocab - 1}); pick a token id below {vocab} that the tokenizer never produces")
        if self.draft_vocab_size:
            check_draft_vocab_size(self.draft_vocab_size, vocab)
        context = target.max_position_embeddings
        if context is not None and self.block_size > int(context):
            raise SpecgraftError(f"dflash block_size {self.block_size} is larger than the target's context "
                                 f"({context} positions); use a block_size of at most {context} (8 or 16 are usual)")

    @property
    def reduced_vocab(self) -> bool:
        """Whether the draft has its own (smaller) vocabulary with d2t/t2d."""
        return self.draft_vocab_size > 0


def default_aux_layer_ids(target: Target) -> list[int]:
    """EAGLE-3's fused-layer default (2, N//2, N-3), spread out for shallow targets (see Target)."""
    return [int(i) for i in target.default_eagle3_layers()]


def default_mask_token_id(target: Target) -> int:
    """A token id the target never has to produce: the tokenizer's mask token, else the first embedding row past
    the tokenizer's ids (padding rows such as Qwen3's), else the unk token. Raises SpecgraftError with how to pick
    one when none exists."""
    tokenizer = target.tokenizer
    vocab = target.vocab_size
    if tokenizer is None:
        raise SpecgraftError("dflash needs a mask_token_id and this target has no tokenizer to choose one from; "
                             "set head.mask_token_id to a token id the tokenizer never produces (e.g. a reserved "
                             "special token)")
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mask_id, int) and 0 <= mask_id < vocab:
        return mask_id
    if len(tokenizer) < vocab:
        return len(tokenizer)  # an embedding row no tokenizer id maps to
    special = {getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    unk_id = getattr(tokenizer, "unk_token_id", None)
    if isinstance(unk_id, int) and 0 <= unk_id < vocab and unk_id not in special:
        return unk_id
    raise SpecgraftError(f"dflash cannot choose a mask_token_id for {target.name_or_path}: its tokenizer has no mask "
                         "token, no unused embedding row and no unk token; set head.mask_token_id to a reserved "
                         "special token id (one the tokenizer never produces in text)")


def resolve_dflash_config(target: Target, **user_fields: Any) -> DFlashConfig:
    """A validated :class:`DFlashConfig` for ``target``: the given fields (None = default) with the target-dependent
    defaults (aux_layer_ids, mask_token_id) filled in."""
    known = {f.name for f in dataclasses.fields(DFlashConfig)}
    unknown = sorted(set(user_fields) - known)
    if unknown:
        raise SpecgraftError(f"unknown dflash fields {unknown}; known fields: {', '.join(sorted(known))}")
    fields_given = {k: v for k, v in user_fields.items() if v is not None}
    if "aux_layer_ids" in fields_given:
        fields_given["aux_layer_ids"] = list(fields_given["aux_layer_ids"])
    else:
        fields_given["aux_layer_ids"] = default_aux_layer_ids(target)
    if "mask_token_id" not in fields_given:
        fields_given["mask_token_id"] = default_mask_token_id(target)
    config = DFlashConfig(**fields_given)
    config.check_against_target(target)
    return config
