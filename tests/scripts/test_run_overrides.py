"""benchmarks/benchlib parse_run_overrides: the per-run recipe overrides of bench_smollm2 and bench_dflash."""

from __future__ import annotations

import pytest
from benchlib.stages import parse_run_overrides


def test_overrides_are_grouped_by_run_in_order():
    got = parse_run_overrides(["dflash:head.max_anchors=256", "eagle3:training.max_steps=10",
                               "dflash:head.num_layers=2", "dflash:data.path=a:b=c"], ["eagle3", "dflash"])
    assert got == {"dflash": ["head.max_anchors=256", "head.num_layers=2", "data.path=a:b=c"],
                   "eagle3": ["training.max_steps=10"]}


@pytest.mark.parametrize("item", ["medusa:head.num_heads=2", "head.max_anchors=256", "dflash:head.max_anchors"])
def test_a_malformed_or_unknown_override_is_one_error_line(item, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_run_overrides([item], ["eagle3", "dflash"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --override") and "eagle3, dflash" in err
