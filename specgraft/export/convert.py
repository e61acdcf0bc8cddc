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
from specgraft.export.layouts import Dims, check_tensors, expected_tensors
from specgraft.export.target_info import TargetInfo, llama_draft_config

logger = logging.getLogger(__name__)

#: The engine's attention projections, in q/k/v order.
_QKV = ("q_proj", "k_proj", "v_proj")

#: Formats whose Llama layer can take ``attention_bias`` (q/k/v/o biases).
_BIAS_FORMATS = ("vllm",)

#: Activations the engines' Llama MLP implements.
_LLAMA_ACTIVATIONS = ("silu",)

#: EAGLE-3 default number of fused target layers (the engines' fc is sized for exactly this many).
ENGINE_NUM_FEATURES = 3

#: vLLM's EAGLE-3 / speculators defaults written into speculators_config.
DEFAULT_SPECULATIVE_TOKENS = 3


def tuned_engine_settings(tuned: Mapping[str, Any]) -> dict[str, Any]:
    """Engine settings for a ``tuned.json`` record (``specgraft tune``): vLLM's ``num_speculative_tokens``, SGLang's
    ``--speculative-num-steps/--speculative-eagle-topk/--speculative-num-draft-tokens`` (root counted) and
    TensorRT-LLM's ``max_draft_len`` (plus ``medusa_choices`` for a Medusa tree)."""
    setting = tuned.get("setting") or {}
    kind = tuned.get("kind")
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


class _Source:
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


def _layer_has_bias(src: _Source, prefix: str) -> tuple[bool, bool]:
    """(q/k/v have biases, o_proj has a bias) in our layer ``prefix``."""
    qkv = src.has(f"{prefix}.self_attn.q_proj.bias") or src.has(f"{prefix}.self_attn.qkv_proj.bias")
    return qkv, src.has(f"{prefix}.self_attn.o_proj.bias")


