"""The export commands' choices and defaults, importable without torch (``specgraft export --help`` reads them)."""

from __future__ import annotations

#: Every export format, in the order the CLI lists them.
FORMATS: tuple[str, ...] = ("vllm", "sglang", "trtllm", "llamacpp", "native")

#: vLLM's EAGLE-3 / speculators default draft length, written into speculators_config.
DEFAULT_SPECULATIVE_TOKENS = 3

#: Environment variable ``specgraft push`` reads the Hub token from.
DEFAULT_TOKEN_ENV = "HF_TOKEN"

#: The formats each built-in family can be exported to (besides native), as ``export --help`` lists them. A copy of
#: what the families register, kept here so the help needs no torch; ``tests/export/test_options.py`` checks it
#: against the registry.
FORMATS_PER_FAMILY = ("medusa: vllm, trtllm; eagle: vllm, sglang; eagle3: vllm, sglang, trtllm, llamacpp; "
                      "dflash: vllm, sglang, llamacpp")
