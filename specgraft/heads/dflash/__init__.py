"""DFlash (block-parallel drafting, arXiv 2602.06036): one non-causal draft forward proposes a whole block.

The family's files (the layout every family shares, ``docs/adding-a-head-family.md``):

* :mod:`.config`: :class:`~.config.DFlashConfig` (the recipe's ``head:`` section, ``type: dflash``).
* :mod:`.model`: :class:`~.model.DFlashHead` (head type ``dflash``) and its block forward.
* :mod:`.drafter`: :class:`~.drafter.DFlashDrafter` for the speculative decoder (one draft forward per step).
* :mod:`.tune`: :class:`~.tune.DFlashSearch`, the `specgraft tune` search (chain length, per-slot top-k trees)
  and its cost-profile section.
* :mod:`.export`: the speculators / vLLM and SGLang DFlash layouts (config keys, tensor names, round trip).
* :mod:`.llamacpp`: llama.cpp's ``dflash`` GGUF architecture (``--format llamacpp``).
* DFlash's own :mod:`.losses`: anchor sampling, the block attention mask, the position weights and the loss.

This file declares the family.
"""

from specgraft.heads.dflash import drafter, export, llamacpp, tune
from specgraft.heads.dflash.config import DFlashConfig
from specgraft.heads.dflash.model import DFlashHead
from specgraft.heads.family import HeadFamily

FAMILY = HeadFamily(
    name="dflash", config=DFlashConfig, head=DFlashHead, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter, search=tune.SEARCH,
    exporters={**export.EXPORTERS, "llamacpp": llamacpp.EXPORTER}, apply_tuned=export.apply_tuned, card=export.CARD,
    description="DFlash block drafter (one forward drafts block_size - 1 tokens)", listing_order=3,
)
