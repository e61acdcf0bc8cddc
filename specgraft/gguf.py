"""GGUF targets: a ``.gguf`` file (llama.cpp's format) as a plain transformers model folder.

transformers loads a GGUF with ``from_pretrained(folder, gguf_file=name)`` and dequantizes it, but the result
refuses ``save_pretrained`` and costs a dequantization on every load. :func:`convert_gguf` rebuilds the dequantized
weights as a plain model (same transformers class, no quantization config) and saves it with the GGUF's tokenizer
and chat template. :func:`resolve_model_path` is what every loader calls: a path ending in ``.gguf`` becomes a
folder in a cache keyed by the file's SHA-256 (converted once, reused next time; a changed file gets a new
folder), anything else is returned unchanged. Each converted folder records its source in ``gguf_source.json``,
which :func:`~specgraft.target.load_target` copies into the target's identity.

The cache lives in ``$SPECGRAFT_GGUF_CACHE`` when set, else ``$XDG_CACHE_HOME/specgraft/gguf`` (default
``~/.cache/specgraft/gguf``). Cached folders are always float32: dequantized values are exact in float32, and a
loader that asks for another dtype casts on load, so one conversion serves every dtype.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.utils.io import atomic_path, require_file, sha256_file
from specgraft.utils.outputs import writing_output

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
#: Written into every converted folder: the GGUF file's name, SHA-256 and transformers model_type.
SOURCE_FILE = "gguf_source.json"
CACHE_ENV = "SPECGRAFT_GGUF_CACHE"
#: Bump when the converted folder of the same GGUF changes (invalidates cached conversions). 2: files whose
#: weights are not all in the file are refused (version 1 cached them with random weights).
CONVERTER_VERSION = 2
#: Characters of the SHA-256 in a cache folder's name (64 bits: collisions are not a practical concern).
CACHE_KEY_CHARS = 16
_INSTALL_HINT = "pip install 'specgraft[gguf]' (or pip install gguf)"
#: Metadata keys that may name the Hub repository a GGUF was converted from, most specific first (llama.cpp's
#: convert_hf_to_gguf.py writes the first two from the model card; older files the third).
SOURCE_REPO_KEYS = ("general.source.repo_url", "general.source.url", "general.source.huggingface.repository")
_HUB_URL_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "huggingface.co/")


@dataclass(frozen=True)
class GGUFSource:
    """What a converted folder was made from."""

    file_name: str
    sha256: str
    model_type: str

    def describe(self) -> str:
        """The one-string form stored in :class:`~specgraft.target.TargetIdentity` ``source``."""
        return f"gguf:{self.file_name} sha256:{self.sha256}"

    def to_dict(self) -> dict[str, Any]:
        return {"format": "gguf", "file_name": self.file_name, "sha256": self.sha256,
                "model_type": self.model_type, "converter_version": CONVERTER_VERSION}


def is_gguf_path(name_or_path: str | os.PathLike) -> bool:
    """True when ``name_or_path`` names a GGUF file (by its suffix, case-insensitive)."""
    return str(name_or_path).lower().endswith(GGUF_SUFFIX)


def default_cache_dir() -> Path:
    """``$SPECGRAFT_GGUF_CACHE``, else ``$XDG_CACHE_HOME/specgraft/gguf`` (``~/.cache/specgraft/gguf``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specgraft" / "gguf"


def _require_gguf_package() -> Any:
    try:
        import gguf
    except ImportError:
        raise SpecgraftError(f"reading .gguf files needs the gguf package, which is not installed; "
                             f"{_INSTALL_HINT}") from None
    return gguf


#: Byte sizes of GGUF's fixed-size value types (by type id); 8 is a string, 9 an array.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
#: Dimensions a GGUF tensor may have (ggml's GGML_MAX_DIMS).
_GGUF_MAX_DIMS = 4


def check_gguf_sizes(path: Path, fix: str) -> None:
    """Walk a GGUF's header (metadata and tensor infos) and refuse any count or length its file cannot hold,
    before a reader allocates by it: a few KB whose metadata claims a billion-entry array would otherwise cost
    gigabytes of memory. Reads the header only (memory-mapped)."""
    import mmap
    import struct

    size = path.stat().st_size

    def bad(what: str) -> SpecgraftError:
        return SpecgraftError(f"{path} is truncated or corrupt: {what} does not fit in its {size} bytes; {fix}")

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        pos = 4

        def take(fmt: str, what: str) -> int:
            nonlocal pos
            width = struct.calcsize(fmt)
            if pos + width > size:
                raise bad(what)
            (value,) = struct.unpack_from(fmt, data, pos)
            pos += width
            return int(value)

        def skip(n: int, what: str) -> None:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise bad(what)
            pos += n

        def value(kind: int, what: str, depth: int = 0) -> None:
            if kind in _GGUF_SCALAR_BYTES:
                skip(_GGUF_SCALAR_BYTES[kind], what)
            elif kind == _GGUF_STRING:
                skip(take("<Q", what), f"{what} (a string)")
            elif kind == _GGUF_ARRAY and depth < 2:
                item, count = take("<I", what), take("<Q", what)
                least = _GGUF_SCALAR_BYTES.get(item, 8)  # a string or array item takes at least its 8-byte count
                if count * least > size - pos:
                    raise bad(f"{what} (an array of {count} items)")
                if item in _GGUF_SCALAR_BYTES:
                    skip(count * least, what)
                else:
                    for _ in range(count):
                        value(item, what, depth + 1)
            else:
                raise SpecgraftError(f"{path} is corrupt: {what} has an unknown value type {kind}; {fix}")

        version = take("<I", "the version")
        count_format = "<I" if version == 1 else "<Q"
        tensors, entries = take(count_format, "the tensor count"), take(count_format, "the metadata count")
        if entries * 12 > size - pos or tensors * 24 > size - pos:  # a key length + type; a tensor info at least
            raise bad(f"a header of {entries} metadata entries and {tensors} tensors")
        for i in range(entries):
            key_length = take("<Q", f"metadata entry {i}")
            skip(key_length, f"the key of metadata entry {i}")
            key = bytes(data[pos - key_length:pos]).decode("utf-8", "replace")
            value(take("<I", key), f"metadata {key!r}")
        for i in range(tensors):
            skip(take("<Q", f"tensor {i}'s name"), f"tensor {i}'s name")
            dims = take("<I", f"tensor {i}'s dimension count")
            if dims > _GGUF_MAX_DIMS:
                raise SpecgraftError(f"{path} is corrupt: tensor {i} claims {dims} dimensions (at most "
                                     f"{_GGUF_MAX_DIMS}); {fix}")
            skip(8 * dims + 4 + 8, f"tensor {i}'s shape, type and offset")


def inspect_gguf(path: str | os.PathLike) -> str:
    """Check that ``path`` is a complete GGUF file and return its ``general.architecture``.

    Raises:
        SpecgraftError: the gguf package is missing, the file is missing, is not GGUF (magic), is truncated or
            corrupt, or has no architecture field.
    """
    gguf = _require_gguf_package()
    path = Path(path).expanduser()
    fix = "re-download the file or export it again with llama.cpp's convert_hf_to_gguf.py"
    require_file(path, "GGUF file", "pass the path of a .gguf file")
    with open(path, "rb") as fh:
        magic = fh.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise SpecgraftError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); {fix}")
    size = path.stat().st_size
    check_gguf_sizes(path, fix)  # before the reader allocates by the header's counts
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError) as exc:
        # The reader memory-maps the file; a cut header or tensor block surfaces as a failed reshape/view.
        raise SpecgraftError(f"{path} is truncated or corrupt ({size} bytes; the GGUF reader says: "
                             f"{str(exc).splitlines()[0][:120]}); {fix}") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise SpecgraftError(f"{path} is truncated: its tensors end at byte {end} but the file has {size}; {fix}")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise SpecgraftError(f"{path} has no general.architecture field, so it is not a model GGUF; {fix}")
    return str(field.contents())


