"""The benchmark scripts import their shared module as ``benchlib`` (they run with ``benchmarks/`` on the path)."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
