"""The export commands' choices and defaults, importable without torch (``specgraft export --help`` reads them)."""

from __future__ import annotations

#: Every export format, in the order the CLI lists them.
FORMATS: tuple[str, ...] = ("vllm", "sglang", "trtllm", "native")

#: vLLM's EAGLE-3 / speculators default draft length, written into speculators_config.
DEFAULT_SPECULATIVE_TOKENS = 3

#: Environment variable ``specgraft push`` reads the Hub token from.
DEFAULT_TOKEN_ENV = "HF_TOKEN"