@dataclass(frozen=True)
class GGUFOrigin:
    """What a GGUF file says about the model it holds (None where its metadata is silent)."""

    name: str | None
    """``general.name``, a display name (e.g. ``Smollm2 135M 8k Lc100K Mix1 Ep2``), not a loadable id."""
    hub_id: str | None
    """``ORG/NAME`` of the Hugging Face repository it was converted from (see :data:`SOURCE_REPO_KEYS`)."""


def _hub_id(value: str, bare: bool) -> str | None:
    """``ORG/NAME`` from a Hub URL (or, with ``bare``, a plain ``ORG/NAME``); None for anything else (another
    site, a local path)."""
    text = value.strip()
    prefix = next((p for p in _HUB_URL_PREFIXES if text.startswith(p)), None)
    if prefix is not None:
        text = text[len(prefix):]
    elif not bare or "://" in text or text.startswith((".", "/", "~")):
        return None
    parts = text.strip("/").split("/")
    return f"{parts[0]}/{parts[1]}" if len(parts) >= 2 and parts[0] and parts[1] else None


def gguf_origin(path: str | os.PathLike) -> GGUFOrigin | None:
    """The name and Hub source recorded in a GGUF's metadata; None when the file or the gguf package is absent
    or the file cannot be read (callers then ask the user, they do not fail on it)."""
    path = Path(path).expanduser()
    try:
        import gguf
    except ImportError:
        return None
    if not path.is_file():
        return None
    try:
        check_gguf_sizes(path, "")
        fields = gguf.GGUFReader(str(path)).fields
    except (SpecgraftError, OSError, ValueError, IndexError, KeyError, OverflowError):
        return None

    def text(key: str) -> str | None:
        field = fields.get(key)
        value = field.contents() if field is not None else None
        return value if isinstance(value, str) and value.strip() else None

    # URL keys must point at the Hub; the repository key holds a bare ORG/NAME.
    repos = (_hub_id(value, bare=not key.endswith("url"))
             for key, value in zip(SOURCE_REPO_KEYS, map(text, SOURCE_REPO_KEYS)) if value is not None)
    return GGUFOrigin(name=text("general.name"), hub_id=next((r for r in repos if r), None))


