"""The engine-layout primitives a head family's ``export.py`` builds its converters from: the converted checkpoint
(:class:`EngineCheckpoint`), a state dict consumed tensor by tensor (:class:`SourceState`), the Llama decoder layer
mapping both ways (shared by EAGLE-1 and EAGLE-3) and the refusals of what an engine's layout cannot hold.

Nothing here looks a family up: :mod:`specgraft.export.convert` dispatches to the registered families' exporters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.export.layouts import Dims
from specgraft.export.target_info import TargetInfo

#: The engine's attention projections, in q/k/v order.
_QKV = ("q_proj", "k_proj", "v_proj")

#: Formats whose Llama layer can take ``attention_bias`` (q/k/v/o biases).
BIAS_FORMATS = ("vllm",)

#: Activations the engines' Llama MLP implements.
_LLAMA_ACTIVATIONS = ("silu",)

#: EAGLE-3 default number of fused target layers (the engines' fc is sized for exactly this many).
ENGINE_NUM_FEATURES = 3


@dataclass
class EngineCheckpoint:
    """An engine layout of a head: its tensors, its config.json and facts worth telling the user."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    dims: Dims
    notes: list[str] = field(default_factory=list)
    expected: dict[str, tuple[tuple[int, ...], str]] | None = None
    """The engine's exact tensors (name -> shape, dtype kind) when the family's exporter has no layout table
    (its converter derives them from the engine config, e.g. DFlash); None: the exporter's layout table."""


class SourceState:
    """A head state dict whose tensors are marked as they are consumed (leftovers cannot be held)."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = dict(state)
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.state

    def take(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.state[name]

    def leftovers(self) -> list[str]:
        return sorted(set(self.state) - self.used)


# ----------------------------------------------------------------------------------------------------------------
# Llama-layer mapping (shared by EAGLE-1 and EAGLE-3)


def layer_has_bias(src: SourceState, prefix: str) -> tuple[bool, bool]:
    """(q/k/v have biases, o_proj has a bias) in our layer ``prefix``."""
    qkv = src.has(f"{prefix}.self_attn.q_proj.bias") or src.has(f"{prefix}.self_attn.qkv_proj.bias")
    return qkv, src.has(f"{prefix}.self_attn.o_proj.bias")


def layer_to_engine(src: SourceState, ours: str, theirs: str, dims: Dims, *, input_norm: bool,
                     hidden_norm: bool) -> dict[str, torch.Tensor]:
    """Our layer ``ours`` -> the engine's Llama layer ``theirs`` (split fused projections, Llama biases)."""
    out: dict[str, torch.Tensor] = {}
    sizes = [dims.q_size, dims.kv_size, dims.kv_size]
    for kind in ("weight", "bias"):
        fused = f"{ours}.self_attn.qkv_proj.{kind}"
        if src.has(fused):
            for proj, part in zip(_QKV, src.take(fused).split(sizes, dim=0)):
                out[f"{theirs}.self_attn.{proj}.{kind}"] = part.contiguous()
        else:
            for proj in _QKV:
                name = f"{ours}.self_attn.{proj}.{kind}"
                if src.has(name) or kind == "weight":
                    out[f"{theirs}.self_attn.{proj}.{kind}"] = src.take(name)
    out[f"{theirs}.self_attn.o_proj.weight"] = src.take(f"{ours}.self_attn.o_proj.weight")
    if src.has(f"{ours}.self_attn.o_proj.bias"):
        out[f"{theirs}.self_attn.o_proj.bias"] = src.take(f"{ours}.self_attn.o_proj.bias")
    if dims.attention_bias:
        # Llama's attention_bias gives all four projections a bias; a projection without one is a zero bias.
        for proj, size in zip((*_QKV, "o_proj"), (*sizes, dims.hidden)):
            name = f"{theirs}.self_attn.{proj}.bias"
            if name not in out:
                weight = out[f"{theirs}.self_attn.{proj}.weight"]
                out[name] = torch.zeros(size, dtype=weight.dtype)
    fused = f"{ours}.mlp.gate_up_proj.weight"
    if src.has(fused):
        gate, up = src.take(fused).split([dims.intermediate, dims.intermediate], dim=0)
        out[f"{theirs}.mlp.gate_proj.weight"] = gate.contiguous()
        out[f"{theirs}.mlp.up_proj.weight"] = up.contiguous()
    else:
        out[f"{theirs}.mlp.gate_proj.weight"] = src.take(f"{ours}.mlp.gate_proj.weight")
        out[f"{theirs}.mlp.up_proj.weight"] = src.take(f"{ours}.mlp.up_proj.weight")
    out[f"{theirs}.mlp.down_proj.weight"] = src.take(f"{ours}.mlp.down_proj.weight")
    out[f"{theirs}.post_attention_layernorm.weight"] = src.take(f"{ours}.post_attention_layernorm.weight")
    if input_norm:
        out[f"{theirs}.input_layernorm.weight"] = src.take(f"{ours}.input_layernorm.weight")
    if hidden_norm:
        out[f"{theirs}.hidden_norm.weight"] = src.take(f"{ours}.hidden_norm.weight")
    return out


