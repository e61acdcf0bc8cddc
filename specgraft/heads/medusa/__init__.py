"""Medusa (Cai et al. 2024): K heads on the target's last hidden state, a static tree, Medusa-2's joint LoRA.

Files: ``config.py`` (:class:`MedusaConfig`), ``model.py`` (:class:`MedusaHead` and its loss), ``drafter.py``
(the static tree drafter, top-k accuracy measurement), ``medusa2.py`` (the joint LoRA training step),
``export.py`` (vLLM / TensorRT-LLM layouts, card text), ``tune.py`` (the static-tree search of `specgraft tune`).
This file registers the family.
"""

from specgraft.heads.medusa import drafter, export, medusa2, tune
from specgraft.heads.medusa.config import MedusaConfig
from specgraft.heads.medusa.model import MedusaHead
from specgraft.heads.registry import register_head

register_head(
    "medusa", config=MedusaConfig, head=MedusaHead, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter,
    exporters=export.EXPORTERS, card=export.CARD, tuning="medusa",
    description="Medusa heads (static tree from per-head top-k accuracies)",
    hooks={**tune.HOOKS, "apply_tuned": export.apply_tuned, "tuning_prior": drafter.tuning_prior,
           "lora_step": medusa2.lora_step,
           "train_metrics": drafter.train_metrics},
)
