"""The demo's summary puts each drafter's tuned setting and measured speedup next to its default one, in
summary.md, summary.json and summary.png (one figure title)."""

from __future__ import annotations

import json
from pathlib import Path

from specgraft.demos.steps import write_summary


def _report(tau: float, speedup: float, domains: dict[str, float]) -> dict:
    overall = {"tau": tau, "speedup_mean_of_ratios": speedup, "speedup_ratio_of_totals": speedup,
               "lossless_check": "passed (4/4 token-identical)"}
    return {"overall": overall, "drafter": {"mode": "tree", "k": 2, "tree_size": 64},
            "domains": {d: {**overall, "speedup_ratio_of_totals": s} for d, s in domains.items()}}


def _tuned_run(folder: Path, domains: dict[str, float]) -> Path:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(_report(1.3, 1.2, domains)))
    return folder


def test_summary_shows_tuned_next_to_default(tmp_path):
    results = {
        "eagle3": {"report": _report(2.6, 0.61, {"code": 0.7, "prose": 0.5}), "report_dir": tmp_path / "e",
                   "head_dir": tmp_path / "eagle3" / "head"},
        "medusa": {"report": _report(2.9, 0.91, {"code": 1.0, "prose": 0.8}), "report_dir": tmp_path / "m",
                   "head_dir": tmp_path / "medusa" / "head"},
    }
    tuning = {"eagle3": {"setting": "chain of 1", "default": "top-10 tree of depth 6, 60 tokens",
                         "predicted": 1.17, "predicted_default": 0.55, "measured": 1.20, "measured_default": 0.61,
                         "tau": 1.31, "tau_default": 2.6, "lossless": "passed (4/4 token-identical)",
                         "report_dir": _tuned_run(tmp_path / "tune" / "eagle3", {"code": 1.3, "prose": 1.1})}}
    summary = write_summary(tmp_path, results, {}, 60.0, "a test target", tuning, title="one title")

    text = (tmp_path / "summary.md").read_text()
    headline = next(line for line in text.splitlines() if line.startswith("| eagle3 | top-10"))
    assert headline == ("| eagle3 | top-10 tree of depth 6, 60 tokens | 2.60 | 0.61x | chain of 1 | 1.31 | "
                        "**1.20x** (1.17x) | passed |")
    # a drafter without a tuning run shows the setting its report recorded, and says it was not tuned
    assert "| medusa | tree of 64 tokens, depth 2 | 2.90 | 0.91x | not tuned" in text
    # the headline table comes before the per-domain detail
    assert text.index("default and tuned settings") < text.index("Per domain, default settings")

    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["headline"] == summary["headline"]
    row = next(r for r in data["headline"] if r["drafter"] == "eagle3")
    assert (row["default_speedup"], row["tuned_speedup"], row["tuned_setting"]) == (0.61, 1.20, "chain of 1")
    assert {r["drafter"] for r in data["rows"]} == {"eagle3", "medusa"}

    png = tmp_path / "summary.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_has_one_title(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles: list[list[str]] = []
    savefig = plt.Figure.savefig

    def capture(fig, *args, **kwargs):
        texts = [fig._suptitle.get_text()] if fig._suptitle is not None else []
        texts += [ax.get_title() for ax in fig.axes if ax.get_title()]
        titles.append(texts)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", capture)
    results = {"medusa": {"report": _report(2.9, 0.91, {"code": 1.0}), "report_dir": tmp_path / "m",
                          "head_dir": None}}
    write_summary(tmp_path, results, {}, 1.0, "t", {}, title="the only title")
    assert titles == [["the only title"]]