def _layer_to_engine(src: _Source, ours: str, theirs: str, dims: Dims, *, input_norm: bool,
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


def _layer_from_engine(eng: Mapping[str, torch.Tensor], theirs: str, ours: str, want: set[str],
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
                _require_zero(take(name), name)
    out[f"{ours}.self_attn.o_proj.weight"] = take(f"{theirs}.self_attn.o_proj.weight")
    o_bias = f"{theirs}.self_attn.o_proj.bias"
    if f"{ours}.self_attn.o_proj.bias" in want:
        out[f"{ours}.self_attn.o_proj.bias"] = take(o_bias)
    elif o_bias in eng:
        _require_zero(take(o_bias), o_bias)
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


def _require_zero(tensor: torch.Tensor, name: str) -> None:
    if bool(tensor.any()):
        raise SpecgraftError(f"exported tensor {name} is not zero but this target's layers have no such bias; the "
                             "export was edited or made for another target")


# ----------------------------------------------------------------------------------------------------------------
# Checks shared by the EAGLE exports


def _draft_dims(info: TargetInfo, head_cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                draft_layers: int, attention_bias: bool, **extra: Any) -> Dims:
    config = info.config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return Dims(hidden=int(config.hidden_size), vocab=int(config.vocab_size), draft_layers=draft_layers,
                q_size=heads * head_dim, kv_size=kv_heads * head_dim, intermediate=int(config.intermediate_size),
                attention_bias=attention_bias, fc_bias="fc.bias" in state, **extra)


def _check_llama_compatible(info: TargetInfo, fmt: str, head_type: str) -> None:
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


def _refuse_leftovers(src: _Source, fmt: str, head_type: str, model_type: str) -> None:
    left = src.leftovers()
    if left:
        raise SpecgraftError(f"the {fmt} layout cannot hold tensors {left[:6]} of this {head_type} head (its "
                             f"{model_type} layers are not Llama layers); export it as native instead")


def _refuse_bias(fmt: str, head_type: str, what: str, allowed: tuple[str, ...]) -> None:
    raise SpecgraftError(f"the {fmt} {head_type} layout has no {what}, which this head has; export it as one of "
                         f"{', '.join(allowed)}")


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return tensors
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


# ----------------------------------------------------------------------------------------------------------------
# Head -> engine


def to_engine(head_type: str, fmt: str, state: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
              info: TargetInfo, *, base_model: str, dtype: torch.dtype | None = None,
              speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> EngineCheckpoint:
    """Convert a validated head state dict to ``fmt``'s layout and config, checked against the layout table."""
    head_cfg = meta["config"]
    converter = {"medusa": _medusa_to_engine, "eagle": _eagle_to_engine, "eagle3": _eagle3_to_engine}[head_type]
    ckpt = converter(fmt, state, head_cfg, info, base_model, speculative_tokens)
    ckpt.tensors = _cast(ckpt.tensors, dtype)
    dtype_name = str(dtype or _state_dtype(state)).replace("torch.", "")
    _set_dtype(ckpt.config, dtype_name)
    check_tensors(ckpt.tensors, expected_tensors(head_type, fmt, ckpt.dims), f"the {fmt} export")
    return ckpt


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


def _medusa_to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
                      base_model: str, speculative_tokens: int) -> EngineCheckpoint:
    src = _Source(state)
    heads, layers = int(cfg["num_heads"]), int(cfg["num_layers"])
    shared = bool(cfg["share_lm_head"])
    if any(name.startswith("lm_heads.") and name.endswith(".bias") for name in state):
        _refuse_bias(fmt, "medusa", "lm_head bias (the target's lm_head has one)", ("native",))
    dims = Dims(hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]), num_heads=heads, medusa_layers=layers,
                shared_lm_head=shared)
    notes: list[str] = []
    target_head = info.lm_head_weight() if shared else None
    if target_head is not None and tuple(target_head.shape) != (dims.vocab, dims.hidden):
        raise SpecgraftError(f"the target's lm_head is {tuple(target_head.shape)}, not [{dims.vocab}, {dims.hidden}]; "
                             "pass the target this head was trained for with --target")
    tensors: dict[str, torch.Tensor] = {}
    for k in range(heads):
        for layer in range(layers):
            w = src.take(f"blocks.{k}.layers.{layer}.weight")
            b = src.take(f"blocks.{k}.layers.{layer}.bias")
            if fmt == "vllm":
                tensors[f"blocks.{k}.layers.{layer}.weight"], tensors[f"blocks.{k}.layers.{layer}.bias"] = w, b
            else:
                tensors[f"{k}.{layer}.linear.weight"], tensors[f"{k}.{layer}.linear.bias"] = w, b
        head_w = target_head if shared else src.take(f"lm_heads.{k}.weight")
        if fmt == "vllm":
            if not shared:
                tensors[f"lm_heads.{k}.weight"] = head_w
            elif k == 0:
                tensors["lm_heads.0.weight"] = head_w  # vLLM's original_lm_head: one lm_head shared by all heads
        else:
            # One copy per head: safetensors refuses tensors that share memory.
            tensors[f"{k}.{layers}.weight"] = head_w.clone() if shared else head_w
    if shared:
        what = "once (original_lm_head)" if fmt == "vllm" else f"{heads} times (the layout has one per head)"
        notes.append(f"the heads share the target's lm_head; it is written {what}")
    if getattr(info.config, "final_logit_softcapping", None):
        notes.append("the target soft-caps its logits; engines' Medusa heads do not (greedy proposals are the same)")
    _refuse_leftovers(src, fmt, "medusa", "?")
    if fmt == "vllm":
        # vLLM renames every config key containing "num" and "heads"/"layers": write no other such key.
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": dims.hidden,
                  "vocab_size": dims.vocab, "num_heads": heads, "num_hidden_layers": layers,
                  "truncated_vocab_size": dims.vocab, "medusa_fc_bias": True, "original_lm_head": shared}
    else:
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": base_model,
                  "hidden_size": dims.hidden, "vocab_size": dims.vocab}
    return EngineCheckpoint(tensors, config, dims, notes)


def apply_tuned(config: dict[str, Any], head_type: str, fmt: str, engines: Mapping[str, Any]) -> None:
    """Write a tuned setting into an engine config: TensorRT-LLM Medusa ``medusa_choices`` (the tree)."""
    if head_type == "medusa" and fmt == "trtllm" and engines.get("trtllm", {}).get("medusa_choices"):
        config["medusa_choices"] = engines["trtllm"]["medusa_choices"]


def _eagle_to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
                     base_model: str, speculative_tokens: int) -> EngineCheckpoint:
    _check_llama_compatible(info, fmt, "eagle")
    src = _Source(state)
    layers = int(cfg["num_layers"])
    qkv_bias, o_bias = _layer_has_bias(src, "layers.0")
    bias = qkv_bias or o_bias
    if bias and fmt not in _BIAS_FORMATS:
        _refuse_bias(fmt, "eagle", "attention biases", (*_BIAS_FORMATS, "native"))
    if "fc.bias" in state and fmt == "vllm":
        _refuse_bias(fmt, "eagle", "fc bias (vLLM drops it silently)", ("sglang", "native"))
    dims = _draft_dims(info, cfg, state, layers, bias)
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
        tensors.update(_layer_to_engine(src, f"layers.{j}", f"layers.{j}", dims, input_norm=j > 0,
                                        hidden_norm=False))
    _refuse_leftovers(src, fmt, "eagle", getattr(info.config, "model_type", "?"))
    config = llama_draft_config(info.config, layers, None, bias)
    # No "bias" key for SGLang: its fc always has a bias, and its Llama layer would read "bias" as attention_bias.
    config["architectures"] = ["LlamaForCausalLM"] if fmt == "vllm" else ["LlamaForCausalLMEagle"]
    return EngineCheckpoint(tensors, config, dims, notes)