def layer_from_engine(eng: Mapping[str, torch.Tensor], theirs: str, ours: str, want: set[str],
                       used: set[str]) -> dict[str, torch.Tensor]:
    """The engine's Llama layer ``theirs`` -> our layer ``ours`` with exactly the names in ``want``."""

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return eng[name]

    out: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias"):
        parts = [f"{theirs}.self_attn.{p}.{kind}" for p in _QKV]
        if f"{ours}.self_attn.qkv_proj.{kind}" in want:
            out[f"{ours}.self_attn.qkv_proj.{kind}"] = torch.cat([take(p) for p in parts], dim=0)
            continue
        for proj, name in zip(_QKV, parts):
            target_name = f"{ours}.self_attn.{proj}.{kind}"
            if target_name in want:
                out[target_name] = take(name)
            elif name in eng:
                require_zero(take(name), name)
    out[f"{ours}.self_attn.o_proj.weight"] = take(f"{theirs}.self_attn.o_proj.weight")
    o_bias = f"{theirs}.self_attn.o_proj.bias"
    if f"{ours}.self_attn.o_proj.bias" in want:
        out[f"{ours}.self_attn.o_proj.bias"] = take(o_bias)
    elif o_bias in eng:
        require_zero(take(o_bias), o_bias)
    gate, up = take(f"{theirs}.mlp.gate_proj.weight"), take(f"{theirs}.mlp.up_proj.weight")
    if f"{ours}.mlp.gate_up_proj.weight" in want:
        out[f"{ours}.mlp.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
    else:
        out[f"{ours}.mlp.gate_proj.weight"], out[f"{ours}.mlp.up_proj.weight"] = gate, up
    out[f"{ours}.mlp.down_proj.weight"] = take(f"{theirs}.mlp.down_proj.weight")
    for norm in ("post_attention_layernorm", "input_layernorm", "hidden_norm"):
        if f"{ours}.{norm}.weight" in want:
            out[f"{ours}.{norm}.weight"] = take(f"{theirs}.{norm}.weight")
    return out


def require_zero(tensor: torch.Tensor, name: str) -> None:
    if bool(tensor.any()):
        raise SpecgraftError(f"exported tensor {name} is not zero but this target's layers have no such bias; the "
                             "export was edited or made for another target")


# ----------------------------------------------------------------------------------------------------------------
# Checks shared by the EAGLE exports


def draft_dims(info: TargetInfo, head_cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                draft_layers: int, attention_bias: bool, **extra: Any) -> Dims:
    config = info.config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return Dims(hidden=int(config.hidden_size), vocab=int(config.vocab_size), draft_layers=draft_layers,
                q_size=heads * head_dim, kv_size=kv_heads * head_dim, intermediate=int(config.intermediate_size),
                attention_bias=attention_bias, fc_bias="fc.bias" in state, **extra)


def check_llama_compatible(info: TargetInfo, fmt: str, head_type: str) -> None:
    """Config-level facts a Llama draft layer cannot reproduce."""
    config = info.config
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    problems = []
    if act not in _LLAMA_ACTIVATIONS:
        problems.append(f"activation {act}")
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    partial = partial if partial is not None else getattr(config, "partial_rotary_factor", None)
    if partial is not None and float(partial) != 1.0:
        problems.append(f"partial rotary factor {partial}")
    if getattr(config, "attn_logit_softcapping", None):
        problems.append("attention logit soft-capping")
    if problems:
        raise SpecgraftError(f"{fmt} runs {head_type} drafts as Llama layers, which cannot reproduce this "
                             f"{getattr(config, 'model_type', '?')} target's {', '.join(problems)}; export the head "
                             "as native instead")


def refuse_leftovers(src: SourceState, fmt: str, head_type: str, model_type: str) -> None:
    left = src.leftovers()
    if left:
        raise SpecgraftError(f"the {fmt} layout cannot hold tensors {left[:6]} of this {head_type} head (its "
                             f"{model_type} layers are not Llama layers); export it as native instead")


def refuse_bias(fmt: str, head_type: str, what: str, allowed: tuple[str, ...]) -> None:
    raise SpecgraftError(f"the {fmt} {head_type} layout has no {what}, which this head has; export it as one of "
                         f"{', '.join(allowed)}")


def engine_layer_ids(feature_layers: list[int], fmt: str) -> list[int]:
    """Fused target layers (EAGLE-3's, DFlash's aux layers) as ``fmt`` numbers them.

    Ours are transformers ``output_hidden_states`` indices (i = the output of decoder layer i-1). vLLM and the
    speculators package use the same numbers (vLLM captures the residual stream entering layer i); SGLang and
    TensorRT-LLM number the decoder layer whose OUTPUT is captured, i.e. i-1 (SGLang adds 1 back when loading).
    llama.cpp captures the INPUT of target layer i (``llama_set_embeddings_layer_inp``): our numbers.
    """
    same = ("vllm", "native", "llamacpp")
    return [int(i) for i in feature_layers] if fmt in same else [int(i) - 1 for i in feature_layers]
