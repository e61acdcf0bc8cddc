"""llama.cpp's container: GGUF files written and read with the ``gguf`` package (the writer llama.cpp ships).

A llama.cpp draft is ONE ``.gguf`` file: the draft architecture's metadata (``eagle3.*``), its tensors in llama.cpp's
names, and the TARGET's tokenizer (every ``tokenizer.*`` key copied from the target GGUF the user serves with), so
that llama.cpp sees one vocabulary on both sides. Facts checked in the pinned tree (llama-cpp-python 0.3.36's
vendored ggml-org/llama.cpp@0c1e57098): ``src/models/eagle3.cpp`` (tensors, ``target_layers``,
``target_hidden_size``, ``norm_before_residual``), ``common/speculative.cpp`` (a target layer id ``i`` is the INPUT
of target layer ``i``, i.e. transformers' ``output_hidden_states[i]``), ``conversion/llama.py`` (q/k rows permuted
for llama.cpp's interleaved RoPE, ``d2t`` stored as absolute target ids in int64).

:func:`write_target_gguf` writes a transformers Llama target as a llama.cpp ``llama`` GGUF (used by the engine
tests to serve stories260K; a user's target GGUF normally comes from llama.cpp's own converter);
:func:`write_draft_model_gguf` writes a distilled draft model for ``-md`` with the target GGUF's tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specgraft.errors import SpecgraftError
from specgraft.export.target_info import rope_fields
from specgraft.gguf import _require_gguf_package, inspect_gguf
from specgraft.utils.io import atomic_path

#: The llama.cpp tree the exports are checked against (the one ``scripts/build_llamacpp.sh`` builds).
LLAMACPP_PIN = "llama-cpp-python 0.3.36 (ggml-org/llama.cpp@0c1e57098)"
#: The command that builds it.
BUILD_COMMAND = "bash scripts/build_llamacpp.sh"
#: File name of the draft inside a llamacpp export folder.
DRAFT_FILE = "draft.gguf"
#: Prefix of the metadata keys copied from the target GGUF.
TOKENIZER_PREFIX = "tokenizer."

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 5, 6


def permute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' rotate-half q/k rows -> llama.cpp's interleaved-pair RoPE rows (``heads`` q or kv heads)."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape).contiguous())


def unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_qk`."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape).contiguous())


# ----------------------------------------------------------------------------------------------------------------
# The target GGUF


@dataclass
class TargetGGUF:
    """What a draft needs from the target's GGUF: its sizes and its tokenizer metadata."""

    path: Path
    architecture: str
    block_count: int
    hidden_size: int
    head_count: int
    tokens: list[str]
    tokenizer_fields: list[tuple[str, Any, Any, Any]] = field(default_factory=list)
    """(key, value, GGUFValueType, array element type or None) of every ``tokenizer.*`` key."""


