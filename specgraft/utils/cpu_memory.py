"""Reuse freed CPU tensor memory instead of handing it back to the OS every step (glibc malloc settings).

A CPU training step allocates and frees the same large tensors every step (activations, vocabulary-sized logits,
gradients). glibc serves an allocation above its mmap threshold (128 KiB at first, raised adaptively only up to
32 MiB) with a fresh ``mmap`` and unmaps it on free, and it trims free memory at the top of its heap: either way the
next step's tensor touches new pages, one minor page fault per 4 KiB page. Measured on the tiny benchmark target
(``benchmarks/bench_head_training.py`` sizes, 2 threads): 600-1,900 page faults per Medusa / EAGLE-3 step, 5-10% of
the step's time; with :func:`keep_freed_memory`, about 20.

The settings are process-wide (malloc has no other scope); the trainer applies them when it trains on the CPU. They
change when memory is returned to the OS, not how much is in use at once; a finished job's freed memory stays
mapped until the process exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

#: Allocations up to this size come from malloc's heap, where freed blocks are reused: every per-step tensor of a
#: CPU training job (the largest, a SmolLM2-size chunk of vocabulary logits, is 32 MiB) and far more.
MMAP_THRESHOLD_BYTES = 256 << 20
#: Free memory at the top of the heap is kept up to this size instead of being returned to the OS after each free.
TRIM_THRESHOLD_BYTES = 1 << 30

# mallopt(3) parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (see the module docstring); idempotent.

    Returns whether the settings were applied: False off Linux/glibc (macOS, Windows, musl), where it does nothing.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (no mallopt), or no C library to load
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    logger.debug("malloc keeps freed memory for reuse: %s", applied)
    return applied
