"""Seeds derived from a recipe's seed (one rule for every place that needs a stable per-item seed)."""

from __future__ import annotations

import hashlib
import json


def derive_seed(seed: int, *parts: int) -> int:
    """A 60-bit seed derived from ``seed`` and integer ``parts`` (stable across runs, processes and machines:
    a hash, not Python's salted ``hash``)."""
    digest = hashlib.sha256(json.dumps([int(seed), *(int(p) for p in parts)]).encode()).hexdigest()
    return int(digest[:15], 16)
