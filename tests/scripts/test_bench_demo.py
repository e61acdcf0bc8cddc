"""benchmarks/bench_demo.py: a real `specgraft demo --quick` run recorded as a result (each drafter's default and
tuned figures taken from the demo's own summary and tuned reports), and the refusals."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_demo.py"
spec = importlib.util.spec_from_file_location("bench_demo", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)


@pytest.mark.slow
def test_a_quick_demo_is_recorded_with_its_tuned_figures(tmp_path, capsys):
    out, results = tmp_path / "demo", tmp_path / "results"
    argv = ["--out", str(out), "--results-dir", str(results), "--result-name", "demo-quick", "--", "--quick"]
    assert bench.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    result = json.loads((results / "demo-quick.json").read_text())
    rows = {row["drafter"]: row for row in result["figures"]}
    assert set(rows) == set(summary["tuning"]) and rows
    for name, row in rows.items():
        overall = next(r for r in summary["rows"] if r["drafter"] == name and r["domain"] == "overall")
        tuned = summary["tuning"][name]
        report = json.loads((Path(tuned["report_dir"]) / "report.json").read_text())["overall"]
        assert (row["default_tau"], row["default_speedup"]) == (overall["tau"], overall["speedup_ratio_of_totals"])
        assert (row["tuned_setting"], row["tuned_speedup"], row["tuned_tau"]) == \
            (tuned["setting"], tuned["measured"], report["tau"])
        assert row["lossless"].startswith("passed")
    assert result["details"]["demo_command"] == "specgraft demo --quick"
    # Recording the same folder again reads it without running the demo.
    stamp = (out / "summary.json").stat().st_mtime_ns
    assert bench.main([*argv[:6], "--record-only", "--", "--quick"]) == 0
    assert (out / "summary.json").stat().st_mtime_ns == stamp
    assert json.loads((results / "demo-quick.json").read_text())["figures"] == result["figures"]


def test_refusals(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "none"), "--record-only", "--results-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ") and not list(tmp_path.glob("*.json"))
    with pytest.raises(SystemExit) as stop:
        bench.main(["--out", str(tmp_path / "d"), "--", "--out", str(tmp_path / "x")])
    assert stop.value.code == 2 and "not after --" in capsys.readouterr().err
