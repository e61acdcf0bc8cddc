"""The typed settings of an evaluation: the one place their defaults live (``specgraft eval``'s flags take their
defaults from here, and each report.json stores the resolved settings beside the results)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from specgraft.errors import SpecgraftError

#: The most timing repeats (and warm-up runs) a measurement takes: the median is stable long before, and an
#: unbounded count only makes a run that never ends.
MAX_REPEATS = 1000
#: Built-in drafters selectable with ``specgraft eval --drafter``.
BUILTIN_DRAFTERS = ("self", "random")
#: Draft length of the built-in and draft-model drafters when --k is not given.
DEFAULT_K = 4


@dataclass
class EvalSettings:
    """Decoding and measurement settings of an evaluation.

    Attributes:
        max_new_tokens: tokens generated per turn at most (baseline and speculative alike).
        temperature, top_p, top_k: target-side sampling (temperature 0 = greedy).
        seed: base seed; generation ``i`` (in prompt/turn order) of both runs is seeded with ``seed + i``.
        repeats: timed runs per turn (median time); the outputs of every repeat are identical.
        warmup: untimed runs of both decoders on the first prompt before measuring.
        ignore_eos: never stop at EOS (fixed-length measurements).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    repeats: int = 1
    warmup: int = 1
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise SpecgraftError for values outside their domain."""
        if not math.isfinite(self.temperature):
            raise SpecgraftError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        from specgraft.decoding.verify import check_sampling_params

        check_sampling_params(self.temperature, self.top_k, self.top_p)
        for name, low in (("max_new_tokens", 1), ("repeats", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < low:
                raise SpecgraftError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("repeats", "warmup"):
            if getattr(self, name) > MAX_REPEATS:
                raise SpecgraftError(f"{name} must be at most {MAX_REPEATS}, got {getattr(self, name)} (each repeat "
                                     "decodes every prompt again)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["lossy"] = False  # the engine only verifies losslessly (no typical acceptance)
        return out