def engine_layer_ids(feature_layers: list[int], fmt: str) -> list[int]:
    """EAGLE-3 fused layers as ``fmt`` numbers them.

    Ours are transformers ``output_hidden_states`` indices (i = the output of decoder layer i-1). vLLM and the
    speculators package use the same numbers (vLLM captures the residual stream entering layer i); SGLang and
    TensorRT-LLM number the decoder layer whose OUTPUT is captured, i.e. i-1 (SGLang adds 1 back when loading).
    """
    return [int(i) for i in feature_layers] if fmt in ("vllm", "native") else [int(i) - 1 for i in feature_layers]


def _check_feature_layers(feature_layers: list[int], num_layers: int, fmt: str) -> None:
    if len(feature_layers) != ENGINE_NUM_FEATURES:
        raise SpecgraftError(f"{fmt} sizes the EAGLE-3 fc for exactly {ENGINE_NUM_FEATURES} fused target layers but "
                             f"this head fuses {len(feature_layers)} ({feature_layers}); export it as native or "
                             "train with 3 head.feature_layers")
    bad = [i for i in feature_layers if not 1 <= int(i) <= num_layers - 1]
    if bad:
        raise SpecgraftError(f"EAGLE-3 feature layers {bad} cannot be captured by {fmt}: engines capture the "
                             f"residual stream between decoder layers, i.e. output_hidden_states indices 1.."
                             f"{num_layers - 1} (not the embeddings 0 nor the final normed state {num_layers}); "
                             "export it as native or retrain with head.feature_layers inside that range")


def _eagle3_to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
                      base_model: str, speculative_tokens: int) -> EngineCheckpoint:
    _check_llama_compatible(info, fmt, "eagle3")
    layers = int(cfg["num_layers"])
    feature_layers = [int(i) for i in cfg["feature_layers"]]
    _check_feature_layers(feature_layers, info.num_layers, fmt)
    if layers != 1 and fmt != "vllm":
        raise SpecgraftError(f"the {fmt} EAGLE-3 layout holds exactly one draft layer (the midlayer) but this head has "
                             f"{layers}; export it as vllm or native")
    src = _Source(state)
    qkv_bias, o_bias = _layer_has_bias(src, "midlayer")
    bias = qkv_bias or o_bias
    if bias and fmt not in _BIAS_FORMATS:
        _refuse_bias(fmt, "eagle3", "attention biases", (*_BIAS_FORMATS, "native"))
    if "fc.bias" in state and fmt in ("vllm", "sglang"):
        # vLLM's fc has no bias; SGLang reads the fc bias switch from config "bias", which its Llama layer also
        # reads as attention_bias, leaving an o_proj bias the checkpoint cannot fill.
        _refuse_bias(fmt, "eagle3", "fc bias", ("trtllm", "native"))
    vd, vocab = int(cfg["draft_vocab_size"]), int(info.config.vocab_size)
    dims = _draft_dims(info, cfg, state, layers, bias, draft_vocab=vd, num_features=len(feature_layers),
                       draft_vocab_smaller=vd < vocab)
    tensors = {"fc.weight": src.take("fc.weight")}
    if src.has("fc.bias"):
        tensors["fc.bias"] = src.take("fc.bias")
    mid = "layers.0" if fmt == "vllm" else "midlayer"
    tensors.update(_layer_to_engine(src, "midlayer", mid, dims, input_norm=True, hidden_norm=True))
    for j in range(layers - 1):
        tensors.update(_layer_to_engine(src, f"layers.{j}", f"layers.{j + 1}", dims, input_norm=True,
                                        hidden_norm=False))
    tensors["norm.weight"] = src.take("norm.weight")
    tensors["lm_head.weight"] = src.take("lm_head.weight")
    d2t, t2d = src.take("d2t"), src.take("t2d")
    if fmt != "trtllm" or vd < vocab:
        tensors["d2t"] = d2t
    if fmt != "trtllm":
        tensors["t2d"] = t2d
    _refuse_leftovers(src, fmt, "eagle3", getattr(info.config, "model_type", "?"))
    layer_cfg = llama_draft_config(info.config, layers, None, bias)
    ids = engine_layer_ids(feature_layers, fmt)
    notes = [f"fused target layers {feature_layers} (output_hidden_states) are written as {fmt} layer ids {ids}",
             "the target's embedding table is not written (engines share the target's); a client that loads the "
             "draft alone must copy it in (see FORMATS.md)"]
    if fmt == "vllm":
        verifier_arch = list(getattr(info.config, "architectures", None) or [info.skeleton.identity.architecture])
        layer_cfg["architectures"] = ["LlamaForCausalLM"]
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_cfg,
            "draft_vocab_size": vd,
            # Our midlayer keeps the un-normed hidden state as the residual (vLLM defaults this to True when absent).
            "norm_before_residual": False,
            "target_hidden_size": dims.hidden,
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": base_model, "architectures": verifier_arch},
            },
        }
    else:
        config = dict(layer_cfg)
        config.update({
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": vd,
            "target_hidden_size": dims.hidden,
            "bias": "fc.bias" in tensors,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        })
        if fmt == "trtllm":
            notes.append(f"TensorRT-LLM reads the fused layers from its LLM API options, not from this config: set "
                         f"speculative_config.eagle3_layers_to_capture to {ids}")
    return EngineCheckpoint(tensors, config, dims, notes)