def draft_vocab_state(absolute: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our ``d2t`` (offsets) and ``t2d`` (a [vocab_size] mask) from llama.cpp's ``d2t``, which stores each draft
    column's absolute target id."""
    absolute = absolute.to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[absolute] = True
    return {"d2t": absolute - torch.arange(absolute.numel(), dtype=torch.int64), "t2d": t2d}

def read_target_gguf(path: str | os.PathLike) -> TargetGGUF:
    """The target GGUF's sizes and tokenizer (refused in one line when it is not a complete model GGUF)."""
    gguf = _require_gguf_package()
    path = Path(path).expanduser()
    arch = inspect_gguf(path)
    reader = gguf.GGUFReader(str(path))

    def number(key: str) -> int:
        item = reader.fields.get(f"{arch}.{key}")
        if item is None:
            raise SpecgraftError(f"{path} has no {arch}.{key} field, so llama.cpp cannot serve it as a target; "
                                 "convert the target with llama.cpp's convert_hf_to_gguf.py")
        return int(item.contents())

    fields = []
    for key, item in reader.fields.items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        vtype = item.types[0]
        sub = item.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        fields.append((key, item.contents(), vtype, sub))
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    if tokens_field is None:
        raise SpecgraftError(f"{path} holds no tokenizer (tokenizer.ggml.tokens), so a draft cannot share it; "
                             "pass the GGUF llama.cpp serves the target from")
    return TargetGGUF(path, arch, number("block_count"), number("embedding_length"),
                      number("attention.head_count"), [str(t) for t in tokens_field.contents()], fields)


def check_target_gguf(target: TargetGGUF, config: Any, tokenizer_tokens: Sequence[str] | None) -> list[str]:
    """Refuse a target GGUF that is not the head's target (sizes, vocabulary, tokenizer); returns notes.

    ``tokenizer_tokens``: the head's target tokenizer's token strings by id (None: not available here, then only
    the sizes and the vocabulary size are compared).
    """
    expected = {"layers": int(config.num_hidden_layers), "hidden size": int(config.hidden_size),
                "attention heads": int(config.num_attention_heads), "vocabulary": int(config.vocab_size)}
    found = {"layers": target.block_count, "hidden size": target.hidden_size, "attention heads": target.head_count,
             "vocabulary": len(target.tokens)}
    wrong = [f"{k} {found[k]} (the head's target has {v})" for k, v in expected.items() if found[k] != v]
    if wrong:
        raise SpecgraftError(f"--target-gguf {target.path} is not this head's target: it has {', '.join(wrong)}; "
                             "pass the GGUF of the model the head was trained on")
    return check_gguf_tokens(target, tokenizer_tokens)


def check_gguf_tokens(target: TargetGGUF, tokenizer_tokens: Sequence[str] | None) -> list[str]:
    """Refuse a target GGUF whose token strings differ from the tokenizer's (by id); returns notes."""
    if tokenizer_tokens is None:
        return [f"the target's tokenizer is not available here, so {target.path.name}'s tokenizer was checked by its "
                "size only"]
    # A model's vocabulary may be padded past its tokenizer (llama.cpp's converter fills it with [PAD{i}] tokens).
    differ = [i for i, (a, b) in enumerate(zip(target.tokens, tokenizer_tokens)) if a != b]
    if differ or len(tokenizer_tokens) > len(target.tokens):
        first = differ[0] if differ else len(target.tokens)
        raise SpecgraftError(f"--target-gguf {target.path} has another tokenizer than the head's target ({len(differ)} "
                             f"token(s) differ, first id {first}); pass the GGUF of the model the head was trained on")
    return [f"{target.path.name} matches the head's target (sizes and all {len(tokenizer_tokens)} tokenizer tokens)"]


# ----------------------------------------------------------------------------------------------------------------
# Writing and reading GGUF files


def _metadata_value(gguf: Any, key: str, value: Any) -> tuple[Any, Any, Any]:
    """(value, GGUFValueType, element type) of one metadata entry, by its Python type."""
    types = gguf.GGUFValueType
    if isinstance(value, bool):
        return value, types.BOOL, None
    if isinstance(value, int):
        return value, types.UINT32, None
    if isinstance(value, float):
        return value, types.FLOAT32, None
    if isinstance(value, str):
        return value, types.STRING, None
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value), types.ARRAY, types.INT32
    raise TypeError(f"GGUF metadata {key}: cannot store {type(value).__name__}")


def _gguf_array(gguf: Any, tensor: torch.Tensor, name: str) -> tuple[np.ndarray, Any]:
    """A tensor as the numpy array and GGML type to write (int64 stays I64, 1-D floats stay F32)."""
    quant = gguf.GGMLQuantizationType
    if tensor.dtype == torch.int64:
        return tensor.numpy(), quant.I64
    if not tensor.is_floating_point():
        raise TypeError(f"tensor {name}: dtype {tensor.dtype} has no GGUF type here")
    if tensor.dim() == 1 or tensor.dtype == torch.float32:
        return tensor.to(torch.float32).numpy(), quant.F32
    if tensor.dtype == torch.float16:
        return tensor.numpy(), quant.F16
    raise SpecgraftError(f"tensor {name} is {tensor.dtype}, which this exporter does not write to GGUF; export with "
                         "--dtype float32 or float16 (requantize with llama-quantize afterwards)")


