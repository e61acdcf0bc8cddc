"""The layout tables and the checks built on them."""

from __future__ import annotations

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.export.engine import engine_layer_ids
from specgraft.export.formats import expected_tensors
from specgraft.export.layouts import Dims, check_tensors
from specgraft.export.target_info import rope_fields
from specgraft.testing import tiny_config


def test_medusa_vllm_table_with_a_shared_lm_head():
    dims = Dims(hidden=8, vocab=20, num_heads=3, medusa_layers=2, shared_lm_head=True)
    table = expected_tensors("medusa", "vllm", dims)
    assert {n for n in table if n.startswith("lm_heads")} == {"lm_heads.0.weight"}
    assert table["blocks.2.layers.1.weight"] == ((8, 8), "float") and len(table) == 3 * 2 * 2 + 1


def test_eagle3_tables_differ_where_the_engines_do():
    dims = Dims(hidden=8, vocab=20, draft_vocab=20, draft_layers=1, q_size=8, kv_size=4, intermediate=16)
    vllm, trt = expected_tensors("eagle3", "vllm", dims), expected_tensors("eagle3", "trtllm", dims)
    assert vllm["layers.0.self_attn.q_proj.weight"] == ((8, 16), "float")
    assert vllm["fc.weight"] == ((8, 24), "float") and vllm["d2t"] == ((20,), "int64") and vllm["t2d"][1] == "bool"
    # TensorRT-LLM has no t2d, and d2t only for a reduced draft vocabulary.
    assert "t2d" not in trt and "d2t" not in trt
    assert "d2t" in expected_tensors("eagle3", "trtllm", Dims(**{**dims.__dict__, "draft_vocab_smaller": True}))


def test_check_tensors_names_every_kind_of_mismatch():
    expected = {"a": ((2,), "float"), "d2t": ((3,), "int64")}
    good = {"a": torch.zeros(2), "d2t": torch.zeros(3, dtype=torch.int64)}
    check_tensors(good, expected, "x")
    with pytest.raises(SpecgraftError, match=r"missing \['d2t'\]"):
        check_tensors({"a": torch.zeros(2)}, expected, "x")
    with pytest.raises(SpecgraftError, match=r"unexpected \['b'\]"):
        check_tensors({**good, "b": torch.zeros(1)}, expected, "x")
    with pytest.raises(SpecgraftError, match=r"shape \(3,\)"):
        check_tensors({**good, "a": torch.zeros(3)}, expected, "x")
    with pytest.raises(SpecgraftError, match="dtype torch.float32"):
        check_tensors({**good, "d2t": torch.zeros(3)}, expected, "x")


def test_layer_id_conventions():
    assert engine_layer_ids([2, 16, 29], "vllm") == [2, 16, 29]
    assert engine_layer_ids([2, 16, 29], "sglang") == [1, 15, 28] == engine_layer_ids([2, 16, 29], "trtllm")


def test_rope_fields_from_transformers5_and_legacy_configs():
    plain = rope_fields(tiny_config("llama"))
    assert plain["rope_theta"] == 10000.0 and plain["rope_scaling"] is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 256, "rope_theta": 500000.0}
    scaled = rope_fields(tiny_config("llama", rope_parameters=llama3))
    assert scaled["rope_theta"] == 500000.0
    assert scaled["rope_scaling"] == {"rope_type": "llama3", "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    legacy = type("Cfg", (), {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 4.0}})()
    assert rope_fields(legacy)["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 4.0}
