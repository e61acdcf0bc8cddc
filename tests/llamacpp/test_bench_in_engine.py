"""benchmarks/bench_llamacpp.py's measurement in the pinned llama.cpp, on stories260K: the GGUF and its Q8_0
requantization (by llama.cpp's own ``llama-quantize``), each served plain, with the EAGLE-3 export at two draft
lengths and with n-gram drafting, interleaved. Every speculative output must equal plain decoding of the same target
GGUF (lossless in the engine, per quantization), the per-position counters must add up to the accepted totals, and
the trained head must be accepted on both targets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from specgraft.export import export_head

pytestmark = [pytest.mark.llamacpp, pytest.mark.shared, pytest.mark.slow]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def bench():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the script imports benchlib as its siblings do
    spec = importlib.util.spec_from_file_location("bench_llamacpp", BENCHMARKS / "bench_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_interleaved_targets_and_drafts_are_lossless_and_counted(bench, llamacpp_bin, eagle3_head, stories260k_gguf,
                                                                 story_prompts, tmp_path):
    draft = export_head(eagle3_head, "llamacpp", tmp_path / "eagle3", target_gguf=stories260k_gguf).path
    q8 = bench.requantize(llamacpp_bin, stories260k_gguf, "Q8_0", tmp_path / "quant", threads=1)
    assert bench.gguf_file_type(q8) == "Q8_0"
    assert bench.requantize(llamacpp_bin, stories260k_gguf, "Q8_0", tmp_path / "quant", threads=1) == q8  # reused
    targets = {bench.gguf_file_type(stories260k_gguf): stories260k_gguf, "Q8_0": q8}
    configs = bench.configurations(targets, {"eagle3": (draft / "draft.gguf", "draft-eagle3")}, [1, 3], ngram_max=4)
    prompts = [(f"story{i % 2}", ids) for i, ids in enumerate(story_prompts[:4])]
    rows = bench.measure(configs, prompts, NEW_TOKENS, threads=1, max_positions=4, tokenize=False, ctx_size=256)

    for config in configs:
        plain = rows[f"{config.target} plain"]
        for run, reference in zip(rows[config.name], plain):
            assert run["output"] == reference["output"], config.name  # lossless in the engine, per target
            assert len(run["output"]) == NEW_TOKENS
            assert sum(run["accepted_per_pos"]) == run["accepted"], config.name  # the counters agree
            assert run["tokens"] == NEW_TOKENS  # the engine's own count
    results, per_domain = bench.aggregate(configs, rows)
    assert set(per_domain) == {"story0", "story1"}
    for target in targets:
        eagle = results[f"{target} eagle3-k3"]
        assert eagle["tau"] > 1.2, (target, eagle)  # the short-trained head is accepted on both quantizations
        assert eagle["identical_to_plain"] == f"{len(prompts)}/{len(prompts)}"
        positions = eagle["acceptance_per_position"]
        assert len(positions) == 3 and positions == sorted(positions, reverse=True)  # a chain accepts a prefix
    assert len(bench.cost_models(configs, results)) == len(targets)
