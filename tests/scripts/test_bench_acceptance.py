"""benchmarks/bench_acceptance.py's pure logic: the evaluated steps, the --fail-below regression check, the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_acceptance.py"
spec = importlib.util.spec_from_file_location("bench_acceptance", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclass looks its module up while the module runs
spec.loader.exec_module(bench)

FAMILIES = ("medusa", "eagle", "eagle3", "dflash")
TARGETS = ("stories260k", "embedded")


def _row(family: str, target: str, step: int, tau: float, lossless: bool = True) -> dict:
    return {"family": family, "target": target, "step": step, "tau": tau, "lossless": lossless}


def test_eval_steps_every_n_and_always_the_last():
    assert bench.eval_steps(300, 100) == [100, 200, 300]
    assert bench.eval_steps(250, 100) == [100, 200, 250]
    assert bench.eval_steps(50, 100) == [50]
    assert bench.eval_steps(1, 1) == [1]
    with pytest.raises(ValueError, match="at least 1"):
        bench.eval_steps(0, 100)


def test_parse_thresholds_spellings_and_refusals():
    parsed = bench.parse_thresholds(["eagle3=3.5", "medusa@stories260k=2"], FAMILIES, TARGETS)
    assert parsed == {("eagle3", None): 3.5, ("medusa", "stories260k"): 2.0}
    for bad, message in (("eagle3", "FAMILY=TAU"), ("eagle3=high", "FAMILY=TAU"), ("eagle3=nan", "FAMILY=TAU"),
                         ("hydra=2", "family 'hydra'"), ("eagle3@gpt2=2", "target 'gpt2'")):
        with pytest.raises(ValueError, match=message):
            bench.parse_thresholds([bad], FAMILIES, TARGETS)


def test_regressions_read_the_final_step_only():
    rows = [_row("eagle3", "stories260k", 100, 3.9), _row("eagle3", "stories260k", 300, 3.1),
            _row("eagle3", "embedded", 300, 2.5), _row("medusa", "stories260k", 100, 1.2),
            _row("medusa", "stories260k", 300, 2.1)]
    assert bench.final_rows(rows)[("eagle3", "stories260k")]["step"] == 300
    # A good early checkpoint does not hide a regressed final one; a FAMILY=TAU threshold covers every target.
    assert bench.regressions(rows, {("eagle3", None): 3.0}) == [
        "eagle3 on embedded: final tau 2.50 at step 300 is below 3.00"]
    assert bench.regressions(rows, {("eagle3", None): 2.0, ("medusa", "stories260k"): 2.0}) == []
    # Negative control: the same thresholds fail once the final taus drop below them.
    assert len(bench.regressions(rows, {("eagle3", None): 3.2, ("medusa", "stories260k"): 2.2})) == 3


def test_target_threshold_overrides_the_family_one_and_missing_rows_fail():
    rows = [_row("eagle3", "stories260k", 300, 3.1), _row("eagle3", "embedded", 300, 2.5)]
    thresholds = {("eagle3", None): 3.0, ("eagle3", "embedded"): 2.0}
    assert bench.regressions(rows, thresholds) == []
    assert bench.regressions(rows, {("dflash", None): 1.0}) == [
        "dflash on embedded: no tau measured (threshold 1.00)",
        "dflash on stories260k: no tau measured (threshold 1.00)"]


def test_curve_table_one_line_per_target_and_family():
    rows = [_row("medusa", "stories260k", 100, 1.5), _row("medusa", "stories260k", 200, 1.75, lossless=False),
            _row("eagle3", "stories260k", 200, 3.0)]
    assert bench.curve_table(rows).splitlines() == [
        "| target | family | step 100 | step 200 |",
        "|---|---|---:|---:|",
        "| stories260k | medusa | 1.50 | 1.75 (NOT lossless) |",
        "| stories260k | eagle3 | - | 3.00 |"]
