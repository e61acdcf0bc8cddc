"""The llama.cpp export's card carries what ``specgraft tune --engine llamacpp`` chose: the tuned draft length as the
serve flags (or why speculation does not pay), only for the target GGUF it was tuned with, and never over an explicit
``speculative_tokens``."""

from __future__ import annotations

import json
import shutil

from specgraft.export import export_head
from specgraft.tuning.llamacpp import LLAMACPP_TUNED_NAME, LlamacppProfile, choose, predict, tuned_record

COSTS = dict(target_gguf="tiny-llama.gguf", draft_gguf="draft.gguf", spec_type="draft-eagle3", threads=1,
             cpu="test-cpu", prompt_tokens=32, new_tokens=32, rounds=1, plain_ms=10.0,
             step_ms={1: 14.0, 2: 17.0, 3: 20.0}, draft_ms={1: 2.0, 2: 4.0, 3: 6.0})


def _tuned_head(saved_heads, tmp_path, acceptance, target_gguf="tiny-llama.gguf"):
    head = shutil.copytree(saved_heads["eagle3"], tmp_path / "head")
    profile = LlamacppProfile(**dict(COSTS, target_gguf=target_gguf))
    predictions = predict(profile, acceptance)
    chosen = choose(predictions)
    measured = {"draft_tokens": (chosen or predictions[0]).draft_tokens, "speedup": 1.2 if chosen else 0.8,
                "tokens_per_s": 120.0, "plain_tokens_per_s": 100.0}
    record = tuned_record(profile, acceptance, predictions, chosen, measured, {}, 1.0)
    (head / LLAMACPP_TUNED_NAME).write_text(json.dumps(record))
    return head


def test_tuned_draft_length_becomes_the_serve_flag(saved_heads, llama_target_gguf, tmp_path):
    head = _tuned_head(saved_heads, tmp_path, [0.7, 0.5, 0.35])  # K=2 is the fastest
    out = export_head(head, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf).path
    card = (out / "README.md").read_text()
    assert "--spec-draft-n-max 2 " in card and "Draft length 2 was chosen in llama.cpp" in card
    assert json.loads((out / "specgraft_export.json").read_text())["llamacpp"]["tuned"]["draft_tokens"] == 2
    # An explicit length wins over the tuned one.
    out = export_head(head, "llamacpp", tmp_path / "o4", target_gguf=llama_target_gguf, speculative_tokens=4).path
    assert "--spec-draft-n-max 4 " in (out / "README.md").read_text()


def test_plain_choice_explains_itself_and_another_target_is_ignored(saved_heads, llama_target_gguf, tmp_path):
    head = _tuned_head(saved_heads, tmp_path, [0.2, 0.05, 0.0])
    card = (export_head(head, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf).path / "README.md").read_text()
    assert "does not pay in llama.cpp" in card and "1.40 tokens per step" in card
    other = _tuned_head(saved_heads, tmp_path / "x", [0.7, 0.5, 0.35], target_gguf="another.gguf")
    result = export_head(other, "llamacpp", tmp_path / "o2", target_gguf=llama_target_gguf)
    assert any("tuned with another.gguf" in w for w in result.warnings)
    assert "chosen in llama.cpp" not in (result.path / "README.md").read_text()
