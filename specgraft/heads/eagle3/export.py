"""EAGLE-3's engine layouts (speculators / vLLM ``Eagle3LlamaForCausalLM``, SGLang ``LlamaForCausalLMEagle3``,
TensorRT-LLM's PyTorch backend, llama.cpp's ``eagle3`` GGUF architecture) and card text.

Sources (checked facts, see ``specgraft/export/FORMATS.md``): the speculators layout (vLLM and the speculators
package) is ``fc``, ``layers.0.*`` (2h-wide q/k/v, ``hidden_norm``), ``layers.{j}.*`` plain Llama layers,
``norm``, ``lm_head``, ``d2t``, ``t2d``; SGLang and TensorRT-LLM have the same with ``midlayer.`` instead of
``layers.0.``, one layer only; TensorRT-LLM has ``d2t`` only when the draft vocabulary is smaller than the
target's and no ``t2d``. llama.cpp (``src/models/eagle3.cpp`` of the pinned tree, see
:mod:`specgraft.export.llamacpp`): ``fc``, ``blk.0.{attn_norm,attn_norm_2,attn_q,attn_k,attn_v,attn_output,ffn_norm,
ffn_gate,ffn_up,ffn_down}``, ``output_norm``, ``output``, ``d2t`` (int64 absolute target ids); one layer, no biases,
q/k rows permuted for its interleaved RoPE, embeddings taken from the target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.export.engine import (
    BIAS_FORMATS,
    EngineCheckpoint,
    SourceState,
    check_llama_compatible,
    draft_dims,
    engine_layer_ids,
    layer_from_engine,
    layer_has_bias,
    layer_to_engine,
    refuse_bias,
    refuse_leftovers,
)
from specgraft.export.layouts import TensorRule, llama_layer
from specgraft.export.llamacpp import draft_vocab_state, permute_qk, unpermute_qk
from specgraft.export.target_info import TargetInfo, llama_draft_config, rope_fields
from specgraft.heads.family import CardText, EngineExporter

#: EAGLE-3 default number of fused target layers (the engines' fc is sized for exactly this many).
ENGINE_NUM_FEATURES = 3

TAIL = (
    TensorRule("norm.weight", ("hidden",)),
    TensorRule("lm_head.weight", ("draft_vocab", "hidden")),
)
VLLM_LAYOUT = (
    TensorRule("fc.weight", ("hidden", "num_features*hidden")),
    *llama_layer("layers.0", (), qkv_in="2*hidden", hidden_norm=True),
    *llama_layer("layers.{j1}", ("j1",)),
    *TAIL,
    TensorRule("d2t", ("draft_vocab",), dtype="int64"),
    TensorRule("t2d", ("vocab",), dtype="bool"),
)
SGLANG_LAYOUT = (
    TensorRule("fc.weight", ("hidden", "num_features*hidden")),
    *llama_layer("midlayer", (), qkv_in="2*hidden", hidden_norm=True),
    *TAIL,
    TensorRule("d2t", ("draft_vocab",), dtype="int64"),
    TensorRule("t2d", ("vocab",), dtype="bool"),
)
TRTLLM_LAYOUT = (
    TensorRule("fc.weight", ("hidden", "num_features*hidden")),
    TensorRule("fc.bias", ("hidden",), when="fc_bias"),
    *llama_layer("midlayer", (), qkv_in="2*hidden", hidden_norm=True),
    *TAIL,
    TensorRule("d2t", ("draft_vocab",), when="draft_vocab_smaller", dtype="int64"),
)
#: llama.cpp's names for our midlayer's tensors (``blk.0.`` + name + ``.weight``).
LLAMACPP_LAYER = {
    "input_layernorm": "attn_norm", "hidden_norm": "attn_norm_2", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMACPP_LAYOUT = (
    TensorRule("fc.weight", ("hidden", "num_features*hidden")),
    TensorRule("blk.0.attn_norm.weight", ("hidden",)),
    TensorRule("blk.0.attn_norm_2.weight", ("hidden",)),
    TensorRule("blk.0.attn_q.weight", ("q_size", "2*hidden")),
    TensorRule("blk.0.attn_k.weight", ("kv_size", "2*hidden")),
    TensorRule("blk.0.attn_v.weight", ("kv_size", "2*hidden")),
    TensorRule("blk.0.attn_output.weight", ("hidden", "q_size")),
    TensorRule("blk.0.ffn_norm.weight", ("hidden",)),
    TensorRule("blk.0.ffn_gate.weight", ("intermediate", "hidden")),
    TensorRule("blk.0.ffn_up.weight", ("intermediate", "hidden")),
    TensorRule("blk.0.ffn_down.weight", ("hidden", "intermediate")),
    TensorRule("output_norm.weight", ("hidden",)),
    TensorRule("output.weight", ("draft_vocab", "hidden")),
    TensorRule("d2t", ("draft_vocab",), dtype="int64"),
)
LLAMACPP_ARCH = "eagle3"


def to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
              base_model: str, speculative_tokens: int) -> EngineCheckpoint:
    check_llama_compatible(info, fmt, "eagle3")
    layers = int(cfg["num_layers"])
    feature_layers = [int(i) for i in cfg["feature_layers"]]
    check_feature_layers(feature_layers, info.num_layers, fmt)
    if fmt == "llamacpp":
        return to_llamacpp(state, cfg, info, feature_layers)
    if layers != 1 and fmt != "vllm":
        raise SpecgraftError(f"the {fmt} EAGLE-3 layout holds exactly one draft layer (the midlayer) but this head has "
                             f"{layers}; export it as vllm or native")
    src = SourceState(state)
    qkv_bias, o_bias = layer_has_bias(src, "midlayer")
    bias = qkv_bias or o_bias
    if bias and fmt not in BIAS_FORMATS:
        refuse_bias(fmt, "eagle3", "attention biases", (*BIAS_FORMATS, "native"))
    if "fc.bias" in state and fmt in ("vllm", "sglang"):
        # vLLM's fc has no bias; SGLang reads the fc bias switch from config "bias", which its Llama layer also
        # reads as attention_bias, leaving an o_proj bias the checkpoint cannot fill.
        refuse_bias(fmt, "eagle3", "fc bias", ("trtllm", "native"))
    vd, vocab = int(cfg["draft_vocab_size"]), int(info.config.vocab_size)
    dims = draft_dims(info, cfg, state, layers, bias, draft_vocab=vd, num_features=len(feature_layers),
                       draft_vocab_smaller=vd < vocab)
    tensors = {"fc.weight": src.take("fc.weight")}
    if src.has("fc.bias"):
        tensors["fc.bias"] = src.take("fc.bias")
    mid = "layers.0" if fmt == "vllm" else "midlayer"
    tensors.update(layer_to_engine(src, "midlayer", mid, dims, input_norm=True, hidden_norm=True))
    for j in range(layers - 1):
        tensors.update(layer_to_engine(src, f"layers.{j}", f"layers.{j + 1}", dims, input_norm=True,
                                        hidden_norm=False))
    tensors["norm.weight"] = src.take("norm.weight")
    tensors["lm_head.weight"] = src.take("lm_head.weight")
    d2t, t2d = src.take("d2t"), src.take("t2d")
    if fmt != "trtllm" or vd < vocab:
        tensors["d2t"] = d2t
    if fmt != "trtllm":
        tensors["t2d"] = t2d
    refuse_leftovers(src, fmt, "eagle3", getattr(info.config, "model_type", "?"))
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


def from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], cfg: Mapping[str, Any],
                want: Mapping[str, torch.Tensor], used: set[str],
                target_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    if fmt == "llamacpp":
        return from_llamacpp(tensors, config, cfg, want, used)
    names = set(want)
    state: dict[str, torch.Tensor] = {}
    for name in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight"):
        if name in names:
            state[name] = tensors[name]
            used.add(name)
    mid = "layers.0" if fmt == "vllm" else "midlayer"
    state.update(layer_from_engine(tensors, mid, "midlayer", names, used))
    for j in range(int(cfg["num_layers"]) - 1):
        state.update(layer_from_engine(tensors, f"layers.{j + 1}", f"layers.{j}", names, used))
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


def to_llamacpp(state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
                feature_layers: list[int]) -> EngineCheckpoint:
    """Our EAGLE-3 head as llama.cpp's ``eagle3`` GGUF: tensors in its names, metadata without the tokenizer
    (copied from the target GGUF when the file is written)."""
    layers = int(cfg["num_layers"])
    if layers != 1:
        raise SpecgraftError(f"llama.cpp's EAGLE-3 draft holds exactly one draft layer but this head has {layers}; "
                             "export it as vllm or native")
    src = SourceState(state)
    qkv_bias, o_bias = layer_has_bias(src, "midlayer")
    if qkv_bias or o_bias:
        refuse_bias("llamacpp", "eagle3", "attention biases", (*BIAS_FORMATS, "native"))
    if src.has("fc.bias"):
        refuse_bias("llamacpp", "eagle3", "fc bias", ("trtllm", "native"))
    rope = rope_fields(info.config)
    if rope["rope_scaling"] is not None:
        raise SpecgraftError(f"this target uses {rope['rope_scaling']['rope_type']} RoPE scaling, which the llamacpp "
                             "EAGLE-3 export does not write; export it as vllm, sglang or native")
    config = info.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    vd, vocab = int(cfg["draft_vocab_size"]), int(config.vocab_size)
    dims = draft_dims(info, cfg, state, 1, False, draft_vocab=vd, num_features=len(feature_layers),
                       draft_vocab_smaller=vd < vocab)
    engine = layer_to_engine(src, "midlayer", "midlayer", dims, input_norm=True, hidden_norm=True)
    tensors = {"fc.weight": src.take("fc.weight")}
    for ours, theirs in LLAMACPP_LAYER.items():
        weight = engine[f"midlayer.{ours}.weight"]
        if theirs == "attn_q":
            weight = permute_qk(weight, heads)
        elif theirs == "attn_k":
            weight = permute_qk(weight, kv_heads)
        tensors[f"blk.0.{theirs}.weight"] = weight
    tensors["output_norm.weight"] = src.take("norm.weight")
    tensors["output.weight"] = src.take("lm_head.weight")
    # Ours is an offset (target id = draft id + d2t); llama.cpp scatters draft logits to d2t's absolute ids.
    tensors["d2t"] = src.take("d2t").to(torch.int64) + torch.arange(vd, dtype=torch.int64)
    src.take("t2d")  # llama.cpp derives nothing from t2d (its converter drops it too)
    refuse_leftovers(src, "llamacpp", "eagle3", getattr(config, "model_type", "?"))
    head_dim = dims.q_size // heads
    prefix = LLAMACPP_ARCH
    metadata = {
        f"{prefix}.context_length": int(config.max_position_embeddings),
        f"{prefix}.embedding_length": dims.hidden,
        f"{prefix}.block_count": 1,
        f"{prefix}.feed_forward_length": dims.intermediate,
        f"{prefix}.attention.head_count": heads,
        f"{prefix}.attention.head_count_kv": kv_heads,
        f"{prefix}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{prefix}.rope.freq_base": float(rope["rope_theta"]),
        f"{prefix}.rope.dimension_count": head_dim,
        f"{prefix}.vocab_size": vocab,
        # llama.cpp captures the INPUT of target layer i (common/speculative.cpp), our output_hidden_states[i].
        f"{prefix}.target_layers": list(feature_layers),
        f"{prefix}.target_hidden_size": dims.hidden,
        # Our midlayer keeps the un-normed fused feature as the residual (llama.cpp's default, written explicitly).
        f"{prefix}.norm_before_residual": False,
    }
    notes = [f"fused target layers {feature_layers} (output_hidden_states) are written as llama.cpp target_layers "
             f"{feature_layers} (llama.cpp captures the input of target layer i)",
             "the target's embedding table is not written: llama.cpp takes the target's token embeddings"]
    return EngineCheckpoint(tensors, metadata, dims, notes)


def from_llamacpp(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], cfg: Mapping[str, Any],
                  want: Mapping[str, torch.Tensor], used: set[str]) -> dict[str, torch.Tensor]:
    """llama.cpp's ``eagle3`` tensors back onto our head's state dict (the round trip)."""
    prefix = LLAMACPP_ARCH
    if config.get("general.architecture") != prefix:
        raise SpecgraftError(f"this GGUF is a {config.get('general.architecture')!r} model, not an EAGLE-3 draft "
                             f"({prefix!r}); load it as the head it is")
    ids = [int(i) for i in config.get(f"{prefix}.target_layers", [])]
    if ids != [int(i) for i in cfg["feature_layers"]]:
        raise SpecgraftError(f"the GGUF's target_layers {ids} differ from the head's feature layers "
                             f"{cfg['feature_layers']}; the export was edited, re-export the head")
    heads = int(config[f"{prefix}.attention.head_count"])
    kv_heads = int(config[f"{prefix}.attention.head_count_kv"])

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return tensors[name]

    state = {"fc.weight": take("fc.weight"), "norm.weight": take("output_norm.weight"),
             "lm_head.weight": take("output.weight")}
    for ours, theirs in LLAMACPP_LAYER.items():
        weight = take(f"blk.0.{theirs}.weight")
        if theirs == "attn_q":
            weight = unpermute_qk(weight, heads)
        elif theirs == "attn_k":
            weight = unpermute_qk(weight, kv_heads)
        state[f"midlayer.{ours}.weight"] = weight
    state.update(draft_vocab_state(take("d2t"), int(want["t2d"].numel())))
    return state


def check_feature_layers(feature_layers: list[int], num_layers: int, fmt: str) -> None:
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



def describe(cfg: Mapping[str, Any], size: str) -> str:
    return (f"An EAGLE-3 draft{size}: fuses target layers {cfg.get('feature_layers')} (transformers "
            f"output_hidden_states indices), runs {cfg.get('num_layers')} draft layer(s) and predicts over a "
            f"{cfg.get('draft_vocab_size')}-token draft vocabulary (trained with {cfg.get('ttt_steps')}-step "
            "training-time test).")


def trtllm_lines(cfg: Mapping[str, Any], base: str, where: str, tuned: Mapping[str, Any],
                 max_draft_len: int) -> list[str]:
    ids = [int(i) - 1 for i in cfg.get("feature_layers") or []]
    return ["PyTorch backend (`trtllm-serve ... --extra_llm_api_options spec.yaml`), `spec.yaml`:", "",
            "```yaml", "speculative_config:", "  decoding_type: Eagle3",
            f"  max_draft_len: {max_draft_len}",
            f"  speculative_model_dir: {where}", f"  eagle3_layers_to_capture: {ids}", "```", "",
            "TensorRT-LLM numbers the captured layers by the decoder layer whose output it takes "
            "(output_hidden_states index minus one).", ""]


EXPORTERS = {
    "vllm": EngineExporter("model.safetensors", VLLM_LAYOUT, to_engine, from_engine,
                           speculators_model_type="eagle3"),
    "sglang": EngineExporter("model.safetensors", SGLANG_LAYOUT, to_engine, from_engine),
    "trtllm": EngineExporter("model.safetensors", TRTLLM_LAYOUT, to_engine, from_engine),
    "llamacpp": EngineExporter("draft.gguf", LLAMACPP_LAYOUT, to_engine, from_engine, checked_config_keys=(),
                               container="gguf"),
}
CARD = CardText(title="EAGLE-3", describe=describe, vllm_method="eagle3", vllm_path_marker=("eagle3", "-eagle3"),
                sglang_algorithm="EAGLE3",
                config_is_self_contained=True, trtllm_lines=trtllm_lines, llamacpp_spec_type="draft-eagle3")
