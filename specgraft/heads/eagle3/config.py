"""The EAGLE-3 head's typed config: the recipe's ``head:`` section (``type: eagle3``) and ``head_config.json``."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from specgraft.errors import ConfigError, SpecgraftError
from specgraft.heads.draft_vocab import check_draft_vocab_size, default_draft_vocab_size
from specgraft.heads.eagle.config import check_hass_topk
from specgraft.utils.checks import MAX_LAYER_INDEX, check_positive, check_range

logger = logging.getLogger(__name__)


#: ``head.feature_scaling`` values: raw features, one scale per fused layer, one per hidden dimension.
FEATURE_SCALINGS = ("none", "layer", "dim")
#: ``head.layer_init`` values: a fresh random draft layer, or the target's layer that reads the deepest fused one.
LAYER_INITS = ("random", "target")


@dataclass
class Eagle3Config:
    """Hyper-parameters of an EAGLE-3 head."""

    type: ClassVar[str] = "eagle3"
    init_from: str | None = None
    """Training only: start from the head saved in this folder (the same family, trained on the same target
    architecture and tokenizer; a fine-tuned target of the same base is accepted with a warning naming what
    differs) instead of a fresh head: warm start or domain adaptation (often with a smaller
    training.learning_rate). Its sizes must be this section's. Not stored in the trained head's config."""

    feature_layers: list[int] | None = None
    """output_hidden_states indices of the target fused by fc; unset: (2, N//2, N-3) of the target."""
    draft_vocab_size: int | None = None
    """Vd, the size of the reduced draft vocabulary; unset: min(32000, target vocab)."""
    num_layers: int = 1
    """Draft layers: the midlayer plus num_layers - 1 plain decoder layers."""
    fc_bias: bool = False
    """Bias in the fc fusion layer."""
    ttt_steps: int = 7
    """Training-time-test unrolled steps S."""
    loss_decay: float = 0.8
    """Step s's loss weight is loss_decay**s."""
    hass_topk: int = 0
    """HASS harmonized objective distillation (Zhang et al. 2024): every TTT step's loss gains hass_topk_weight
    times ``-sum_{v in topK(p)} p_v log q_v`` over the hass_topk likeliest tokens of the target distribution p
    (restricted to the draft vocabulary, as the soft cross-entropy); 0 = off, HASS uses 10. Training only: the
    exported head's weights and format are the same."""
    hass_topk_weight: float = 1.0
    """Weight of the top-K term when hass_topk > 0 (HASS: 1.0)."""
    target_temperature: float = 1.0
    """Training only: the soft targets are the target's distribution at this temperature, ``softmax(logits / T)``
    (restricted to the draft vocabulary; HASS's top-K term uses the same). Below 1 sharpens it toward the target's
    top-1, the token greedy verification accepts, so a small budget is spent less on the ranking of the tail; 1 is
    EAGLE-3's loss."""
    feature_loss_weight: float = 0.0
    """Training only: weight of a feature-alignment term. Training-time-test step s >= 1 drafts from step s-1's
    output where step 0 drafts from fc's fused target features; this term pulls step s's output at index i toward
    fc's output on the target's features at position i+s+1 (held fixed), as a squared error relative to that
    feature's size, averaged over real tokens and weighted loss_decay**s like the cross-entropy (steps 0..S-2). The
    draft then feeds itself inputs like the ones it was trained on from the target (EAGLE-1's feature regression,
    on EAGLE-3's recurrence). 0 is EAGLE-3's loss."""
    lm_head_lr_scale: float = 1.0
    """Training only: the draft lm_head's learning rate as a multiple of training.learning_rate. Its rows start from
    the target's output rows, and AdamW moves every row at about the full rate, those of tokens the data rarely
    shows included; below 1 keeps more of the target's output space, 0 freezes the lm_head at the target's rows."""
    feature_scaling: str = "none"
    """Training only: ``layer`` multiplies each fused target layer's hidden state, before fc, by the power of two
    nearest to 1 / its typical size (the median per-token RMS over a few training rows), ``dim`` each hidden
    dimension by 1 / its typical size (the root of its median square), ``none`` feeds them raw. A target's deep
    layers are many times larger than its shallow ones, so raw, AdamW learns the deep layers' share of fc first;
    scaled, every layer (or dimension) learns at the same speed. The scale is folded into fc's saved weight: the
    trained head, its checkpoints and exports are ordinary EAGLE-3 weights."""
    layer_init: str = "random"
    """Training only, a fresh head: ``target`` starts the draft from the target itself. fc starts by passing the
    deepest fused layer's hidden state through unchanged (the other layers' columns at zero), and the midlayer is a
    copy of the target's decoder layer that reads that hidden state (the last layer when it is the target's
    output), its q/k/v columns for the token embedding at zero; further draft layers copy the target's next
    layers. At step 0 the fresh draft then computes exactly what the target's next layer computes, and training
    starts from the target's own attention and MLP weights instead of noise. ``random`` (the default) initialises
    the draft layers as the family initialises a new layer. A warm start (init_from) keeps its source's weights."""
    draft_vocab_heldout_every: int = 20
    """Every n-th training row (5% by default) is left out of the draft-vocabulary counts, and the reported
    draft_vocab_coverage is measured on its loss tokens (coverage on the rows the vocabulary was counted from reads
    high); 0 counts every row and reports only that training coverage."""

    def check_recipe(self, path: str) -> None:
        """The fields a recipe sets (the config loader calls this with the dotted path of the section)."""
        check_positive(f"{path}.num_layers", self.num_layers)
        check_positive(f"{path}.ttt_steps", self.ttt_steps)
        check_range(f"{path}.loss_decay", self.loss_decay, 0.0, 1.0, low_open=True)
        check_range(f"{path}.hass_topk", self.hass_topk, 0, None)
        check_range(f"{path}.hass_topk_weight", self.hass_topk_weight, 0.0, None)
        check_range(f"{path}.target_temperature", self.target_temperature, 0.0, None, low_open=True)
        check_range(f"{path}.feature_loss_weight", self.feature_loss_weight, 0.0, None)
        check_range(f"{path}.lm_head_lr_scale", self.lm_head_lr_scale, 0.0, None)
        if self.feature_scaling not in FEATURE_SCALINGS:
            raise ConfigError(f"{path}.feature_scaling is {self.feature_scaling!r}; use one of "
                              f"{', '.join(FEATURE_SCALINGS)}")
        if self.layer_init not in LAYER_INITS:
            raise ConfigError(f"{path}.layer_init is {self.layer_init!r}; use one of {', '.join(LAYER_INITS)}")
        if self.draft_vocab_size is not None:
            check_positive(f"{path}.draft_vocab_size", self.draft_vocab_size)
        if self.draft_vocab_heldout_every < 0 or self.draft_vocab_heldout_every == 1:
            raise ConfigError(f"{path}.draft_vocab_heldout_every is {self.draft_vocab_heldout_every}; use 0 (no "
                              "hold-out) or 2 or more (every n-th row held out)")
        if self.feature_layers is not None:
            # Checked against the target's depth when it is loaded; this bound keeps a typo from building a
            # stand-in with that many layers first (the deepest open models have a few hundred).
            for i, layer in enumerate(self.feature_layers):
                check_range(f"{path}.feature_layers[{i}]", layer, 0, MAX_LAYER_INDEX)

    def resolve(self, target: Any) -> Eagle3Config:
        """A complete copy for ``target``: default feature layers and draft vocabulary size filled in, checked
        against its depth and vocabulary."""
        layers = self.feature_layers
        if layers is None:
            layers = list(target.default_eagle3_layers())
            if target.num_layers <= 6:
                logger.warning("target %s has only %d layers, where (2, N//2, N-3) would repeat a layer; EAGLE-3 "
                               "fuses layers %s instead", target.name_or_path, target.num_layers, layers)
        layers = [int(i) for i in layers]
        target.check_layer_indices(layers, what="head.feature_layers index")
        vocab = self.draft_vocab_size
        vocab = default_draft_vocab_size(target.vocab_size) if vocab is None else int(vocab)
        check_draft_vocab_size(vocab, target.vocab_size)
        config = dataclasses.replace(self, feature_layers=layers, draft_vocab_size=vocab)
        config.validate()
        return config

    def validate(self) -> None:
        if not self.feature_layers:
            raise SpecgraftError("eagle3 feature_layers is empty; list the target layers to fuse, e.g. [2, 16, 29], "
                                 "or leave head.feature_layers unset for (2, N//2, N-3)")
        for name in ("num_layers", "ttt_steps", "draft_vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecgraftError(f"eagle3 {name} must be a positive integer, got {value!r}; set head.{name}")
        if not 0.0 < float(self.loss_decay) <= 1.0:
            raise SpecgraftError(f"eagle3 loss_decay must be in (0, 1], got {self.loss_decay}; e.g. 0.8")
        check_hass_topk("eagle3", self.hass_topk, self.hass_topk_weight, self.draft_vocab_size)
        if not 0.0 < float(self.target_temperature) < float("inf"):
            raise SpecgraftError(f"eagle3 target_temperature must be a positive number, got "
                                 f"{self.target_temperature}; e.g. 0.5, or 1 for the target's own distribution")
        if not 0.0 <= float(self.feature_loss_weight) < float("inf"):
            raise SpecgraftError(f"eagle3 feature_loss_weight must be 0 (off) or positive, got "
                                 f"{self.feature_loss_weight}; e.g. 1.0")
        if self.feature_scaling not in FEATURE_SCALINGS:
            raise SpecgraftError(f"eagle3 feature_scaling must be one of {', '.join(FEATURE_SCALINGS)}, got "
                                 f"{self.feature_scaling!r}; set head.feature_scaling")
        if self.layer_init not in LAYER_INITS:
            raise SpecgraftError(f"eagle3 layer_init must be one of {', '.join(LAYER_INITS)}, got "
                                 f"{self.layer_init!r}; set head.layer_init")
