"""Tensor and config conversion between specgraft heads and the engines' layouts, both ways.

``to_engine`` maps a head's state dict (``head.safetensors``) onto one engine layout and builds the engine's
``config.json``; ``from_engine`` maps an exported folder's tensors back onto the state dict of a specgraft head,
which is how the round-trip tests prove that an export holds exactly the trained head.

The engines run EAGLE drafts as Llama layers. Heads of targets whose layers are Llama layers with a different
packing are converted: Phi-3's fused ``qkv_proj``/``gate_up_proj`` are split (and fused back on load), and
Qwen2's q/k/v biases are written with Llama's ``attention_bias`` (which also gives ``o_proj`` a bias; it is
written as zeros, and must read back as zeros). Anything the Llama layout cannot hold (Qwen3's q/k norms,
Gemma's sandwich norms, MLP biases, ...) is refused, never dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.export.layouts import Dims, check_tensors, engine_exporter, expected_tensors
from specgraft.export.options import DEFAULT_SPECULATIVE_TOKENS
from specgraft.export.target_info import TargetInfo

logger = logging.getLogger(__name__)

#: The engine's attention projections, in q/k/v order.
_QKV = ("q_proj", "k_proj", "v_proj")

#: Formats whose Llama layer can take ``attention_bias`` (q/k/v/o biases).
BIAS_FORMATS = ("vllm",)

#: Activations the engines' Llama MLP implements.
_LLAMA_ACTIVATIONS = ("silu",)

#: EAGLE-3 default number of fused target layers (the engines' fc is sized for exactly this many).
ENGINE_NUM_FEATURES = 3


def tuned_engine_settings(tuned: Mapping[str, Any]) -> dict[str, Any]:
    """Engine settings for a ``tuned.json`` record (``specgraft tune``): vLLM's ``num_speculative_tokens``, SGLang's
    ``--speculative-num-steps/--speculative-eagle-topk/--speculative-num-draft-tokens`` (root counted) and
    TensorRT-LLM's ``max_draft_len`` (plus ``medusa_choices`` for a Medusa tree)."""
    from specgraft.eval.tune import is_plain

    setting = tuned.get("setting") or {}
    kind = tuned.get("kind")
    if is_plain(setting):
        # Tuned to plain decoding on its device: nothing to say about draft lengths (engines keep their defaults).
        return {}
    if kind == "medusa":
        depth = int(setting["depth"])
        choices = [list(p) for p in setting.get("paths") or []]
        # No vLLM entry: vLLM's Medusa runs every exported head and needs num_speculative_tokens == num_heads, so
        # a tuned tree only reaches engines that take the tree itself (TensorRT-LLM's medusa_choices).
        return {"trtllm": {"max_draft_len": depth, "medusa_choices": choices}}
    if kind == "eagle":
        depth = int(setting["depth"])
        tree = setting.get("mode") == "tree"
        top_k = int(setting["top_k"]) if tree else 1
        tokens = int(setting["total_tokens"]) if tree else depth + 1
        return {"vllm": {"num_speculative_tokens": depth},
                "sglang": {"speculative_num_steps": depth, "speculative_eagle_topk": top_k,
                           "speculative_num_draft_tokens": tokens},
                "trtllm": {"max_draft_len": depth}}
    k = int(setting.get("k") or setting.get("depth") or DEFAULT_SPECULATIVE_TOKENS)
    return {"vllm": {"num_speculative_tokens": k}, "trtllm": {"max_draft_len": k}}


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


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return tensors
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


# ----------------------------------------------------------------------------------------------------------------
# Head -> engine


