"""DFlash heads as llama.cpp's ``dflash`` GGUF architecture (``--spec-type draft-dflash``).

Facts checked in the pinned tree (llama-cpp-python 0.3.36's vendored ggml-org/llama.cpp@0c1e57098, see
:mod:`specgraft.export.llamacpp`), not copied:

* ``src/models/dflash.cpp``: tensors ``fc`` ({n_targets * h} -> h, no bias), ``enc.output_norm`` (our
  ``hidden_norm``, applied after ``fc``), ``output_norm`` (our ``norm``), per layer ``blk.{i}.attn_norm``,
  ``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``, ``attn_q_norm`` and ``attn_k_norm`` (both REQUIRED: the
  graph is Qwen3's, per-head RMS norms before RoPE), ``ffn_norm``, ``ffn_gate``, ``ffn_up``, ``ffn_down``; no biases
  anywhere; ``output`` and ``d2t`` (absolute I64 target ids) only for a reduced draft vocabulary, else the target's
  output projection and token embeddings are borrowed. Context rows enter the cache as
  ``k_norm(wk(enc.output_norm(fc(features))))`` and ``wv(...)`` without ``attn_norm``, exactly our
  :meth:`~specgraft.heads.dflash.model.DFlashHead.block_forward`. The layer count is free.
* ``src/llama-model.cpp`` (``llama_model_rope_type``): a DFlash draft ropes NeoX-style (rotate-half, as
  transformers), so q/k rows are written unpermuted (unlike the ``llama``/``eagle3`` architectures).
* ``common/speculative.cpp`` (``common_speculative_impl_draft_dflash``): ``dflash.target_layers`` are the target
  layers whose INPUT is captured (``llama_set_embeddings_layer_inp``), i.e. our ``output_hidden_states`` indices;
  its converter (``conversion/qwen.py``) adds 1 to SGLang's/z-lab's ``target_layer_ids`` for the same reason. The
  mask token is the DRAFT vocabulary's ``tokenizer.ggml.mask_token_id``. ``dflash.block_size`` only caps
  ``--spec-draft-n-max`` at ``block_size - 1``: each step runs a block of ``n_max + 1`` slots (anchor plus
  ``n_max`` masks), so ``--spec-draft-n-max block_size - 1`` runs the block the head was trained on. The hidden
  activation is silu unless ``dflash.hidden_activation`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.export.engine import EngineCheckpoint, engine_layer_ids
from specgraft.export.layouts import Dims
from specgraft.export.llamacpp import draft_vocab_state
from specgraft.export.target_info import TargetInfo, rope_fields
from specgraft.heads.dflash.config import DFlashConfig
from specgraft.heads.dflash.export import _draft_layer_names, _info_scales_embeddings, _refuse_unservable
from specgraft.heads.dflash.model import DFlashHead
from specgraft.heads.family import EngineExporter

ARCH = "dflash"
DRAFT_FILE = "draft.gguf"
#: GGUF key of the mask token (read from the draft's vocabulary by llama.cpp's DFlash drafter).
MASK_KEY = "tokenizer.ggml.mask_token_id"
#: The MLP activation llama.cpp's DFlash graph runs when the GGUF names none.
ACTIVATION = "silu"

#: Our names -> llama.cpp's (``blk.{i}.`` + name + ``.weight``) of one draft layer.
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
#: Our names -> llama.cpp's of the tensors outside the layers.
TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
#: What can hold what llama.cpp cannot.
_WITH_BIASES = "vllm, sglang or native"


def _refuse(state: Mapping[str, torch.Tensor], skeleton: DFlashHead, info: TargetInfo) -> None:
    """Refuse, in one line naming the formats that can hold it, what llama.cpp's DFlash graph cannot run."""
    model_type = str(getattr(info.config, "model_type", "?"))
    _refuse_unservable(skeleton.config.aux_layer_ids, info.skeleton.num_layers, _info_scales_embeddings(info),
                       model_type, "llama.cpp")
    biases = sorted(name for name in state if name.endswith(".bias"))
    if biases:
        raise SpecgraftError(f"llama.cpp's DFlash draft has no biases, but this head has {biases[:3]}; export it as "
                             f"{_WITH_BIASES}")
    layer_cfg = {"num_hidden_layers": skeleton.config.num_layers}
    names = _draft_layer_names(layer_cfg)
    if skeleton.config.reduced_vocab:
        names |= {"lm_head.weight", "d2t", "t2d"}
    if set(state) != names:
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        no_qk_norm = any(name.endswith(("q_norm.weight", "k_norm.weight")) for name in missing)
        why = ("per-head q/k RMS norms (Qwen3's), which this head's draft layers lack" if no_qk_norm
               else f"Qwen3-layout layers (missing {missing[:3]}, unexpected {unexpected[:3]})")
        raise SpecgraftError(f"llama.cpp's DFlash draft runs {why}; retrain with head.draft_layers: qwen3 to serve "
                             "it with llama.cpp (or vLLM/SGLang), or export it as native")
    act = str(getattr(skeleton.draft_config, "hidden_act", ACTIVATION))
    if act != ACTIVATION:
        raise SpecgraftError(f"this head's draft layers use {act}, but specgraft writes llama.cpp DFlash drafts with "
                             f"{ACTIVATION} only; export it as vllm or native")
    rope = rope_fields(info.config)
    if rope["rope_scaling"] is not None:
        raise SpecgraftError(f"this target uses {rope['rope_scaling']['rope_type']} RoPE scaling, which the llamacpp "
                             f"DFlash export does not write; export it as {_WITH_BIASES}")


