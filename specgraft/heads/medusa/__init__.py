"""Medusa (Cai et al. 2024): K heads on the target's last hidden state, a static tree, Medusa-2's joint LoRA.

The family's files (the layout every family shares, ``docs/adding-a-head-family.md``): ``config.py``
(:class:`MedusaConfig`), ``model.py`` (:class:`MedusaHead` and its loss), ``drafter.py`` (the static tree drafter,
top-k accuracy measurement), ``tune.py`` (:class:`~.tune.MedusaSearch`, the static-tree search of `specgraft
tune`), ``export.py`` (vLLM / TensorRT-LLM layouts, card text), and Medusa's own ``medusa2.py`` (the joint LoRA
training step). This file declares the family.
"""

from specgraft.heads.family import HeadFamily
from specgraft.heads.medusa import drafter, export, medusa2, tune
from specgraft.heads.medusa.config import MedusaConfig
from specgraft.heads.medusa.model import MedusaHead

FAMILY = HeadFamily(
    name="medusa", config=MedusaConfig, head=MedusaHead, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter, search=tune.SEARCH,
    exporters=export.EXPORTERS, apply_tuned=export.apply_tuned, card=export.CARD, train_step=medusa2.train_step,
    train_metrics=drafter.train_metrics, description="Medusa heads (static tree from per-head top-k accuracies)",
    listing_order=0, default=True,
)