def to_engine(head_type: str, fmt: str, state: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
              info: TargetInfo, *, base_model: str, dtype: torch.dtype | None = None,
              speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> EngineCheckpoint:
    """Convert a validated head state dict to ``fmt``'s layout and config (the family's registered exporter),
    checked against the family's layout table."""
    exporter = engine_exporter(head_type, fmt)
    ckpt = exporter.to_engine(fmt, state, meta["config"], info, base_model, speculative_tokens)
    ckpt.tensors = _cast(ckpt.tensors, dtype)
    if exporter.container == "safetensors":  # a GGUF's tensors carry their own types
        _set_dtype(ckpt.config, str(dtype or _state_dtype(state)).replace("torch.", ""))
    expected = ckpt.expected if ckpt.expected is not None else expected_tensors(head_type, fmt, ckpt.dims)
    check_tensors(ckpt.tensors, expected, f"the {fmt} export")
    return ckpt


def _family_title(name: str) -> str:
    from specgraft.heads.registry import family_names, get_family

    card = get_family(name).card if name in family_names() else None
    return card.title if card is not None else name


def _require_speculators_type(config: Mapping[str, Any], expected: str | None, head_type: str) -> None:
    """Refuse a speculators export of another algorithm read back as ``head_type`` (e.g. DFlash as EAGLE-3)."""
    found = config.get("speculators_model_type")
    if expected is None or found is None or found == expected:
        return
    raise SpecgraftError(f"this export is a {_family_title(str(found))} draft (speculators_model_type {found!r}), "
                         f"not {_family_title(head_type)}; load it as the {found} head it is")


def _require_own_architecture(config: Mapping[str, Any], fmt: str, head_type: str) -> None:
    """Refuse an export whose ``architectures`` another family's ``fmt`` layout claims (e.g. SGLang's
    ``DFlashDraftModel`` read back as EAGLE-3)."""
    from specgraft.heads.registry import family_names, get_family

    found = config.get("architectures")
    found = {str(a) for a in found} if isinstance(found, list) else set()
    for name in family_names():
        other = get_family(name).exporters.get(fmt)
        if name != head_type and other is not None and found & set(other.architectures):
            raise SpecgraftError(f"this export is a {_family_title(name)} draft (architectures {sorted(found)}), not "
                                 f"{_family_title(head_type)}; load it as the {name} head it is")


def _state_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    for tensor in state.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _set_dtype(config: dict[str, Any], dtype_name: str) -> None:
    config["torch_dtype"] = dtype_name
    inner = config.get("transformer_layer_config")
    if isinstance(inner, dict):
        inner["torch_dtype"] = dtype_name


def apply_tuned(config: dict[str, Any], head_type: str, fmt: str, engines: Mapping[str, Any]) -> None:
    """Write a tuned setting into an engine config through the family's ``apply_tuned`` hook (e.g. TensorRT-LLM
    Medusa's ``medusa_choices``, the tree); families without the hook take their settings from the command line."""
    from specgraft.heads.registry import get_family

    hook = get_family(head_type).hooks.get("apply_tuned")
    if hook is not None:
        hook(config, fmt, engines)


# ----------------------------------------------------------------------------------------------------------------
# Engine -> head


def from_engine(head_type: str, fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                head_cfg: Mapping[str, Any], want: Mapping[str, torch.Tensor],
                target_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Map an exported folder's tensors back onto a head state dict with exactly the names/shapes of ``want``
    (the state dict of a freshly built head of the same config). Unused exported tensors are an error."""
    used: set[str] = set()
    names = set(want)
    exporter = engine_exporter(head_type, fmt)
    _require_speculators_type(config, exporter.speculators_model_type, head_type)
    _require_own_architecture(config, fmt, head_type)
    state = exporter.from_engine(fmt, tensors, config, head_cfg, want, used, target_lm_head)
    left = sorted(set(tensors) - used)
    if left:
        raise SpecgraftError(f"the export holds tensors {left[:6]} that a {head_type} head of this config does not "
                             "have; the export was edited or made for another head")
    missing = sorted(names - set(state))
    if missing:
        raise SpecgraftError(f"the export lacks the head tensors {missing[:6]}; re-export the head")
    return state