def to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
              base_model: str, speculative_tokens: int) -> EngineCheckpoint:
    """A DFlash head as llama.cpp's ``dflash`` GGUF: tensors in its names, metadata (the mask token included),
    the tokenizer copied from the target GGUF when the file is written."""
    skeleton = DFlashHead(DFlashConfig(**cfg), info.skeleton)  # meta device: sizes and names only
    _refuse(state, skeleton, info)
    config = info.config
    draft = skeleton.draft_config
    heads = int(draft.num_attention_heads)
    kv_heads = int(getattr(draft, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(draft, "head_dim", None) or int(draft.hidden_size) // heads)
    layers = int(cfg["num_layers"])
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    tensors = {theirs: state[ours] for ours, theirs in TOP_NAMES.items() if ours in state}
    for i in range(layers):
        for ours, theirs in LAYER_NAMES.items():
            tensors[f"blk.{i}.{theirs}.weight"] = state[f"layers.{i}.{ours}.weight"]
    if skeleton.config.reduced_vocab:
        d2t = state["d2t"].to(torch.int64)  # ours: an offset (target id = draft id + d2t); llama.cpp: the target id
        tensors["d2t"] = d2t + torch.arange(d2t.numel(), dtype=torch.int64)
    ids = engine_layer_ids(cfg["aux_layer_ids"], fmt)
    block = int(cfg["block_size"])
    metadata: dict[str, Any] = {
        f"{ARCH}.context_length": int(config.max_position_embeddings),
        f"{ARCH}.embedding_length": hidden,
        f"{ARCH}.block_count": layers,
        f"{ARCH}.feed_forward_length": int(draft.intermediate_size),
        f"{ARCH}.attention.head_count": heads,
        f"{ARCH}.attention.head_count_kv": kv_heads,
        f"{ARCH}.attention.key_length": head_dim,
        f"{ARCH}.attention.value_length": head_dim,
        f"{ARCH}.attention.layer_norm_rms_epsilon": float(draft.rms_norm_eps),
        f"{ARCH}.rope.freq_base": float(rope_fields(config)["rope_theta"]),
        f"{ARCH}.rope.dimension_count": head_dim,
        f"{ARCH}.vocab_size": vocab,
        f"{ARCH}.target_layers": ids,
        f"{ARCH}.block_size": block,
        MASK_KEY: int(cfg["mask_token_id"]),  # the draft's own value wins over the target tokenizer's
    }
    expected = {name: (tuple(shape), "int64" if name == "d2t" else "float") for name, shape in
                _expected_shapes(skeleton).items()}
    dims = Dims(hidden=hidden, vocab=vocab, draft_layers=layers, num_features=len(ids))
    notes = [f"fused target layers {list(cfg['aux_layer_ids'])} (output_hidden_states) are written as llama.cpp "
             f"dflash.target_layers {ids} (llama.cpp captures the input of target layer i)",
             f"mask token {cfg['mask_token_id']} is written as the draft's tokenizer.ggml.mask_token_id",
             f"llama.cpp runs a block of --spec-draft-n-max + 1 slots: --spec-draft-n-max {block - 1} runs the "
             f"trained block of {block}; a smaller value runs a shorter block, not the first slots of this one",
             "the target's embedding table (and, for a full-vocabulary draft, its output projection) is not "
             "written: llama.cpp borrows the target's"]
    return EngineCheckpoint(tensors, metadata, dims, notes, expected=expected)


def _expected_shapes(skeleton: DFlashHead) -> dict[str, torch.Size]:
    """llama.cpp's tensor names with the shapes of the head's own tensors (``t2d`` is not written)."""
    own = {name: tensor.shape for name, tensor in skeleton.state_dict().items()}
    out = {theirs: own[ours] for ours, theirs in TOP_NAMES.items() if ours in own}
    for i in range(skeleton.config.num_layers):
        out.update({f"blk.{i}.{theirs}.weight": own[f"layers.{i}.{ours}.weight"] for ours, theirs in
                    LAYER_NAMES.items()})
    if "d2t" in own:
        out["d2t"] = own["d2t"]
    return out


def from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], cfg: Mapping[str, Any],
                want: Mapping[str, torch.Tensor], used: set[str],
                target_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """llama.cpp's ``dflash`` tensors back onto our head's state dict (the round trip)."""
    if config.get("general.architecture") != ARCH:
        raise SpecgraftError(f"this GGUF is a {config.get('general.architecture')!r} model, not a DFlash draft "
                             f"({ARCH!r}); load it as the head it is")
    ids = [int(i) for i in config.get(f"{ARCH}.target_layers", [])]
    if ids != engine_layer_ids(cfg["aux_layer_ids"], fmt) or int(config.get(f"{ARCH}.block_size", -1)) \
            != int(cfg["block_size"]):
        raise SpecgraftError(f"the GGUF's target_layers {ids} / block_size {config.get(f'{ARCH}.block_size')} differ "
                             f"from the head's {cfg['aux_layer_ids']} / {cfg['block_size']}; the export was edited, "
                             "re-export the head")

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return tensors[name]

    state = {ours: take(theirs) for ours, theirs in TOP_NAMES.items() if ours in want}
    for i in range(int(cfg["num_layers"])):
        for ours, theirs in LAYER_NAMES.items():
            state[f"layers.{i}.{ours}.weight"] = take(f"blk.{i}.{theirs}.weight")
    if "d2t" in want:
        state.update(draft_vocab_state(take("d2t"), int(want["t2d"].numel())))
    return state


EXPORTER = EngineExporter(DRAFT_FILE, None, to_engine, from_engine, checked_config_keys=(), container="gguf")
