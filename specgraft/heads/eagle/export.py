"""EAGLE-1/2's engine layouts (vLLM ``EagleLlamaForCausalLM``, SGLang ``LlamaForCausalLMEagle``) and card text.

Sources (checked facts, see ``specgraft/export/FORMATS.md``): both load ``fc`` and ``layers.{j}.*`` of a Llama
layer with no input norm in layer 0; vLLM's fc has no bias, SGLang's always has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specgraft.export.engine import (
    BIAS_FORMATS,
    EngineCheckpoint,
    SourceState,
    check_llama_compatible,
    draft_dims,
    layer_from_engine,
    layer_has_bias,
    layer_to_engine,
    refuse_bias,
    refuse_leftovers,
    require_zero,
)
from specgraft.export.layouts import TensorRule, llama_layer
from specgraft.export.target_info import TargetInfo, llama_draft_config
from specgraft.heads.family import CardText, EngineExporter

VLLM_LAYOUT = (
    TensorRule("fc.weight", ("hidden", "2*hidden")),
    *llama_layer("layers.{j}", ("j",), input_norm=False),
    TensorRule("layers.{j1}.input_layernorm.weight", ("hidden",), ("j1",)),
)
SGLANG_LAYOUT = (
    TensorRule("fc.weight", ("hidden", "2*hidden")),
    TensorRule("fc.bias", ("hidden",)),
    *llama_layer("layers.{j}", ("j",), input_norm=False),
    TensorRule("layers.{j1}.input_layernorm.weight", ("hidden",), ("j1",)),
)


def to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
              base_model: str, speculative_tokens: int) -> EngineCheckpoint:
    check_llama_compatible(info, fmt, "eagle")
    src = SourceState(state)
    layers = int(cfg["num_layers"])
    qkv_bias, o_bias = layer_has_bias(src, "layers.0")
    bias = qkv_bias or o_bias
    if bias and fmt not in BIAS_FORMATS:
        refuse_bias(fmt, "eagle", "attention biases", (*BIAS_FORMATS, "native"))
    if "fc.bias" in state and fmt == "vllm":
        refuse_bias(fmt, "eagle", "fc bias (vLLM drops it silently)", ("sglang", "native"))
    dims = draft_dims(info, cfg, state, layers, bias)
    tensors = {"fc.weight": src.take("fc.weight")}
    notes = []
    if fmt == "sglang":
        # SGLang's EAGLE fc always has a bias: a head trained without one gets an explicit zero bias.
        if src.has("fc.bias"):
            tensors["fc.bias"] = src.take("fc.bias")
        else:
            tensors["fc.bias"] = torch.zeros(dims.hidden, dtype=tensors["fc.weight"].dtype)
            notes.append("fc.bias written as zeros (SGLang's EAGLE fc always has a bias)")
    for j in range(layers):
        tensors.update(layer_to_engine(src, f"layers.{j}", f"layers.{j}", dims, input_norm=j > 0,
                                        hidden_norm=False))
    refuse_leftovers(src, fmt, "eagle", getattr(info.config, "model_type", "?"))
    config = llama_draft_config(info.config, layers, None, bias)
    # No "bias" key for SGLang: its fc always has a bias, and its Llama layer would read "bias" as attention_bias.
    config["architectures"] = ["LlamaForCausalLM"] if fmt == "vllm" else ["LlamaForCausalLMEagle"]
    return EngineCheckpoint(tensors, config, dims, notes)



def from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], cfg: Mapping[str, Any],
                want: Mapping[str, torch.Tensor], used: set[str],
                target_lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    names = set(want)
    state = {"fc.weight": tensors["fc.weight"]}
    used.add("fc.weight")
    if "fc.bias" in names:
        state["fc.bias"] = tensors["fc.bias"]
        used.add("fc.bias")
    elif "fc.bias" in tensors:
        used.add("fc.bias")
        require_zero(tensors["fc.bias"], "fc.bias")
    for j in range(int(cfg["num_layers"])):
        state.update(layer_from_engine(tensors, f"layers.{j}", f"layers.{j}", names, used))
    return state


def describe(cfg: Mapping[str, Any], size: str) -> str:
    return (f"An EAGLE-1/2 draft{size}: {cfg.get('num_layers')} decoder layer(s) that predict the target's next "
            "feature from its last hidden state and the next token's embedding; the target's embeddings and "
            "lm_head are reused, so the files hold only the draft layers.")


EXPORTERS = {
    "vllm": EngineExporter("model.safetensors", VLLM_LAYOUT, to_engine, from_engine),
    "sglang": EngineExporter("model.safetensors", SGLANG_LAYOUT, to_engine, from_engine),
}
CARD = CardText(title="EAGLE-1/2", describe=describe, vllm_method="eagle", vllm_path_marker=("eagle-", "-eagle-1"),
                sglang_algorithm="EAGLE")
