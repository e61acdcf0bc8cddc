"""llama.cpp as the oracle for a distilled draft model exported with ``--format llamacpp`` and served with
``llama-server -md draft.gguf --spec-type draft-simple``: llama.cpp's greedy output is unchanged, and its per-step
acceptance equals specgraft's decoder with the same draft at the same draft length (schedules aligned as in
test_eagle3_in_engine.py)."""

from __future__ import annotations

import pytest

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.distill.output import draft_drafter
from specgraft.export import export_head

from .oracle import MAX_DIFFERING_STEPS, NEW_TOKENS, compare, engine_runs, speculative_args

pytestmark = [pytest.mark.llamacpp, pytest.mark.shared, pytest.mark.slow]


def test_distilled_draft_in_llamacpp_accepts_what_specgraft_accepts(
        llamacpp_bin, distilled_draft, stories_target, stories260k_gguf, story_prompts, plain, tmp_path):
    draft = export_head(distilled_draft, "llamacpp", tmp_path / "draft", target_gguf=stories260k_gguf).path
    lines = []
    for k in (2, 4):
        engine = engine_runs(speculative_args(stories260k_gguf, draft / "draft.gguf", "draft-simple", k), story_prompts)
        decoder = SpeculativeDecoder(stories_target, drafter=draft_drafter(distilled_draft, stories_target, k=k),
                                     ignore_eos=True)
        ours = [decoder.generate([*ids, run.tokens[0]], NEW_TOKENS - 1) for ids, run in zip(story_prompts, plain)]
        for run, reference, mine in zip(engine, plain, ours):
            assert run.tokens == reference.tokens
            assert [reference.tokens[0], *mine.generated_ids] == reference.tokens
        comparison = compare(k, engine, ours)
        lines.append(f"draft model k={k}: {comparison.steps} steps, llama.cpp accepted {comparison.engine_accepted}, "
                     f"specgraft {comparison.specgraft_accepted}, {comparison.differing_steps} step(s) differ")
        assert comparison.engine_accepted > comparison.steps // 4, comparison
        assert comparison.differing_steps <= MAX_DIFFERING_STEPS, comparison
    print("\n".join(lines))