# ----------------------------------------------------------------------------------------------------------------
# Engine -> head


def from_engine(head_type: str, fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                head_cfg: Mapping[str, Any], want: Mapping[str, torch.Tensor],
                target_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Map an exported folder's tensors back onto a head state dict with exactly the names/shapes of ``want``
    (the state dict of a freshly built head of the same config). Unused exported tensors are an error."""
    used: set[str] = set()
    names = set(want)
    if head_type == "medusa":
        state = _medusa_from_engine(fmt, tensors, head_cfg, used, target_lm_head)
    elif head_type == "eagle":
        state = {"fc.weight": tensors["fc.weight"]}
        used.add("fc.weight")
        if "fc.bias" in names:
            state["fc.bias"] = tensors["fc.bias"]
            used.add("fc.bias")
        elif "fc.bias" in tensors:
            used.add("fc.bias")
            _require_zero(tensors["fc.bias"], "fc.bias")
        for j in range(int(head_cfg["num_layers"])):
            state.update(_layer_from_engine(tensors, f"layers.{j}", f"layers.{j}", names, used))
    else:
        state = _eagle3_from_engine(fmt, tensors, head_cfg, want, used)
    left = sorted(set(tensors) - used)
    if left:
        raise SpecgraftError(f"the export holds tensors {left[:6]} that a {head_type} head of this config does not "
                             "have; the export was edited or made for another head")
    missing = sorted(names - set(state))
    if missing:
        raise SpecgraftError(f"the export lacks the head tensors {missing[:6]}; re-export the head")
    return state


def _medusa_from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], used: set[str],
                        target_lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    heads, layers, shared = int(cfg["num_heads"]), int(cfg["num_layers"]), bool(cfg["share_lm_head"])
    state: dict[str, torch.Tensor] = {}
    for k in range(heads):
        for layer in range(layers):
            for kind in ("weight", "bias"):
                name = (f"blocks.{k}.layers.{layer}.{kind}" if fmt == "vllm" else f"{k}.{layer}.linear.{kind}")
                used.add(name)
                state[f"blocks.{k}.layers.{layer}.{kind}"] = tensors[name]
        head_name = f"lm_heads.{k}.weight" if fmt == "vllm" else f"{k}.{layers}.weight"
        if shared and fmt == "vllm" and k > 0:
            continue
        used.add(head_name)
        if shared:
            if target_lm_head is not None and not torch.equal(tensors[head_name].float(), target_lm_head.float()):
                logger.warning("the exported lm_head copy %s differs from the target's lm_head; the head borrows the "
                               "target's, so the copy is ignored", head_name)
        else:
            state[f"lm_heads.{k}.weight"] = tensors[head_name]
    return state


def _eagle3_from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], cfg: Mapping[str, Any],
                        want: Mapping[str, torch.Tensor], used: set[str]) -> dict[str, torch.Tensor]:
    names = set(want)
    state: dict[str, torch.Tensor] = {}
    for name in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight"):
        if name in names:
            state[name] = tensors[name]
            used.add(name)
    mid = "layers.0" if fmt == "vllm" else "midlayer"
    state.update(_layer_from_engine(tensors, mid, "midlayer", names, used))
    for j in range(int(cfg["num_layers"]) - 1):
        state.update(_layer_from_engine(tensors, f"layers.{j + 1}", f"layers.{j}", names, used))
    vd, vocab = int(cfg["draft_vocab_size"]), int(want["t2d"].numel())
    d2t = tensors.get("d2t")
    if d2t is None:
        d2t = torch.zeros(vd, dtype=torch.int64)  # TensorRT-LLM omits d2t when the draft vocab is the full vocab
    used.add("d2t")
    state["d2t"] = d2t.to(torch.int64)
    if "t2d" in tensors:
        used.add("t2d")
        state["t2d"] = tensors["t2d"].to(torch.bool)
    else:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(vd) + state["d2t"]] = True
        state["t2d"] = t2d
    return state
