"""Convert a llama2.c checkpoint + tokenizer (e.g. stories260K.bin, tok512.bin) to a transformers folder.

The llama2.c *legacy* checkpoint format is a header of 7 little-endian int32 values
``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len`` followed by float32 arrays in a fixed
order (see :meth:`Llama2cHeader.tensor_shapes`). A positive ``vocab_size`` means the classifier is tied to the
token embedding; a negative one means an untied classifier follows the (unused) RoPE tables.

llama2.c rotates *interleaved* pairs ``(2j, 2j+1)`` of each attention head, transformers' Llama rotates
``(j, j + head_dim/2)`` (``rotate_half``); converting therefore permutes the rows of ``wq`` and ``wk``.

The tokenizer file (``tok*.bin``) holds ``uint32 max_token_length`` then, per token, ``float32 score, int32 length,
UTF-8 bytes`` with SentencePiece's ``▁`` stored as a plain space. llama2.c encodes with a greedy BPE: prepend
``" "`` to non-empty text, map each code point to its piece (or to ``<0xNN>`` byte pieces), then repeatedly merge
the adjacent pair whose concatenation is the highest-scoring piece. :func:`load_llama2c_tokenizer` builds an
equivalent ``tokenizers`` BPE whose merges are ranked by that score; :func:`llama2c_encode` is the literal rule,
kept as the reference the fast tokenizer is tested against.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specgraft.errors import SpecgraftError
from specgraft.utils.io import atomic_path
from specgraft.utils.outputs import writing_output

# --- llama2.c facts (run.c / export.py), not tunables -----------------------------------------------------------
#: Order of the int32 fields of the legacy header.
HEADER_FIELDS: tuple[str, ...] = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
HEADER_BYTES = 4 * len(HEADER_FIELDS)
FLOAT_BYTES = 4
#: First uint32 of llama2.c's *versioned* exports (``export.py --version 1/2``): b"ak42" little-endian.
VERSIONED_MAGIC = 0x616B3432
#: run.c hard-codes these.
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
#: ids 3..258 are the SentencePiece byte-fallback pieces ``<0x00>``..``<0xFF>``.
BYTE_FALLBACK_OFFSET = 3
N_BYTES = 256
#: transformers-side names of ids 0..2 (tok*.bin stores BOS/EOS as "\n<s>\n" / "\n</s>\n").
SPECIAL_PIECES: tuple[str, str, str] = ("<unk>", "<s>", "</s>")
#: SentencePiece's visible space; tok*.bin stores it as " ", the transformers tokenizer uses it again.
SPIECE_SPACE = "\u2581"
#: run.c's "no merge found yet" score.
_NO_SCORE = -1e10


@dataclasses.dataclass(frozen=True)
class Llama2cHeader:
    """The 7-int header of a legacy llama2.c checkpoint (``vocab_size`` made positive)."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The float32 arrays after the header, in file order (llama2.c ``memory_map_weights``)."""
        d, hid, n_l, v, kv = self.dim, self.hidden_dim, self.n_layers, self.vocab_size, self.kv_dim
        shapes: list[tuple[str, tuple[int, ...]]] = [
            ("token_embedding", (v, d)),
            ("rms_att", (n_l, d)),
            ("wq", (n_l, d, d)),
            ("wk", (n_l, kv, d)),
            ("wv", (n_l, kv, d)),
            ("wo", (n_l, d, d)),
            ("rms_ffn", (n_l, d)),
            ("w1", (n_l, hid, d)),
            ("w2", (n_l, d, hid)),
            ("w3", (n_l, hid, d)),
            ("rms_final", (d,)),
            # Precomputed RoPE cos/sin tables: unused by run.c (it recomputes them) and by transformers.
            ("freq_cis_real", (self.seq_len, self.head_size // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_size // 2)),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (v, d)))
        return shapes

    @property
    def file_bytes(self) -> int:
        """Exact size of a checkpoint with this header."""
        return HEADER_BYTES + FLOAT_BYTES * sum(int(np.prod(s)) for _, s in self.tensor_shapes())

    @property
    def n_params(self) -> int:
        """Model parameters (the RoPE tables are not parameters; a tied classifier counts once)."""
        return sum(int(np.prod(s)) for name, s in self.tensor_shapes() if not name.startswith("freq_cis"))


def _header_problem(values: dict[str, int]) -> str | None:
    """Why ``values`` cannot be a llama2.c header, or None."""
    nonneg = {k: v for k, v in values.items() if k != "vocab_size"}
    bad = [k for k, v in nonneg.items() if v <= 0]
    if bad or values["vocab_size"] == 0:
        return f"{', '.join(bad or ['vocab_size'])} must be {'positive' if bad else 'non-zero'}"
    if values["dim"] % values["n_heads"]:
        return f"dim {values['dim']} is not divisible by n_heads {values['n_heads']}"
    if (values["dim"] // values["n_heads"]) % 2:
        return f"head size {values['dim'] // values['n_heads']} is odd (RoPE rotates pairs)"
    if values["n_kv_heads"] > values["n_heads"] or values["n_heads"] % values["n_kv_heads"]:
        return f"n_heads {values['n_heads']} is not a multiple of n_kv_heads {values['n_kv_heads']}"
    return None


def read_llama2c_header(path: str | os.PathLike) -> Llama2cHeader:
    """Read and validate the header of a legacy llama2.c checkpoint, including the file size it implies.

    Raises:
        SpecgraftError: missing file, versioned (non-legacy) export, impossible header, truncated or oversized file.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecgraftError(f"llama2.c checkpoint {path} not found; pass the path of a .bin such as stories260K.bin")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise SpecgraftError(
            f"{path} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte llama2.c header; "
            "re-download or re-export the checkpoint"
        )
    if struct.unpack_from("<I", raw)[0] == VERSIONED_MAGIC:
        version = struct.unpack_from("<i", raw, 4)[0]
        raise SpecgraftError(
            f"{path} is a versioned llama2.c export (magic 'ak42', version {version}), not the legacy format; "
            "re-export it with llama2.c `export.py --version 0`"
        )
    values = dict(zip(HEADER_FIELDS, struct.unpack("<7i", raw)))
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    problem = _header_problem(values)
    if problem:
        raise SpecgraftError(
            f"{path} has an impossible llama2.c header ({shown}): {problem}; "
            "pass a llama2.c legacy-format checkpoint (export.py --version 0)"
        )
    header = Llama2cHeader(
        **{**values, "vocab_size": abs(values["vocab_size"])}, shared_classifier=values["vocab_size"] > 0
    )
    if size != header.file_bytes:
        kind = "truncated" if size < header.file_bytes else "corrupt (longer than its header implies)"
        hint = ""
        other = dataclasses.replace(header, shared_classifier=not header.shared_classifier)
        if size == other.file_bytes:
            # Matches the size with the classifier flag flipped: a wrong sign of vocab_size in the header.
            kind_of = "a tied" if other.shared_classifier else "an untied"
            hint = f" (the size fits {kind_of} classifier: wrong sign of vocab_size?)"
        raise SpecgraftError(
            f"{path} is {kind}: its header ({shown}) implies {header.file_bytes} bytes but the file has {size}{hint}; "
            "re-download or re-export the checkpoint"
        )
    return header


def llama2c_config(header: Llama2cHeader) -> LlamaConfig:
    """The transformers ``LlamaConfig`` that computes exactly what llama2.c's ``run.c`` computes for ``header``."""
    return LlamaConfig(
        vocab_size=header.vocab_size,
        hidden_size=header.dim,
        intermediate_size=header.hidden_dim,
        num_hidden_layers=header.n_layers,
        num_attention_heads=header.n_heads,
        num_key_value_heads=header.n_kv_heads,
        head_dim=header.head_size,
        max_position_embeddings=header.seq_len,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=header.shared_classifier,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def permute_for_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a llama2.c ``wq``/``wk`` so transformers' ``rotate_half`` RoPE matches.

    Within each head, llama2.c row ``2j + r`` (pair ``j``, component ``r``) becomes row ``r * head_size/2 + j``.
    ``w``: [n_heads * head_size, d_in] -> same shape.
    """
    d_out, d_in = w.shape
    return w.reshape(n_heads, d_out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(d_out, d_in)


def _read_tensors(path: Path, header: Llama2cHeader) -> dict[str, torch.Tensor]:
    """All float32 arrays of the checkpoint as torch tensors (copies, writable)."""
    flat = np.fromfile(path, dtype="<f4", offset=HEADER_BYTES)  # [n_floats], size already validated
    tensors: dict[str, torch.Tensor] = {}
    start = 0
    for name, shape in header.tensor_shapes():
        n = int(np.prod(shape))
        tensors[name] = torch.from_numpy(flat[start : start + n].astype(np.float32).reshape(shape))
        start += n
    return tensors


def load_llama2c_model(path: str | os.PathLike) -> LlamaForCausalLM:
    """Load a legacy llama2.c checkpoint as an equivalent fp32 ``LlamaForCausalLM`` in eval mode.

    Raises:
        SpecgraftError: the file is missing, truncated, oversized or has an impossible header.
    """
    path = Path(path)
    header = read_llama2c_header(path)
    t = _read_tensors(path, header)
    model = LlamaForCausalLM(llama2c_config(header)).to(torch.float32)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": t["token_embedding"],
        "model.norm.weight": t["rms_final"],
        "lm_head.weight": t["token_embedding"] if header.shared_classifier else t["wcls"],
    }
    for i in range(header.n_layers):
        prefix = f"model.layers.{i}."
        state[prefix + "input_layernorm.weight"] = t["rms_att"][i]
        state[prefix + "self_attn.q_proj.weight"] = permute_for_rotate_half(t["wq"][i], header.n_heads)
        state[prefix + "self_attn.k_proj.weight"] = permute_for_rotate_half(t["wk"][i], header.n_kv_heads)
        state[prefix + "self_attn.v_proj.weight"] = t["wv"][i]
        state[prefix + "self_attn.o_proj.weight"] = t["wo"][i]
        state[prefix + "post_attention_layernorm.weight"] = t["rms_ffn"][i]
        state[prefix + "mlp.gate_proj.weight"] = t["w1"][i]
        state[prefix + "mlp.up_proj.weight"] = t["w3"][i]
        state[prefix + "mlp.down_proj.weight"] = t["w2"][i]
    model.load_state_dict(state, strict=True)
    if header.shared_classifier:
        model.tie_weights()
    model.generation_config = llama2c_generation_config()
    model.eval()
    return model


def llama2c_generation_config() -> GenerationConfig:
    """Generation defaults matching run.c: greedy-capable, stops at EOS or at BOS (run.c's end-of-story marker)."""
    # llama2.c models are trained on BOS-separated stories and never see EOS; run.c stops when BOS is sampled.
    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, BOS_ID], pad_token_id=EOS_ID)


# --- tokenizer ------------------------------------------------------------------------------------------------


def read_llama2c_vocab(path: str | os.PathLike, vocab_size: int | None = None) -> tuple[list[str], list[float]]:
    """Read a llama2.c ``tok*.bin``: the pieces (spaces as ``" "``, as stored) and their scores.

    The file does not record its vocab size (run.c takes it from the checkpoint); every entry until the end of
    the file is read, and ``vocab_size`` (when given) must match.

    Raises:
        SpecgraftError: missing, truncated or corrupt file, wrong vocab size, or missing byte-fallback pieces.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecgraftError(f"llama2.c tokenizer {path} not found; pass the path of a tok*.bin such as tok512.bin")
    data = path.read_bytes()
    fix = "re-download or re-export the tokenizer (llama2.c tokenizer.py)"
    if len(data) < 4:
        raise SpecgraftError(f"{path} is truncated: {len(data)} bytes, no max_token_length field; {fix}")
    (max_len,) = struct.unpack_from("<I", data, 0)
    pieces: list[str] = []
    scores: list[float] = []
    off = 4
    while off < len(data):
        i = len(pieces)
        if off + 8 > len(data):
            raise SpecgraftError(f"{path} is truncated inside the record of token {i} (byte {off}); {fix}")
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if n <= 0 or n > max_len:
            raise SpecgraftError(f"{path} is corrupt: token {i} claims {n} bytes (max_token_length {max_len}); {fix}")
        if off + n > len(data):
            raise SpecgraftError(f"{path} is truncated inside the bytes of token {i} (byte {off}); {fix}")
        try:
            pieces.append(data[off : off + n].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise SpecgraftError(f"{path} is corrupt: token {i} is not valid UTF-8 ({exc.reason}); {fix}") from None
        scores.append(score)
        off += n
    if vocab_size is not None and len(pieces) != vocab_size:
        raise SpecgraftError(
            f"{path} holds {len(pieces)} tokens but the checkpoint's vocab_size is {vocab_size}; "
            "pass the tokenizer the checkpoint was trained with"
        )
    expected_bytes = [f"<0x{b:02X}>" for b in range(N_BYTES)]
    if pieces[BYTE_FALLBACK_OFFSET : BYTE_FALLBACK_OFFSET + N_BYTES] != expected_bytes:
        raise SpecgraftError(
            f"{path} does not hold the byte pieces <0x00>..<0xFF> at ids {BYTE_FALLBACK_OFFSET}.."
            f"{BYTE_FALLBACK_OFFSET + N_BYTES - 1} that llama2.c's byte fallback needs; pass a llama2.c tok*.bin"
        )
    return pieces, scores


def llama2c_encode(text: str, vocab: list[str], scores: list[float], bos: bool = True, eos: bool = False) -> list[int]:
    """llama2.c ``run.c`` ``encode()``, literally (quadratic; a reference for tests, not for production).

    ``vocab``/``scores`` as returned by :func:`read_llama2c_vocab` (spaces stored as ``" "``).
    """
    lookup: dict[str, int] = {}
    for i, piece in enumerate(vocab):
        lookup.setdefault(piece, i)
    tokens: list[int] = [BOS_ID] if bos else []
    if text:
        tokens.append(lookup[" "])  # run.c's dummy prefix, added only to non-empty text
    for ch in text:
        if ch in lookup:
            tokens.append(lookup[ch])
        else:
            tokens.extend(b + BYTE_FALLBACK_OFFSET for b in ch.encode("utf-8"))
    while True:
        best_score, best_id, best_idx = _NO_SCORE, -1, -1
        for i in range(len(tokens) - 1):
            merged = lookup.get(vocab[tokens[i]] + vocab[tokens[i + 1]], -1)
            if merged != -1 and scores[merged] > best_score:  # strict: the leftmost pair wins ties
                best_score, best_id, best_idx = scores[merged], merged, i
        if best_idx == -1:
            break
        tokens[best_idx : best_idx + 2] = [best_id]
    if eos:
        tokens.append(EOS_ID)
    return tokens


def _bpe_merges(pieces: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every pair of pieces whose concatenation is a piece, ranked like llama2.c's greedy rule.

    llama2.c merges the adjacent pair whose concatenation scores highest, so a merge's rank is the score of the
    merged piece (higher first). Several splits of one piece share its score; they are ordered by split point.
    ``tokenizers`` BPE then picks the lowest-rank pair (leftmost on ties) exactly as run.c picks the best score
    (leftmost on ties), except when two *different* pairs of equal score compete for an overlapping token; no such
    case arises in tok512.bin (unique scores; checked against :func:`llama2c_encode` on all of TinyStories).
    Pieces of ids 0..2 (specials) are never merge results (their llama2.c text starts with a byte-fallback "\\n").
    """
    lookup = {p: i for i, p in enumerate(pieces)}
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for i, piece in enumerate(pieces):
        if i < BYTE_FALLBACK_OFFSET:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if min(lookup.get(left, -1), lookup.get(right, -1)) >= BYTE_FALLBACK_OFFSET:
                ranked.append((-scores[i], i, k, (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def build_llama2c_tokenizer(vocab: list[str], scores: list[float]) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer equivalent to llama2.c's encoder/decoder for ``vocab``/``scores``.

    Encoding: prepend ``▁`` to non-empty text, spaces -> ``▁``, BPE with merges ranked by score and byte fallback,
    BOS prepended by default (``add_bos_token``). Decoding: ``▁`` -> space, ``<0xNN>`` -> raw bytes, strip one
    leading space. Known differences from run.c, both outside normal text: a literal ``▁`` (U+2581) in the input
    is read as a space, and the strings ``<s>``/``</s>``/``<unk>`` in the input are read as special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    hf_pieces = list(SPECIAL_PIECES) + [p.replace(" ", SPIECE_SPACE) for p in vocab[len(SPECIAL_PIECES) :]]
    hf_vocab = {p: i for i, p in enumerate(hf_pieces)}
    if len(hf_vocab) != len(hf_pieces):
        dupes = sorted({p for p in hf_pieces if hf_pieces.count(p) > 1})[:5]
        raise SpecgraftError(f"the llama2.c vocab repeats pieces {dupes}; pass a valid llama2.c tok*.bin")
    merges = _bpe_merges(hf_pieces, scores)
    backend = Tokenizer(
        models.BPE(vocab=hf_vocab, merges=merges, unk_token=SPECIAL_PIECES[UNK_ID], byte_fallback=True, fuse_unk=True)
    )
    # No pre-tokenizer: llama2.c merges across the whole text (pieces such as "▁the" span word boundaries).
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPIECE_SPACE), normalizers.Replace(" ", SPIECE_SPACE)]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in SPECIAL_PIECES])
    bos = SPECIAL_PIECES[BOS_ID]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=SPECIAL_PIECES[UNK_ID],
        bos_token=bos,
        eos_token=SPECIAL_PIECES[EOS_ID],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )


def load_llama2c_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Build the transformers tokenizer for a llama2.c ``tok*.bin`` (see :func:`build_llama2c_tokenizer`).

    Raises:
        SpecgraftError: see :func:`read_llama2c_vocab`.
    """
    vocab, scores = read_llama2c_vocab(path, vocab_size=vocab_size)
    return build_llama2c_tokenizer(vocab, scores)


# --- conversion + CLI -----------------------------------------------------------------------------------------


def convert_llama2c(
    checkpoint: str | os.PathLike,
    tokenizer: str | os.PathLike,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
) -> Path:
    """Write a transformers folder (safetensors model, tokenizer.json, generation_config) for a llama2.c model.

    The folder is built beside ``out_dir`` and renamed into place, so it appears complete or not at all.

    Raises:
        SpecgraftError: bad inputs (see :func:`read_llama2c_header`, :func:`read_llama2c_vocab`), or ``out_dir``
            is a file, or a non-empty folder and ``overwrite`` is False.
    """
    out_dir = Path(out_dir)
    with writing_output(out_dir, "convert-llama2c", overwrite=overwrite, inputs=[checkpoint, tokenizer]):
        model = load_llama2c_model(checkpoint)
        tok = load_llama2c_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
        tok.model_max_length = model.config.max_position_embeddings
        with atomic_path(out_dir) as tmp:
            tmp.mkdir()
            model.save_pretrained(tmp, safe_serialization=True)  # also writes generation_config.json
            tok.save_pretrained(tmp)
    return out_dir
