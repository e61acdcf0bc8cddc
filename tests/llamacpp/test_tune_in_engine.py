"""``specgraft profile/tune --engine llamacpp`` for real: stories260K served by the pinned llama.cpp with the EAGLE-3
head the shipped recipe trains (cut short). The decision must hold in the measured run: a chosen draft length is
measured no slower than plain decoding (beyond noise), or "does not pay" is confirmed by the measured run at the
predicted-best length; greedy outputs stay identical to plain decoding's; the tuned length (or the reason) reaches
the export's card.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specgraft.cli import main
from specgraft.tuning.llamacpp import LLAMACPP_TUNED_NAME, LlamacppProfile

pytestmark = [pytest.mark.llamacpp, pytest.mark.shared, pytest.mark.slow]

MAX_DRAFT = 3
#: Relative speed difference a shared machine's noise can make between two interleaved sub-millisecond runs.
NOISE = 0.15


@pytest.fixture(scope="module")
def prompt_file(tinystories_path, tmp_path_factory) -> Path:
    """The first sentences of eight TinyStories paragraphs from the END of the file (the training run's
    continuations come from its start), as an MT-bench-style JSONL."""
    paragraphs = [p.strip() for p in tinystories_path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    path = tmp_path_factory.mktemp("prompts") / "stories.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "stories", "turns": [p.split(". ")[0] + "."]})
                            + "\n" for i, p in enumerate(paragraphs[-8:])), encoding="utf-8")
    return path


def test_profile_measures_every_draft_length(llamacpp_bin, eagle3_head, stories260k_gguf, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--engine", "llamacpp", "--target", str(stories260k_gguf), "--head", str(eagle3_head),
                 "--max-draft", str(MAX_DRAFT), "--kv-length", "64", "--new-tokens", "32", "--rounds", "2",
                 "--out", str(out)]) == 0
    profile = LlamacppProfile.load(out)
    assert sorted(profile.step_ms) == list(range(1, MAX_DRAFT + 1)) == sorted(profile.draft_ms)
    assert profile.plain_ms > 0
    for k in profile.step_ms:
        # A speculative step verifies K + 1 rows and drafts K tokens: it costs more than one plain token, and the
        # engine's own draft timer is a part of it.
        assert profile.step_ms[k] > profile.plain_ms
        assert 0 < profile.draft_ms[k] < profile.step_ms[k]
    assert "break-even tau" in capsys.readouterr().out


def test_tune_decision_holds_in_the_measured_llamacpp_run(llamacpp_bin, eagle3_head, stories260k_gguf, prompt_file,
                                                          tmp_path, capsys):
    head = shutil.copytree(eagle3_head, tmp_path / "head")
    out = tmp_path / "tune"
    assert main(["tune", "--engine", "llamacpp", "--target", str(stories260k_gguf), "--head", str(head),
                 "--prompts", str(prompt_file), "--max-draft", str(MAX_DRAFT), "--max-new-tokens", "48",
                 "--rounds", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads((head / LLAMACPP_TUNED_NAME).read_text())
    measured = record["measured"]
    print(printed)
    assert record["calibration"]["source"].startswith("llama.cpp")
    assert len(record["calibration"]["acceptance_per_position"]) == MAX_DRAFT
    assert measured["identical_to_plain"] == "8/8"  # lossless in the engine at the measured length
    if record["draft_tokens"]:
        assert measured["draft_tokens"] == record["draft_tokens"]
        assert measured["speedup"] >= 1 - NOISE, measured
    else:
        # "Does not pay": the predicted-best length, measured beside plain decoding, is not faster.
        best = max(record["predictions"], key=lambda p: p["tokens_per_s"])
        assert measured["draft_tokens"] == best["draft_tokens"]
        assert measured["speedup"] <= 1 + NOISE, measured
        assert "does not pay" in printed and "needs" in printed
    card = (out / "export" / "README.md").read_text()
    if record["draft_tokens"]:
        assert f"--spec-draft-n-max {record['draft_tokens']}" in card and "chosen in llama.cpp" in card
    else:
        assert "does not pay in llama.cpp" in card


def test_a_draft_for_another_target_is_refused_in_one_line(llamacpp_bin, stories260k_gguf, tmp_path, capsys):
    from specgraft.packaged import packaged_smollm2_gguf

    other = packaged_smollm2_gguf()
    if other is None:
        pytest.skip("the packaged SmolLM2 GGUF (another tokenizer) is not installed")
    assert main(["profile", "--engine", "llamacpp", "--target", str(stories260k_gguf), "--draft-gguf", str(other),
                 "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "is not a draft for" in err[0]
