"""EAGLE-3 (Li et al. 2025): fused target layers, a reduced draft vocabulary, training-time test.

The family's files (the layout every family shares, ``docs/adding-a-head-family.md``): ``config.py``
(:class:`Eagle3Config`), ``model.py`` (:class:`Eagle3Head` and its TTT loss), ``export.py`` (speculators-vLLM /
SGLang / TensorRT-LLM / llama.cpp layouts, card text). It drafts and tunes as EAGLE-1/2 does, so instead of its own
``drafter.py`` and ``tune.py`` it imports the EAGLE family's. This file declares the family.
"""

from specgraft.heads.eagle import drafter, tune
from specgraft.heads.eagle3 import export
from specgraft.heads.eagle3.config import Eagle3Config
from specgraft.heads.eagle3.model import Eagle3Head
from specgraft.heads.family import HeadFamily

FAMILY = HeadFamily(
    name="eagle3", config=Eagle3Config, head=Eagle3Head, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter, search=tune.SEARCH,
    exporters=export.EXPORTERS, card=export.CARD,
    description="EAGLE-3 draft (fused layers, draft vocabulary, dynamic tree)", listing_order=2,
)
