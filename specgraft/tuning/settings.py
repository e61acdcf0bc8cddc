"""Defaults of ``specgraft profile`` and ``specgraft tune`` (import-light: command parsers read them)."""

#: ``specgraft profile``: tokens verified at once that are measured by default (root included), the KV length
#: measured at and the timing repeats.
DEFAULT_TOKEN_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_KV_LENGTH = 256
DEFAULT_REPEATS = 5
#: Default of ``specgraft tune --min-speedup``: a drafting setting is kept only when it is at least this fast
#: relative to plain decoding.
DEFAULT_MIN_SPEEDUP = 1.0
#: ``--engine llamacpp``: the longest draft length measured, tokens per request, and requests per configuration
#: when measuring the engine's costs.
LLAMACPP_MAX_DRAFT = 5
LLAMACPP_NEW_TOKENS = 64
LLAMACPP_ROUNDS = 3