def write_gguf(path: Path, arch: str, metadata: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
               tokenizer_fields: Sequence[tuple[str, Any, Any, Any]] = ()) -> None:
    """Write one GGUF file atomically (it appears complete or not at all)."""
    gguf = _require_gguf_package()
    with atomic_path(path, suffix=".gguf") as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        try:
            for key, value in metadata.items():
                writer.add_key_value(key, *_metadata_value(gguf, key, value))
            for key, value, vtype, sub in tokenizer_fields:
                writer.add_key_value(key, value, vtype, sub_type=sub)
            for name, tensor in tensors.items():
                array, kind = _gguf_array(gguf, tensor.detach().cpu().contiguous(), name)
                writer.add_tensor(name, array, raw_dtype=kind)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        if inspect_gguf(tmp) != arch:  # read the header back: a cut write fails here, before the rename
            raise SpecgraftError(f"{path} did not read back as written; check free disk space and retry")


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata without the tokenizer, tensors) of a GGUF written by :func:`write_gguf` (F32, F16, I64)."""
    gguf = _require_gguf_package()
    inspect_gguf(path)
    reader = gguf.GGUFReader(str(path))
    meta = {key: item.contents() for key, item in reader.fields.items()
            if not key.startswith((TOKENIZER_PREFIX, "GGUF."))}
    tensors = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                      gguf.GGMLQuantizationType.I64):
            raise SpecgraftError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}; only F32/F16/I64 "
                                 "drafts as specgraft writes them can be read back")
        shape = tuple(int(n) for n in reversed(tensor.shape))
        tensors[tensor.name] = torch.from_numpy(np.array(tensor.data).reshape(shape).copy())
    return meta, tensors


# ----------------------------------------------------------------------------------------------------------------
# A transformers Llama target as a llama.cpp GGUF


def llama_gguf_parts(model: Any, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a transformers ``LlamaForCausalLM`` as llama.cpp's ``llama`` architecture
    (float32, q/k rows permuted for its RoPE, no ``output`` when the embeddings are tied)."""
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise SpecgraftError(f"llama.cpp GGUFs are written here for Llama models only, not {config.model_type}; "
                             "convert others with llama.cpp's convert_hf_to_gguf.py")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise SpecgraftError("this Llama model has attention or MLP biases, which this GGUF writer does not hold; "
                             "convert it with llama.cpp's convert_hf_to_gguf.py")
    rope = rope_fields(config)
    if rope["rope_scaling"] is not None:
        raise SpecgraftError(f"this model uses {rope['rope_scaling']['rope_type']} RoPE scaling, which this GGUF "
                             "writer does not hold; convert it with llama.cpp's convert_hf_to_gguf.py")
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    metadata: dict[str, Any] = {
        "general.name": name,
        "llama.context_length": int(config.max_position_embeddings),
        "llama.embedding_length": int(config.hidden_size),
        "llama.block_count": int(config.num_hidden_layers),
        "llama.feed_forward_length": int(config.intermediate_size),
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "llama.rope.freq_base": float(rope["rope_theta"]),
        "llama.rope.dimension_count": head_dim,
        "llama.vocab_size": int(config.vocab_size),
    }
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    if not getattr(config, "tie_word_embeddings", False):
        tensors["output.weight"] = state["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(int(config.num_hidden_layers)):
        ours = f"model.layers.{i}"
        tensors[f"blk.{i}.attn_q.weight"] = permute_qk(state[f"{ours}.self_attn.q_proj.weight"], heads)
        tensors[f"blk.{i}.attn_k.weight"] = permute_qk(state[f"{ours}.self_attn.k_proj.weight"], kv_heads)
        for theirs, gguf_name in names.items():
            tensors[f"blk.{i}.{gguf_name}.weight"] = state[f"{ours}.{theirs}.weight"]
    return metadata, tensors


def write_target_gguf(model: Any, tokens: Sequence[str], out: str | os.PathLike, *,
                      scores: Sequence[float] | None = None, token_types: Sequence[int] | None = None,
                      bos_id: int | None = None, eos_id: int | None = None, unk_id: int | None = None,
                      tokenizer_model: str = "llama", name: str = "target") -> Path:
    """Write a transformers ``LlamaForCausalLM`` as llama.cpp's ``llama`` architecture (float32), with the given
    SentencePiece-style vocabulary (``tokenizer_model`` "llama": llama.cpp merges by ``scores``)."""
    metadata, tensors = llama_gguf_parts(model, name)
    gguf = _require_gguf_package()
    types = gguf.GGUFValueType
    n = int(model.config.vocab_size)
    if len(tokens) > n:
        raise SpecgraftError(f"the vocabulary has {len(tokens)} tokens but the model only {n} rows")
    # Rows past the tokenizer are padding, as llama.cpp's converter writes them.
    pad = n - len(tokens)
    tokens = [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), n))]
    scores = [*scores, *([0.0] * pad)] if scores is not None else None
    token_types = [*token_types, *([TOKEN_UNUSED] * pad)] if token_types is not None else None
    vocab = [
        ("tokenizer.ggml.model", tokenizer_model, types.STRING, None),
        ("tokenizer.ggml.tokens", list(tokens), types.ARRAY, types.STRING),
        ("tokenizer.ggml.scores", [float(s) for s in (scores if scores is not None else [0.0] * n)], types.ARRAY,
         types.FLOAT32),
        ("tokenizer.ggml.token_type", [int(t) for t in (token_types if token_types is not None else
                                                         [TOKEN_NORMAL] * n)], types.ARRAY, types.INT32),
    ]
    for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id), ("unknown_token_id", unk_id)):
        if value is not None:
            vocab.append((f"tokenizer.ggml.{key}", int(value), types.UINT32, None))
    out = Path(out)
    write_gguf(out, "llama", metadata, tensors, vocab)
    return out


def write_draft_model_gguf(model: Any, target: TargetGGUF, out: Path, name: str) -> None:
    """A distilled draft model (a small Llama) as llama.cpp's ``-md`` draft: its weights with the TARGET's
    tokenizer (llama.cpp refuses a draft whose vocabulary differs from the target's)."""
    rows = int(model.config.vocab_size)
    if rows != len(target.tokens):
        raise SpecgraftError(f"the draft model has {rows} vocabulary rows but {target.path} has {len(target.tokens)} "
                             "tokens; pass the GGUF of the target the draft was distilled for")
    metadata, tensors = llama_gguf_parts(model, name)
    write_gguf(out, "llama", metadata, tensors, target.tokenizer_fields)
