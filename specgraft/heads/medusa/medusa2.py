"""Medusa-2: Medusa heads trained jointly with a LoRA adapter on the target (peft).

Loss (after the heads' warm-up)::

    L = w_lm * CE(adapted target, next token) + lambda * L_heads + w_kl * KL(p_base || p_adapted)

where ``p_base`` is the adapter-disabled target (self-distillation, so the target's own outputs do not drift).
During the first ``head.lora.head_warmup_steps`` steps only the heads train (the target runs without grad).
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from torch import nn

from specgraft.errors import SpecgraftError
from specgraft.heads.family import FamilyTrainStep
from specgraft.heads.head import ADAPTER_DIR, DraftHead, HeadLoss  # noqa: F401 (re-exported)
from specgraft.heads.losses import masked_cross_entropy, masked_mean
from specgraft.target import Target, TargetOutput


def available_linear_names(model: nn.Module) -> list[str]:
    """Short names of the Linear modules in ``model`` (what LoRA ``target_modules`` may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})


def apply_lora(target: Target, lora_cfg: Any) -> nn.Module:
    """Wrap ``target.model`` with a LoRA adapter in place; refuses target modules the model does not have."""
    names = available_linear_names(target.model.get_decoder())
    missing = [m for m in lora_cfg.target_modules if m not in names]
    if missing:
        raise SpecgraftError(f"head.lora.target_modules {missing} do not exist in {target.identity.architecture}; "
                             f"its linear layers are: {', '.join(names)}")
    peft_cfg = PeftLoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                              target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(target.model, peft_cfg)
    target.model = peft_model
    return peft_model


def kl_base_to_adapted(base_logits: torch.Tensor, adapted_logits: torch.Tensor, mask: torch.Tensor,
                       num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Masked mean over positions of KL(p_base || p_adapted) (both [B, T, V] logits; divided by ``num_items``
    instead of the mask's sum when given, see :func:`~specgraft.heads.losses.masked_mean`)."""
    base_logp = torch.log_softmax(base_logits.float(), dim=-1)
    adapted_logp = torch.log_softmax(adapted_logits.float(), dim=-1)
    kl = (base_logp.exp() * (base_logp - adapted_logp)).sum(-1)
    return masked_mean(kl, mask, num_items)


class Medusa2Step(nn.Module):
    """One joint training step of heads + LoRA (an nn.Module so DDP/DeepSpeed see both)."""

    def __init__(self, head: DraftHead, peft_model: nn.Module, target: Target, lora_cfg: Any) -> None:
        super().__init__()
        if head.head_type != "medusa":
            raise SpecgraftError(f"lora (Medusa-2) needs head.type medusa, got {head.head_type}; "
                                 "set head.lora.enabled=false or head.type=medusa")
        self.head = head
        self.peft_model = peft_model
        object.__setattr__(self, "_target", target)
        self.cfg = lora_cfg
        self.layer = target.num_layers

    @staticmethod
    def _lm_and_kl_masks(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T-1] labels of the LM term (real loss tokens, shifted) and [B, T] positions of the KL term."""
        loss_mask = batch["loss_mask"] * batch["attention_mask"]
        return loss_mask[:, 1:], loss_mask

    def prepare(self, batch: dict[str, torch.Tensor], step: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the batch, its loss items): the heads' terms, ``lm`` and ``kl`` (see the trainer's token weighting)."""
        lm_mask, kl_mask = self._lm_and_kl_masks(batch)
        counts = dict(self.head.loss_item_counts(batch))
        counts.update({"lm": lm_mask.sum(), "kl": kl_mask.sum()})
        return batch, counts

    def forward(self, batch: dict[str, torch.Tensor], step: int,
                num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        """The step's loss; every term divided by its ``num_items`` entry when given (else by its own count)."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        if step < self.cfg.head_warmup_steps:
            with torch.no_grad():
                out = self._target(input_ids, attention_mask, layers=(self.layer,), logits=False)
            return self.head.training_loss(batch, out, num_items)

        out = self.peft_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hidden = out.hidden_states[self.layer]
        with torch.no_grad(), self.peft_model.disable_adapter():
            base_logits = self.peft_model(input_ids=input_ids, attention_mask=attention_mask).logits
        heads = self.head.training_loss(batch, TargetOutput(logits=out.logits, hidden_states={self.layer: hidden}),
                                        num_items)
        lm_mask, kl_mask = self._lm_and_kl_masks(batch)
        lm = masked_cross_entropy(out.logits[:, :-1], input_ids[:, 1:], lm_mask,
                                  None if num_items is None else num_items["lm"])
        kl = kl_base_to_adapted(base_logits, out.logits, kl_mask, None if num_items is None else num_items["kl"])
        total = self.cfg.lm_loss_weight * lm + self.cfg.head_loss_weight * heads.loss + self.cfg.kl_weight * kl
        metrics = dict(heads.metrics)
        metrics.update({"loss/lm": lm.detach(), "loss/kl_to_base": kl.detach(), "loss/heads": heads.loss.detach()})
        return HeadLoss(loss=total, metrics=metrics)


def lora_step(head: DraftHead, target: Target, lora_cfg: Any) -> tuple[nn.Module, nn.Module]:
    """The Medusa-2 training step and the peft-wrapped target (its adapter trains with the heads)."""
    peft_model = apply_lora(target, lora_cfg)
    return Medusa2Step(head, peft_model, target, lora_cfg), peft_model


def train_step(head: DraftHead, target: Target, recipe: Any) -> FamilyTrainStep | None:
    """The family's ``train_step``: Medusa-2's joint step when ``head.lora.enabled``, else None (the heads' own
    loss)."""
    lora_cfg = recipe.head.lora
    if not lora_cfg.enabled:
        return None
    step, peft_model = lora_step(head, target, lora_cfg)
    return FamilyTrainStep(step, peft_model, lora_cfg.adapter_learning_rate(recipe.training.learning_rate))
