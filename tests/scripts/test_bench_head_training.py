"""benchmarks/bench_head_training.py: each algorithm benchmarks its own head family (a refactor once left
``eagle`` training Medusa heads, and every EAGLE-1 figure of the benchmark was Medusa's), and a peer figure parses."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_head_training.py"
spec = importlib.util.spec_from_file_location("bench_head_training", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclass looks its module up while the module runs
spec.loader.exec_module(bench)


@pytest.mark.parametrize("algorithm", bench.ALGORITHMS)
@pytest.mark.parametrize("size", sorted(bench.SIZES))
def test_each_algorithm_builds_its_own_head_family(algorithm, size):
    from specgraft.heads import head_class

    config = bench.head_config(algorithm, bench.SIZES[size])
    assert config.type == algorithm
    assert head_class(algorithm).Config is type(config)


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown algorithm 'hydra'"):
        bench.head_config("hydra", bench.SIZES["tiny"])


def test_peer_figures_parse_or_are_refused():
    assert bench.parse_peer("Model-Optimizer=45000") == ("Model-Optimizer", 45000.0)
    for bad in ("Model-Optimizer", "=4", "MO=fast", "MO=-3", "MO=0"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_peer(bad)
