"""benchmarks/bench_specforge_stories260k.py's --lever parsing (the runs themselves need the SpecForge venv)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_specforge_stories260k",
                                              ROOT / "benchmarks" / "bench_specforge_stories260k.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)


def test_levers_are_named_override_lists():
    got = bench.parse_levers(["ttt5:head.ttt_steps=5", "both:head.loss_decay=1.0,training.learning_rate=6e-3"])
    assert got == [("ttt5", ["head.ttt_steps=5"]), ("both", ["head.loss_decay=1.0", "training.learning_rate=6e-3"])]


@pytest.mark.parametrize("item", ["head.ttt_steps=5", "ttt5:", "ttt5:head.ttt_steps", "specforge:head.ttt_steps=5",
                                  "two words:head.ttt_steps=5"])
def test_a_malformed_lever_is_one_error_line(item, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_levers([item])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --lever")
