"""EAGLE-3 (Li et al. 2025): fused target layers, a reduced draft vocabulary, training-time test.

Files: ``config.py`` (:class:`Eagle3Config`), ``model.py`` (:class:`Eagle3Head` and its TTT loss),
``export.py`` (speculators-vLLM / SGLang / TensorRT-LLM layouts, card text). Drafting reuses the EAGLE family's
drafter. This file registers the family.
"""

from specgraft.heads.eagle import drafter, tune
from specgraft.heads.eagle3 import export
from specgraft.heads.eagle3.config import Eagle3Config
from specgraft.heads.eagle3.model import Eagle3Head
from specgraft.heads.registry import register_head

register_head(
    "eagle3", config=Eagle3Config, head=Eagle3Head, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter,
    exporters=export.EXPORTERS, card=export.CARD, tuning="eagle", hooks=tune.HOOKS,
    description="EAGLE-3 draft (fused layers, draft vocabulary, dynamic tree)",
)
