"""The Medusa head's typed config: the recipe's ``head:`` section (``type: medusa``) and ``head_config.json``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from specgraft.errors import SpecgraftError
from specgraft.utils.checks import check_positive, check_range


@dataclass
class LoraConfig:
    """Medusa-2: a LoRA adapter on the target trained jointly with the heads (peft)."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lm_loss_weight: float = 1.0
    head_loss_weight: float = 0.2
    """lambda in L_LM + lambda * L_heads."""
    kl_weight: float = 1.0
    """Self-distillation KL against the adapter-disabled target, so the target's outputs do not drift."""
    head_warmup_steps: int = 0
    """Train the heads alone for this many steps before the adapter joins."""
    learning_rate: float | None = None
    """Adapter learning rate (default: training.learning_rate / ``learning_rate_divisor``)."""
    learning_rate_divisor: float = 4.0
    """When ``learning_rate`` is unset, the adapter trains at training.learning_rate divided by this (the target's
    weights move more slowly than the freshly initialised heads)."""

    def validate(self, path: str) -> None:
        check_positive(f"{path}.r", self.r)
        check_positive(f"{path}.alpha", self.alpha)
        check_range(f"{path}.dropout", self.dropout, 0.0, 1.0, high_open=True)
        check_range(f"{path}.head_warmup_steps", self.head_warmup_steps, 0, None)
        for name in ("lm_loss_weight", "head_loss_weight", "kl_weight"):
            check_range(f"{path}.{name}", getattr(self, name), 0.0, None)
        if self.learning_rate is not None:
            check_range(f"{path}.learning_rate", self.learning_rate, 0.0, None, low_open=True)
        check_range(f"{path}.learning_rate_divisor", self.learning_rate_divisor, 0.0, None, low_open=True)

    def adapter_learning_rate(self, base_learning_rate: float) -> float:
        """The adapter's learning rate given training.learning_rate."""
        return self.learning_rate if self.learning_rate is not None else base_learning_rate / self.learning_rate_divisor


@dataclass
class MedusaConfig:
    """Hyper-parameters of a set of Medusa heads."""

    type: ClassVar[str] = "medusa"
    recipe_only_fields: ClassVar[tuple[str, ...]] = ("init_from", "lora")
    """Training-only fields, left out of the saved head's config."""
    legacy_recipe_sections: ClassVar[tuple[str, ...]] = ("lora",)
    """Recipe-level sections older recipes held and the config loader moves into this section (with a
    deprecation warning): Medusa-2's ``lora:``."""
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Medusa-2: train a LoRA adapter on the target jointly with the heads (``head.lora.enabled``). Training only:
    the adapter is saved beside the heads (``adapter/``), not in the head's config."""

    @property
    def find_unused_parameters(self) -> bool:
        """Whether a training step may leave trained parameters unused (Medusa-2's adapter, during the heads'
        warm-up): DDP must then look for them."""
        return self.lora.enabled

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
