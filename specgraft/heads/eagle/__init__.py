"""EAGLE-1/2 (Li et al. 2024): a draft decoder layer on (feature, next-token embedding), a dynamic tree.

Files: ``config.py`` (:class:`EagleConfig`), ``model.py`` (:class:`EagleHead`, the base shared with EAGLE-3, and
the loss), ``drafter.py`` (the chain / EAGLE-2 dynamic-tree drafter, also EAGLE-3's), ``export.py`` (vLLM /
SGLang layouts, card text), ``tune.py`` (the chain / tree search of `specgraft tune`, also EAGLE-3's). This file
registers the family.
"""

from specgraft.heads.eagle import drafter, export, tune
from specgraft.heads.eagle.config import EagleConfig
from specgraft.heads.eagle.model import EagleHead
from specgraft.heads.registry import register_head

register_head(
    "eagle", config=EagleConfig, head=EagleHead, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter,
    exporters=export.EXPORTERS, card=export.CARD, tuning="eagle", hooks=tune.HOOKS,
    description="EAGLE-1/2 draft layer (dynamic tree)",
)
