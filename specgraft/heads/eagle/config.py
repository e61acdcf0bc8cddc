"""The EAGLE-1/2 head's typed config: the recipe's ``head:`` section (``type: eagle``) and ``head_config.json``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from specgraft.config import check_positive, check_range
from specgraft.errors import SpecgraftError


@dataclass
class EagleConfig:
    """Hyper-parameters of an EAGLE-1/2 head."""

    type: ClassVar[str] = "eagle"

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

    def check_recipe(self, path: str) -> None:
        """The fields a recipe sets (the config loader calls this with the dotted path of the section)."""
        check_positive(f"{path}.num_layers", self.num_layers)
        check_range(f"{path}.feature_noise", self.feature_noise, 0.0, None)
        check_range(f"{path}.feature_loss_weight", self.feature_loss_weight, 0.0, None)
        check_range(f"{path}.logit_loss_weight", self.logit_loss_weight, 0.0, None)

    def resolve(self, target: Any) -> EagleConfig:
        """A complete copy for ``target`` (nothing depends on it; validated)."""
        config = dataclasses.replace(self)
        config.validate()
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
