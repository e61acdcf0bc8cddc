"""benchmarks/bench_llamacpp.py's pure logic: the --draft spelling, the configurations per target quantization,
the aggregation against plain decoding of the same target, the cost fit that gives the break-even acceptance
length, and the plot. (The engine itself: tests/llamacpp/test_bench_in_engine.py.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_llamacpp.py"
spec = importlib.util.spec_from_file_location("bench_llamacpp", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclasses look their module up while the module runs
spec.loader.exec_module(bench)


def test_parse_draft_spellings_and_refusals():
    parsed = bench.parse_draft("eagle3=runs/e3:x/head:draft-eagle3")
    assert parsed == bench.DraftSpec("eagle3", Path("runs/e3:x/head"), "draft-eagle3")  # the last colon splits
    assert bench.parse_draft("df=/w/dflash.gguf:draft-dflash").spec_type == "draft-dflash"
    for bad, message in (("eagle3", "NAME=PATH:SPEC_TYPE"), ("eagle3=head", "NAME=PATH:SPEC_TYPE"),
                         ("=head:draft-eagle3", "NAME=PATH:SPEC_TYPE"), ("e=head:ngram-simple", "spec type"),
                         ("plain=head:draft-eagle3", "taken"), ("a b=head:draft-eagle3", "NAME=PATH:SPEC_TYPE")):
        with pytest.raises(ValueError, match=message):
            bench.parse_draft(bad)


def test_configurations_cover_every_target_draft_and_length():
    configs = bench.configurations({"Q4_1": Path("a.gguf"), "Q8_0": Path("b.gguf")},
                                   {"eagle3": (Path("e.gguf"), "draft-eagle3"), "dflash": (Path("d.gguf"),
                                                                                          "draft-dflash")},
                                   [1, 3], ngram_max=8)
    names = [c.name for c in configs]
    assert names == ["Q4_1 plain", "Q4_1 eagle3-k1", "Q4_1 eagle3-k3", "Q4_1 dflash-k1", "Q4_1 dflash-k3",
                     "Q4_1 ngram", "Q8_0 plain", "Q8_0 eagle3-k1", "Q8_0 eagle3-k3", "Q8_0 dflash-k1",
                     "Q8_0 dflash-k3", "Q8_0 ngram"]
    dflash3 = configs[4]
    assert dflash3.target_gguf == Path("a.gguf")
    assert dflash3.flags == ("-md", "d.gguf", "--spec-type", "draft-dflash", "--spec-draft-n-max", "3",
                             "--spec-draft-p-min", "0")
    assert configs[0].flags == () and configs[5].flags[:2] == ("--spec-type", "ngram-simple")


def _row(domain: str, prompt: int, tokens: int, ms: float, cpu: float, accepted: int = 0, steps: int = 0,
         per_pos: list | None = None, output: list | None = None) -> dict:
    return {"domain": domain, "prompt": prompt, "tokens": tokens, "decode_ms": ms, "cpu_s": cpu,
            "drafted": steps * len(per_pos or []), "accepted": accepted, "steps": steps,
            "accepted_per_pos": per_pos or [], "output": output or [1, 2, 3]}


def _synthetic() -> tuple[list, dict]:
    """One target; plain at 10 ms/token; a draft whose forward costs 12 + 3 K ms (wall) and 11 + 2 K ms (CPU),
    accepting 60 of 100 tokens at every length (40 forwards); the K = 2 run on the second prompt differs from plain."""
    configs = bench.configurations({"F32": Path("t.gguf")}, {"e": (Path("e.gguf"), "draft-eagle3")}, [1, 2, 3], 8)
    rows = {"F32 plain": [_row("math", 0, 50, 500.0, 0.5), _row("coding", 1, 50, 500.0, 0.5)]}
    for k in (1, 2, 3):
        forward_ms, cpu_ms = 12 + 3 * k, 11 + 2 * k
        rows[f"F32 e-k{k}"] = [_row(d, i, 50, 20 * forward_ms, 20 * cpu_ms / 1000, accepted=30, steps=20,
                                    per_pos=[18, 12][:k], output=[1, 2, 4] if (k, i) == (2, 1) else None)
                               for i, d in enumerate(("math", "coding"))]
    rows["F32 ngram"] = [_row(d, i, 50, 520.0, 0.52) for i, d in enumerate(("math", "coding"))]
    return configs, rows


def test_aggregate_against_plain_of_the_same_target_and_the_break_even_fit():
    configs, rows = _synthetic()
    results, per_domain = bench.aggregate(configs, rows)
    plain, k2 = results["F32 plain"], results["F32 e-k2"]
    assert plain["tokens_per_s"] == 100.0 and plain["tau"] == 1.0 and "speedup" not in plain
    assert k2["tau"] == 2.5  # 100 tokens over 40 forwards
    assert k2["forward_ms"] == 18.0 and k2["speedup"] == pytest.approx(100 / 72 * 10 / 10, abs=1e-3)
    assert k2["break_even_tau"] == 1.8 and k2["break_even_tau_cpu"] == 1.5
    assert k2["identical_to_plain"] == "1/2" and results["F32 e-k1"]["identical_to_plain"] == "2/2"
    assert k2["acceptance_per_position"] == [0.9, 0.6]  # per drafting step
    assert set(per_domain) == {"math", "coding"} and per_domain["coding"]["F32 e-k3"]["tau"] == 2.5

    (cost,) = bench.cost_models(configs, results)
    assert cost["forward_ms_fixed"] == pytest.approx(12.0) and cost["forward_ms_per_draft_token"] == pytest.approx(3.0)
    assert cost["min_break_even_tau"] == pytest.approx(1.5)  # (12 + 3) / 10
    assert cost["min_break_even_tau_cpu"] == pytest.approx(1.3)  # (11 + 2) / 10
    assert bench.fit_forward_cost([(2, 5.0), (2, 6.0)]) is None

    figures, acceptance = bench.figure_tables(configs, results, per_domain)
    (summary,) = figures["summary"]
    assert summary["e_best_k"] == 1 and summary["e_speedup"] == pytest.approx(2.5 / 1.5, abs=1e-3)
    assert summary["ngram_speedup"] == pytest.approx(500 / 520, abs=1e-3)
    assert acceptance["configs"]["F32 e-k2"] == [0.9, 0.6]
    assert all(not isinstance(v, (list, dict)) for row in figures["configs"] for v in row.values())


def test_plot_writes_a_png(tmp_path):
    configs, rows = _synthetic()
    results, _ = bench.aggregate(configs, rows)
    path = bench.plot(configs, results, tmp_path / "llamacpp.png", "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["llamacpp.png"]


def test_a_run_too_short_to_read_cpu_time_has_no_cpu_ratio_instead_of_failing():
    """CPU time comes in 10 ms clock ticks: a tiny model's short run can read 0 (it once failed CI with a division
    by zero); its speedup and tau are still reported."""
    row = {"tokens": 40, "decode_ms": 8.0, "cpu_s": 0.0, "steps": 20, "accepted": 20, "drafted": 40,
           "accepted_per_pos": [20]}
    plain = {"tokens": 80, "decode_s": 0.014, "tokens_per_s": 5791.23, "cpu_ms_per_token": 0.375}
    out = bench.summarize([row], plain)
    assert out["cpu_ratio"] is None and out["break_even_tau_cpu"] is None
    assert out["speedup"] == round(5000.0 / 5791.23, 3) and out["tau"] == 2.0
    measured = bench.summarize([{**row, "cpu_s": 0.01}], plain)
    assert measured["cpu_ratio"] == round(0.375 / 0.25, 3)
