"""llama.cpp as the test oracle for ``--format llamacpp`` DFlash exports, on stories260K.

The export is served by the pinned llama.cpp (``llama-server -md draft.gguf --spec-type draft-dflash``) and must
(1) leave llama.cpp's greedy output unchanged and (2) accept, step by step, what specgraft's own decoder accepts
with the same head at the same chain length on the same prompts (prompt alignment and step comparison as in
test_eagle3_in_engine.py). llama.cpp drafts ``--spec-draft-n-max k`` tokens from a block of ``k + 1`` slots (the
anchor and ``k`` masks), not from the first slots of the trained block, so specgraft's drafter runs the same
``k + 1`` slots (``DFlashDrafter(block_size=k + 1)``). A head exported with wrong target layer ids must fail the
same comparison (negative control).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.export import export_head
from specgraft.heads.base import load_head
from specgraft.heads.dflash.drafter import DFlashDrafter

from .oracle import CHAINS, NEW_TOKENS, compare, engine_runs, speculative_args

pytestmark = [pytest.mark.llamacpp, pytest.mark.shared, pytest.mark.slow]


def _serve(target_gguf: Path, draft: Path, chain: int) -> list:
    return speculative_args(target_gguf, draft, "draft-dflash", chain)


@pytest.fixture(scope="module")
def exported(dflash_head, stories260k_gguf, tmp_path_factory) -> Path:
    return export_head(dflash_head, "llamacpp", tmp_path_factory.mktemp("export") / "dflash",
                       target_gguf=stories260k_gguf).path / "draft.gguf"


@pytest.fixture(scope="module")
def ours(dflash_head, stories_target, story_prompts, plain) -> dict[int, list]:
    """specgraft's decoder with the same head, a block of chain + 1 slots: ``prompt + [first token]``, the rest."""
    head = load_head(stories_target, dflash_head)
    out = {}
    for chain in CHAINS:
        drafter = DFlashDrafter(head, mode="chain", depth=chain, block_size=chain + 1)
        decoder = SpeculativeDecoder(stories_target, drafter=drafter, ignore_eos=True)
        out[chain] = [decoder.generate([*ids, run.tokens[0]], NEW_TOKENS - 1)
                      for ids, run in zip(story_prompts, plain)]
    return out


def test_dflash_export_in_llamacpp_is_lossless_and_accepts_what_specgraft_accepts(
        llamacpp_bin, exported, stories260k_gguf, story_prompts, plain, ours, record_property):
    results = []
    for chain in CHAINS:
        engine = engine_runs(_serve(stories260k_gguf, exported, chain), story_prompts)
        for run, reference, mine in zip(engine, plain, ours[chain]):
            assert run.tokens == reference.tokens  # lossless in the engine
            assert [reference.tokens[0], *mine.generated_ids] == reference.tokens  # the same sequence in specgraft
            assert sum(a for a, _ in run.steps) == run.accepted and sum(d for _, d in run.steps) == run.drafted
        results.append(compare(chain, engine, ours[chain]))
    record_property("llamacpp_vs_specgraft", json.dumps([c.__dict__ for c in results]))
    print("\n".join(f"dflash chain {c.chain}: {c.steps} steps, llama.cpp accepted {c.engine_accepted}, specgraft "
                    f"{c.specgraft_accepted}, {c.differing_steps} step(s) differ" for c in results))
    assert all(c.agrees for c in results), results
    trained = results[-1]  # chain 4: the block of 5 the recipe trains
    assert trained.engine_accepted > trained.steps // 4, trained  # the short-trained head drafts


def test_wrong_target_layer_ids_fail_the_engine_check(llamacpp_bin, dflash_head, stories260k_gguf, story_prompts,
                                                      ours, tmp_path):
    """Negative control: the same weights exported with the fused layers numbered one lower where possible (the
    SGLang numbering mistake) load and run in llama.cpp but no longer accept what specgraft accepts."""
    wrong_head = shutil.copytree(dflash_head, tmp_path / "wrong-head")
    config_file = wrong_head / "head_config.json"
    config = json.loads(config_file.read_text())
    right = [int(i) for i in config["config"]["aux_layer_ids"]]
    config["config"]["aux_layer_ids"] = [max(1, i - 1) for i in right]
    assert config["config"]["aux_layer_ids"] != right
    config_file.write_text(json.dumps(config))
    wrong = export_head(wrong_head, "llamacpp", tmp_path / "wrong", target_gguf=stories260k_gguf).path / "draft.gguf"
    chain = 4
    engine = engine_runs(_serve(stories260k_gguf, wrong, chain), story_prompts)
    comparison = compare(chain, engine, ours[chain])
    print(f"dflash, wrong target layer ids: {comparison}")
    assert not comparison.agrees, comparison
