"""The ``--threads`` option of the long-running commands (train, distill, regenerate, eval).

torch's default intra-op thread count is every core; when other processes share the cores, those threads stall
each other (a forward can run several times slower than with one thread), so the commands let users pin it.
"""

from __future__ import annotations

import argparse

from specgraft.errors import SpecgraftError

THREADS_HELP = "torch CPU threads (default: torch's choice, all cores; 1 suits tiny models and shared machines)"


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads N`` (default None: leave torch's own choice)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)


def set_torch_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count to ``threads``; None leaves torch's default.

    Raises:
        SpecgraftError: ``threads`` is below 1.
    """
    if threads is None:
        return
    if threads < 1:
        raise SpecgraftError(f"--threads must be a positive integer, got {threads}; pass --threads 1 or more")
    import torch

    torch.set_num_threads(threads)