def _supported_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]


def gguf_config(path: str | os.PathLike) -> Any:
    """The transformers config of a GGUF (metadata only, no tensor is read).

    Raises:
        SpecgraftError: see :func:`inspect_gguf`; an architecture transformers cannot load from GGUF, or one
            that is not a decoder-only causal LM.
    """
    from transformers import AutoConfig

    from specgraft.utils.models import require_causal_lm

    path = Path(path).expanduser()
    architecture = inspect_gguf(path)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as exc:
        if "not supported" not in str(exc):
            raise SpecgraftError(f"transformers could not read the config of {path} "
                                 f"({str(exc).splitlines()[0][:160]}); check the file") from None
        raise SpecgraftError(
            f"{path} holds a {architecture!r} model, which transformers cannot load from GGUF (it loads "
            f"{', '.join(_supported_architectures())}); use the original checkpoint of this model instead"
        ) from None
    require_causal_lm(config, f"{path} ({architecture})")
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and (not isinstance(context, int) or context < 1):
        raise SpecgraftError(f"{path} says its context length is {context!r} ({architecture}.context_length); a "
                             "model needs at least 1 position: re-export the GGUF from the original checkpoint")
    return config


@dataclass
class LoadedGGUF:
    """transformers' own loading of a GGUF: the dequantized float32 model (it refuses ``save_pretrained``), the
    tokenizer with its chat template, and where it came from."""

    model: Any
    tokenizer: Any
    source: GGUFSource


