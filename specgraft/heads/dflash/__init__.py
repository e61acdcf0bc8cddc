"""DFlash (block-parallel drafting, arXiv 2602.06036): one non-causal draft forward proposes a whole block.

* :mod:`.config`: :class:`~.config.DFlashConfig` (the recipe's ``head:`` section, ``type: dflash``).
* :mod:`.losses`: anchor sampling, the block attention mask, the position weights and the loss (pure functions).
* :mod:`.model`: :class:`~.model.DFlashHead` (head type ``dflash``) and its block forward.
* :mod:`.drafter`: :class:`~.drafter.DFlashDrafter` for the speculative decoder (one draft forward per step).
* :mod:`.export`: the speculators / vLLM and SGLang DFlash layouts (config keys, tensor names, round trip).
* :mod:`.llamacpp`: llama.cpp's ``dflash`` GGUF architecture (``--format llamacpp``).
* :mod:`.tune`: the `specgraft tune` search (chain length, per-slot top-k trees) and its cost-profile section.

This file registers the family.
"""

from specgraft.heads.dflash import drafter, export, llamacpp, tune
from specgraft.heads.dflash.config import DFlashConfig
from specgraft.heads.dflash.model import DFlashHead
from specgraft.heads.registry import register_head

register_head(
    "dflash", config=DFlashConfig, head=DFlashHead, drafter=drafter.drafter_from_setting,
    setting_from_flags=drafter.setting_from_flags, describe_drafter=drafter.describe_drafter,
    exporters={**export.EXPORTERS, "llamacpp": llamacpp.EXPORTER}, card=export.CARD, tuning="dflash",
    description="DFlash block drafter (one forward drafts block_size - 1 tokens)",
    hooks={**tune.HOOKS, "apply_tuned": export.apply_tuned},
)
