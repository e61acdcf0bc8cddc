"""The Medusa head's typed config: the recipe's ``head:`` section (``type: medusa``) and ``head_config.json``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from specgraft.errors import SpecgraftError
from specgraft.utils.checks import check_positive, check_range


@dataclass
class MedusaConfig:
    """Hyper-parameters of a set of Medusa heads."""

    type: ClassVar[str] = "medusa"
    init_from: str | None = None
    """Training only: start from the head saved in this folder (the same family, trained on the same target
    architecture and tokenizer; a fine-tuned target of the same base is accepted with a warning naming what
    differs) instead of a fresh head: warm start or domain adaptation (often with a smaller
    training.learning_rate). Its sizes must be this section's. Not stored in the trained head's config."""

    num_heads: int = 3
    """K: head k predicts the token k+2 positions ahead."""
    num_layers: int = 1
    """Residual blocks per head."""
    share_lm_head: bool = False
    """Borrow the target's frozen lm_head instead of one trainable vocabulary projection per head."""
    loss_decay: float = 0.8
    """Head k's loss weight is loss_decay**k."""
    hidden_size: int = 0
    """The target's hidden size h (resolved from the target: leave unset in recipes)."""
    vocab_size: int = 0
    """Rows of the target's lm_head V (resolved from the target: leave unset in recipes)."""
    topk_accuracy: list[list[float]] | None = None
    """Measured [K, topk] accuracies (P(head k's i-th choice is the right token)) used to build the static
    decoding tree; measured after training (leave unset in recipes)."""

    def check_recipe(self, path: str) -> None:
        """The fields a recipe sets (the config loader calls this with the dotted path of the section)."""
        check_positive(f"{path}.num_heads", self.num_heads)
        check_positive(f"{path}.num_layers", self.num_layers)
        check_range(f"{path}.loss_decay", self.loss_decay, 0.0, 1.0, low_open=True)

    def resolve(self, target: Any) -> MedusaConfig:
        """A complete copy sized for ``target`` (its lm_head's [V, h])."""
        weight = target.output_head.weight
        config = dataclasses.replace(self, hidden_size=int(weight.shape[1]), vocab_size=int(weight.shape[0]))
        config.validate()
        return config

    def validate(self) -> None:
        """Raise :class:`SpecgraftError` for a config that cannot make a head."""
        for name in ("num_heads", "num_layers", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fix = (f"set head.{name} to 1 or more" if name in ("num_heads", "num_layers")
                       else "build the head config from the target (MedusaConfig.resolve)")
                raise SpecgraftError(f"medusa {name} must be a positive integer, got {value!r}; {fix}")
        if not 0.0 < float(self.loss_decay) <= 1.0:
            raise SpecgraftError(f"medusa loss_decay must be in (0, 1], got {self.loss_decay}; e.g. 0.8")
        if self.topk_accuracy is not None:
            rows = self.topk_accuracy
            if len(rows) != self.num_heads or not rows or any(len(r) != len(rows[0]) or not r for r in rows):
                raise SpecgraftError(f"medusa topk_accuracy must be a [num_heads={self.num_heads}, topk] matrix; "
                                     "re-measure it with measure_topk_accuracy")
