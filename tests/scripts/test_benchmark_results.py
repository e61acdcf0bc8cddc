"""Benchmark results as data: benchmarks/benchlib writes each result file with its provenance, every benchmark
script writes through it, and docs/benchmarks.md is exactly what scripts/render_benchmarks.py renders from the
committed files (so the page cannot drift from the data)."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from benchlib.results import write_result

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "scripts" / "render_benchmarks.py")
render_benchmarks = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = render_benchmarks
spec.loader.exec_module(render_benchmarks)


def test_committed_page_equals_the_rendered_results():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == render_benchmarks.render(ROOT / "benchmarks" / "results"), \
        "docs/benchmarks.md is stale: run python scripts/render_benchmarks.py"


def test_every_committed_result_records_its_provenance():
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert results
    for path in results:
        result = json.loads(path.read_text(encoding="utf-8"))
        assert result["name"] == path.stem
        assert result["command"] and result["date"] and result["cpu"] and result["figures"], path.name
        if result["source"] == "measured":  # written by write_result: everything a rerun needs
            assert {"commit", "threads", "dtype", "versions"} <= set(result), path.name
        else:
            assert result["source"] == "recorded" and result["origin"], path.name


def test_write_result_records_the_run_and_every_figure(tmp_path):
    argv = [str(ROOT / "benchmarks" / "bench_x.py"), "--steps", "3", "--note", "two words"]
    path = write_result("x-run", {"decoding": [{"head": "medusa", "tau": 2.5, "lossless": "passed 3/3"}],
                                  "training": [{"head": "medusa", "tokens_per_s": 1234.5}]},
                        title="A test run", dtype="float32", threads=3, details={"seed": 0},
                        results_dir=tmp_path, argv=argv)
    assert path == tmp_path / "x-run.json"
    result = json.loads(path.read_text(encoding="utf-8"))
    assert result["command"] == "python benchmarks/bench_x.py --steps 3 --note 'two words'"
    assert result["source"] == "measured" and result["threads"] == 3 and result["dtype"] == "float32"
    assert len(result["commit"]) == 40 and isinstance(result["dirty"], bool)
    assert set(result["versions"]) >= {"python", "torch", "transformers", "specgraft"}
    assert result["cpu"] and result["date"].endswith("+00:00")
    assert result["figures"]["decoding"] == [{"head": "medusa", "tau": 2.5, "lossless": "passed 3/3"}]
    assert result["details"] == {"seed": 0}

    page = render_benchmarks.render(tmp_path)
    assert "## x-run" in page and "`python benchmarks/bench_x.py --steps 3 --note 'two words'`" in page
    assert "| head | tau | lossless |" in page and "| medusa | 2.50 | passed 3/3 |" in page
    assert "| medusa | 1,234 |" in page


def test_a_nested_figure_is_refused(tmp_path):
    with pytest.raises(ValueError, match="non-scalars"):
        write_result("bad", [{"tau": [1.0, 2.0]}], title="t", dtype="float32", results_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_result_named_unlike_its_file_is_one_error_line(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"name": "b", "title": "t", "source": "measured", "command": "c",
                                                 "figures": []}))
    assert render_benchmarks.main(["--results", str(tmp_path), "--out", str(tmp_path / "page.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: a.json is named 'b'")
    assert not (tmp_path / "page.md").exists()


def _writes_result(module: Path) -> tuple[set[str], bool]:
    """(names the module calls, whether it calls benchlib.results.write_result itself)."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    calls = {node.func.id for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "benchlib.results" for alias in node.names}
    return calls, "write_result" in calls and "write_result" in imported


def test_every_benchmark_script_writes_its_result_through_benchlib():
    """Each script calls write_result, or calls a function of a benchlib module that does (a protocol two scripts
    share, e.g. benchlib.specforge.side_by_side)."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) >= 10
    for script in scripts:
        calls, writes = _writes_result(script)
        if not writes:
            tree = ast.parse(script.read_text(encoding="utf-8"))
            shared = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and (node.module or "").startswith("benchlib.") for alias in node.names}
            writers = {name for module, name in shared
                       if _writes_result(ROOT / "benchmarks" / (module.replace(".", "/") + ".py"))[1]}
            writes = bool(writers & calls)
        assert writes, script.name
        assert "load_sibling" not in script.read_text(encoding="utf-8"), script.name
