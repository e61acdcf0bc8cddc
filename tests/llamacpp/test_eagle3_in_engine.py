"""llama.cpp as the test oracle for ``--format llamacpp`` EAGLE-3 exports, on stories260K.

The export is served by the pinned llama.cpp (``llama-server -md draft.gguf --spec-type draft-eagle3``) and must
(1) leave llama.cpp's greedy output unchanged and (2) accept, step by step, what specgraft's own decoder accepts
with the same head at the same chain length on the same prompts. The server logs one ``accepted A/D`` line per
verification step. llama-server takes the first new token from the prompt's own forward and drafts from there,
while specgraft's decoder prefills all but the last prompt token and drafts the first new token too; so specgraft
decodes ``prompt + [first token]`` (the token llama.cpp's plain run produced), which puts every step of both at the
same position as long as they agree. The per-step lists are then compared directly, over the steps in which
llama.cpp drafted the full chain (near the end it shortens drafts to the tokens left). A step can differ only
where two draft or target logits are within float error of each other (ggml's kernels vs torch's): the test counts
those and allows a few. A head exported with a wrong layer id must
fail the same comparison (negative control).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specgraft.decoding.decoder import SpeculativeDecoder, generate_reference
from specgraft.export import export_head
from specgraft.heads.base import load_head
from specgraft.heads.eagle.drafter import drafter_from_setting

from .oracle import CHAINS, NEW_TOKENS, compare, engine_runs, speculative_args

pytestmark = [pytest.mark.llamacpp, pytest.mark.shared, pytest.mark.slow]


def _serve(target_gguf: Path, draft: Path, chain: int) -> list:
    return speculative_args(target_gguf, draft, "draft-eagle3", chain)


@pytest.fixture(scope="module")
def exported(eagle3_head, stories260k_gguf, tmp_path_factory) -> Path:
    return export_head(eagle3_head, "llamacpp", tmp_path_factory.mktemp("export") / "eagle3",
                       target_gguf=stories260k_gguf).path / "draft.gguf"


@pytest.fixture(scope="module")
def ours(eagle3_head, stories_target, story_prompts, plain) -> dict[int, list]:
    """specgraft's decoder with the same head: ``prompt + [first token]``, the rest of the generation."""
    head = load_head(stories_target, eagle3_head)
    out = {}
    for chain in CHAINS:
        decoder = SpeculativeDecoder(stories_target, drafter=drafter_from_setting(head, {"mode": "chain",
                                                                                         "depth": chain}),
                                     ignore_eos=True)
        out[chain] = [decoder.generate([*ids, run.tokens[0]], NEW_TOKENS - 1)
                      for ids, run in zip(story_prompts, plain)]
    return out


def test_target_gguf_decodes_as_the_transformers_target(plain, stories_target, story_prompts):
    """The stories260K GGUF (written with the gguf package) is the same model in llama.cpp: greedy outputs equal
    transformers' on every prompt."""
    for run, ids in zip(plain, story_prompts):
        assert run.tokens == generate_reference(stories_target.model, ids, NEW_TOKENS, ignore_eos=True)


def test_eagle3_export_in_llamacpp_is_lossless_and_accepts_what_specgraft_accepts(
        llamacpp_bin, exported, stories260k_gguf, story_prompts, plain, ours, record_property):
    results = []
    for chain in CHAINS:
        engine = engine_runs(_serve(stories260k_gguf, exported, chain), story_prompts)
        for run, reference, mine in zip(engine, plain, ours[chain]):
            assert run.tokens == reference.tokens  # lossless in the engine
            assert [reference.tokens[0], *mine.generated_ids] == reference.tokens  # the same sequence in specgraft
            assert sum(a for a, _ in run.steps) == run.accepted and sum(d for _, d in run.steps) == run.drafted
        comparison = compare(chain, engine, ours[chain])
        results.append(comparison)
        assert comparison.engine_accepted > comparison.steps // 4, comparison  # the short-trained head drafts
    record_property("llamacpp_vs_specgraft", json.dumps([c.__dict__ for c in results]))
    print("\n".join(f"chain {c.chain}: {c.steps} steps, llama.cpp accepted {c.engine_accepted}, specgraft "
                    f"{c.specgraft_accepted}, {c.differing_steps} step(s) differ" for c in results))
    assert all(c.agrees for c in results), results


def test_wrong_layer_id_fails_the_engine_check(llamacpp_bin, eagle3_head, stories260k_gguf, story_prompts, ours,
                                               tmp_path):
    """Negative control: the same weights exported with the fused layers numbered one lower where possible (the
    SGLang/TRT-LLM numbering mistake: [1, 3, 4] -> [1, 2, 3]) load and run in llama.cpp but no longer accept what
    specgraft accepts."""
    wrong_head = shutil.copytree(eagle3_head, tmp_path / "wrong-head")
    config_file = wrong_head / "head_config.json"
    config = json.loads(config_file.read_text())
    right = [int(i) for i in config["config"]["feature_layers"]]
    config["config"]["feature_layers"] = [max(1, i - 1) for i in right]
    assert config["config"]["feature_layers"] != right
    config_file.write_text(json.dumps(config))
    wrong = export_head(wrong_head, "llamacpp", tmp_path / "wrong", target_gguf=stories260k_gguf).path / "draft.gguf"
    chain = 3
    engine = engine_runs(_serve(stories260k_gguf, wrong, chain), story_prompts)
    comparison = compare(chain, engine, ours[chain])
    print(f"wrong layer ids: {comparison}")
    assert not comparison.agrees, comparison