def load_gguf(path: str | os.PathLike) -> LoadedGGUF:
    """Check and load a GGUF with transformers (``from_pretrained(folder, gguf_file=name)``), dequantized to
    float32 (the quantized blocks are exact in it).

    Raises:
        SpecgraftError: see :func:`gguf_config`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    config = gguf_config(path)
    folder, name = str(path.parent), path.name
    model, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                       output_loading_info=True)
    # Every parameter must come from the file: transformers initialises the ones it does not find at random
    # (metadata naming more layers than the file holds, a dropped tensor, an architecture loaded as a class
    # whose weights it does not have) and the conversion would "succeed" with a partly random model.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise SpecgraftError(f"{path} does not hold every weight its metadata describes ({config.model_type}: "
                             f"{', '.join(missing[:3])}{more} are missing and would be random); re-export the GGUF "
                             "from the original checkpoint with llama.cpp's convert_hf_to_gguf.py")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    context = getattr(config, "max_position_embeddings", None)
    if context:
        tokenizer.model_max_length = int(context)  # the GGUF tokenizer otherwise claims an unbounded length
    source = GGUFSource(file_name=path.name, sha256=sha256_file(path), model_type=config.model_type)
    return LoadedGGUF(model, tokenizer, source)


def plain_model(loaded: LoadedGGUF, dtype: str = "float32") -> Any:
    """A plain, savable copy of a GGUF-loaded model in ``dtype``: same class and config, no quantization."""
    import torch
    from transformers import AutoModelForCausalLM

    from specgraft.utils.models import resolve_dtype

    torch_dtype = resolve_dtype(dtype)
    if not isinstance(torch_dtype, torch.dtype):
        raise SpecgraftError(f"--dtype {dtype} is not a concrete dtype; use float32, bfloat16 or float16")
    config = copy.deepcopy(loaded.model.config)
    # The loaded config carries the GGUF "quantization" that blocks save_pretrained; the weights are plain now.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.model.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.generation_config = copy.deepcopy(loaded.model.generation_config)
    return plain.to(torch_dtype).eval()


def save_converted(loaded: LoadedGGUF, out: str | os.PathLike, dtype: str = "float32",
                   overwrite: bool = False) -> Path:
    """Write a loaded GGUF as a transformers folder (see :func:`convert_gguf`)."""
    out = Path(out).expanduser()
    with writing_output(out, "convert-gguf", overwrite=overwrite):
        return _save_converted(loaded, out, dtype)


def _save_converted(loaded: LoadedGGUF, out: Path, dtype: str) -> Path:
    model = plain_model(loaded, dtype)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        loaded.tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(loaded.source.to_dict(), indent=2) + "\n", encoding="utf-8")
    return out


def convert_gguf(file: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32",
                 overwrite: bool = False) -> Path:
    """Write ``file`` (a GGUF) as a transformers folder: safetensors weights in ``dtype``, tokenizer, chat
    template, generation config and ``gguf_source.json``. The folder is built beside ``out`` and renamed into
    place, so it appears complete or not at all.

    Raises:
        SpecgraftError: see :func:`gguf_config`; ``out`` is a file, or a non-empty folder without ``overwrite``.
    """
    out = Path(out).expanduser()
    with writing_output(out, "convert-gguf", overwrite=overwrite, inputs=[file]):  # checked before the slow part
        return _save_converted(load_gguf(file), out, dtype)


def read_source(folder: str | os.PathLike) -> GGUFSource | None:
    """The GGUF a converted folder was made from (None for any other folder or a Hub id)."""
    file = Path(folder).expanduser() / SOURCE_FILE
    if not file.is_file():
        return None
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
        return GGUFSource(str(meta["file_name"]), str(meta["sha256"]), str(meta.get("model_type", "")))
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        logger.warning("ignoring unreadable %s", file)
        return None


def cached_folder(file: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder of ``file``'s content (whether or not it exists yet)."""
    path = Path(file).expanduser()
    digest = sha256_file(path)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / f"{path.stem}-{digest[:CACHE_KEY_CHARS]}-v{CONVERTER_VERSION}"


def resolve_model_path(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """A loadable transformers name for ``name_or_path``: a ``.gguf`` file becomes its cached converted folder
    (converted now when missing), anything else is returned unchanged.

    Raises:
        SpecgraftError: a GGUF that does not exist or cannot be converted (see :func:`gguf_config`).
    """
    if not is_gguf_path(name_or_path):
        return str(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise SpecgraftError(f"GGUF file {name_or_path} does not exist; pass the path of a .gguf file (a Hub GGUF "
                             "must be downloaded first, e.g. with `hf download REPO FILE.gguf`)")
    folder = cached_folder(path, cache_dir)
    if (folder / SOURCE_FILE).is_file():
        logger.debug("using the cached conversion %s of %s", folder, path)
        return str(folder)
    start = time.perf_counter()
    logger.info("converting %s to a transformers folder (once; cached in %s)", path, folder)
    convert_gguf(path, folder, overwrite=True)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    return str(folder)
