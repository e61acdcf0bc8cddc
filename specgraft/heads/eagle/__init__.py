"""EAGLE-1/2 (Li et al. 2024): a draft decoder layer on (feature, next-token embedding), a dynamic tree.

The family's files (the layout every family shares, ``docs/adding-a-head-family.md``): ``config.py``
(:class:`EagleConfig`), ``model.py`` (:class:`EagleHead`, the base shared with EAGLE-3, and the loss),
``drafter.py`` (the chain / EAGLE-2 dynamic-tree drafter, also EAGLE-3's), ``tune.py``
(:class:`~.tune.EagleSearch`, the chain / tree search of `specgraft tune`, also EAGLE-3's), ``export.py`` (vLLM /
SGLang layouts, card text). This file declares the family.
"""

from specgraft.heads.eagle import drafter, export, tune
from specgraft.heads.eagle.config import EagleConfig
from specgraft.heads.eagle.model import EagleHead
from specgraft.heads.family import HeadFamily

FAMILY = HeadFamily(
    name="eagle", config=EagleConfig, head=EagleHead, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter, search=tune.SEARCH,
    exporters=export.EXPORTERS, card=export.CARD, description="EAGLE-1/2 draft layer (dynamic tree)",
    listing_order=1,
)
