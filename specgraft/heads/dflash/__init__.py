"""DFlash (block-parallel drafting, arXiv 2602.06036): one non-causal draft forward proposes a whole block.

* :mod:`.config`: :class:`~.config.DFlashConfig` and :func:`~.config.resolve_dflash_config` (defaults against a target).
* :mod:`.losses`: anchor sampling, the block attention mask, the position weights and the loss (pure functions).
* :mod:`.model`: :class:`~.model.DFlashHead` (head type ``dflash``) and its block forward.
* :mod:`.drafter`: :class:`~.drafter.DFlashDrafter` for the speculative decoder (one draft forward per step).
* :mod:`.export`: the speculators / vLLM DFlash layout (config keys, tensor names, round trip).
"""
