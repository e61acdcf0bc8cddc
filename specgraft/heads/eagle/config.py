"""The EAGLE-1/2 head's typed config: the recipe's ``head:`` section (``type: eagle``) and ``head_config.json``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from specgraft.errors import SpecgraftError
from specgraft.utils.checks import check_positive, check_range


@dataclass
class EagleConfig:
    """Hyper-parameters of an EAGLE-1/2 head."""

    type: ClassVar[str] = "eagle"
    init_from: str | None = None
    """Training only: start from the head saved in this folder (the same family, trained on the same target
    architecture and tokenizer; a fine-tuned target of the same base is accepted with a warning naming what
    differs) instead of a fresh head: warm start or domain adaptation (often with a smaller
    training.learning_rate). Its sizes must be this section's. Not stored in the trained head's config."""

    num_layers: int = 1
    """Draft decoder layers of the target's family (the reference uses one)."""
    fc_bias: bool = False
    """Bias in fc (the Vicuna drafts had one; the Llama-3 drafts do not)."""
    feature_noise: float = 0.1
    """Half-width a of the uniform noise U(-a, a) added to input features during training."""
    feature_loss_weight: float = 1.0
    """Weight of the SmoothL1 next-feature loss."""
    logit_loss_weight: float = 0.1
    """Weight of the soft cross-entropy against the target distribution."""
    ttt_steps: int = 1
    """HASS harmonized context alignment (Zhang et al. 2024): training unrolls the draft for ttt_steps passes,
    pass s >= 1 feeding at every position the draft's own pass-(s-1) output feature (with EAGLE-3's training-time
    test attention, i.e. what the drafter's KV cache holds s tokens ahead), each pass with the loss above; 1 =
    plain EAGLE-1/2 training, HASS uses 3. Training only: the exported head's weights and format are the same."""
    loss_decay: float = 1.0
    """Pass s's loss weight is loss_decay**s (HASS weights its passes equally: 1.0)."""
    hass_topk: int = 0
    """HASS harmonized objective distillation: every pass's loss gains hass_topk_weight times
    ``-sum_{v in topK(p)} p_v log q_v`` over the hass_topk likeliest tokens of the target distribution p; 0 = off,
    HASS uses 10."""
    hass_topk_weight: float = 1.0
    """Weight of the top-K term when hass_topk > 0 (HASS: 1.0, next to its logit weight 0.1)."""

    def check_recipe(self, path: str) -> None:
        """The fields a recipe sets (the config loader calls this with the dotted path of the section)."""
        check_positive(f"{path}.num_layers", self.num_layers)
        check_range(f"{path}.feature_noise", self.feature_noise, 0.0, None)
        check_range(f"{path}.feature_loss_weight", self.feature_loss_weight, 0.0, None)
        check_range(f"{path}.logit_loss_weight", self.logit_loss_weight, 0.0, None)
        check_positive(f"{path}.ttt_steps", self.ttt_steps)
        check_range(f"{path}.loss_decay", self.loss_decay, 0.0, 1.0, low_open=True)
        check_range(f"{path}.hass_topk", self.hass_topk, 0, None)
        check_range(f"{path}.hass_topk_weight", self.hass_topk_weight, 0.0, None)

    def resolve(self, target: Any) -> EagleConfig:
        """A complete copy for ``target`` (nothing depends on it; validated, hass_topk against its vocabulary)."""
        config = dataclasses.replace(self)
        config.validate()
        check_hass_topk("eagle", config.hass_topk, config.hass_topk_weight, int(target.vocab_size))
        return config

    def validate(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise SpecgraftError(f"eagle num_layers must be a positive integer, got {self.num_layers!r}; "
                                 "set head.num_layers to 1 or more")
        if self.feature_noise < 0:
            raise SpecgraftError(f"eagle feature_noise must be >= 0, got {self.feature_noise}; e.g. 0.1")
        if self.feature_loss_weight < 0 or self.logit_loss_weight < 0:
            raise SpecgraftError("eagle loss weights must be >= 0; e.g. feature_loss_weight 1.0, "
                                 "logit_loss_weight 0.1")
        if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise SpecgraftError(f"eagle ttt_steps must be a positive integer, got {self.ttt_steps!r}; set "
                                 "head.ttt_steps to 1 (plain EAGLE) or more (HASS: 3)")
        if not 0.0 < float(self.loss_decay) <= 1.0:
            raise SpecgraftError(f"eagle loss_decay must be in (0, 1], got {self.loss_decay}; e.g. 1.0")
        check_hass_topk("eagle", self.hass_topk, self.hass_topk_weight, None)


def check_hass_topk(family: str, topk: int, weight: float, vocab_size: int | None) -> None:
    """The HASS top-K switches of ``family``'s config: ``topk`` an integer in [0, vocab_size], ``weight`` >= 0."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise SpecgraftError(f"{family} hass_topk must be an integer >= 0, got {topk!r}; set head.hass_topk to 0 "
                             "(off) or e.g. 10")
    if vocab_size is not None and topk > vocab_size:
        raise SpecgraftError(f"{family} hass_topk is {topk} but the draft vocabulary has {vocab_size} tokens; set "
                             f"head.hass_topk to at most {vocab_size} (HASS: 10)")
    if not float(weight) >= 0.0:  # also false for NaN
        raise SpecgraftError(f"{family} hass_topk_weight must be >= 0, got {weight}; e.g. 1.0")
