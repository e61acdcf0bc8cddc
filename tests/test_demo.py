"""`specgraft demo --quick` runs the whole product end to end on the embedded default target."""

from __future__ import annotations

import json

import pytest

from specgraft.cli import main as cli_main
from specgraft.defaults.corpus import DOMAINS, prompt_cuts
from specgraft.demos.stories import QUICK


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli_main(["demo", "--quick", "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "summary:" in printed and "| medusa |" in printed and "| eagle3 |" in printed

    # Self-distilled training text: every row is a training-stream prompt followed by the target's continuation.
    cuts = {c for d in DOMAINS for c in prompt_cuts(d, QUICK.docs_per_domain, 1, split="train")}
    rows = [json.loads(line)["text"] for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == QUICK.docs_per_domain * len(DOMAINS)
    assert all(any(r.startswith(c) and len(r) > len(c) for c in cuts) for r in rows)
    assert "own greedy continuations" in (out / "summary.md").read_text()

    summary = json.loads((out / "summary.json").read_text())
    drafters = {row["drafter"] for row in summary["rows"]}
    assert {"medusa", "eagle3", "distilled draft"} <= drafters
    domains = {row["domain"] for row in summary["rows"]}
    assert {"code", "arithmetic", "records", "prose", "overall"} <= domains
    assert all(str(row["lossless"]).startswith("passed") for row in summary["rows"])
    assert (out / "summary.png").stat().st_size > 0
    for name in ("medusa", "eagle3", "distilled"):
        report = json.loads((out / "eval" / name / "report.json").read_text())
        assert report["overall"]["tau"] >= 1.0
        answers = (out / "eval" / name / "answers.jsonl").read_text().splitlines()
        assert answers and all({"domain"} <= set(json.loads(line)) for line in answers)
    for export in ("demo-medusa-vllm", "demo-eagle3-vllm", "demo-eagle3-sglang", "demo-dflash-vllm",
                   "demo-dflash-sglang"):
        assert any(p.name.startswith(export) for p in (out / "exports").iterdir()), export

    # A second run refuses to overwrite without --overwrite.
    assert cli_main(["demo", "--quick", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err

