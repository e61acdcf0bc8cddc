"""Loading what ``specgraft eval``, ``tune`` and ``profile`` share: the device and dtype to decode on and a draft LM
checked against the target (one copy, so the three commands cannot drift)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.utils.threads import set_torch_threads

logger = logging.getLogger(__name__)


def load_draft_model(path: str, target: Any, dtype: Any, device: str) -> tuple[Any, Any]:
    """The draft LM and its tokenizer (None when the folder has none), refusing another vocabulary/tokenizer."""
    from transformers import AutoTokenizer

    from specgraft.gguf import resolve_model_path
    from specgraft.target import load_target, tokenizer_fingerprint

    path = resolve_model_path(path)  # a .gguf draft becomes its cached converted folder
    local = Path(path).expanduser()
    if local.exists() and not (local / "config.json").is_file():
        raise SpecgraftError(f"draft model folder {path} has no config.json; pass a transformers model folder")
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        logger.info("draft model %s has no tokenizer; checking its vocabulary size only", path)
    draft = load_target(path, tokenizer, dtype=dtype, device=device, with_tokenizer=tokenizer is not None).model
    from specgraft.decoding.kv import text_config

    draft_vocab = int(text_config(draft).vocab_size)
    if draft_vocab != target.vocab_size:
        raise TargetMismatchError(f"the draft model {path} has a vocabulary of {draft_vocab} tokens but the target "
                                  f"{target.name_or_path} has {target.vocab_size}; use a draft with the target's "
                                  "vocabulary")
    if tokenizer is not None and target.tokenizer is not None \
            and tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(target.tokenizer):
        raise TargetMismatchError(f"the draft model {path} has a different tokenizer from the target "
                                  f"{target.name_or_path} (vocabulary or special tokens differ); use a draft trained "
                                  "with the target's tokenizer")
    return draft, tokenizer


def device_and_dtype(device: str | None = None, dtype: str | None = None,
                     threads: int | None = None) -> tuple[str, str]:
    """The device and dtype to decode on (a GPU when there is one, bf16 there and fp32 on the CPU, unless named);
    ``threads``: torch's CPU threads (None: torch's choice)."""
    import torch

    set_torch_threads(threads)
    device = check_device(device) if device else ("cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or ("float32" if device == "cpu" else "bfloat16")


def check_device(name: str) -> str:
    """``name`` if it is a torch device this machine has; a one-line error naming what it has otherwise."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise SpecgraftError(f"--device {name!r} is not a torch device name; use cpu, cuda, cuda:1 or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SpecgraftError(f"--device {name} but this torch ({torch.__version__}) sees no CUDA GPU; drop "
                                 "--device (cpu is then used) or install a CUDA build of torch")
        if device.index is not None and device.index >= count:
            raise SpecgraftError(f"--device {name} but this machine has {count} CUDA GPU(s) (cuda:0 to "
                                 f"cuda:{count - 1}); pick one of them")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise SpecgraftError(f"--device {name} but MPS is not available here; drop --device or use cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise SpecgraftError(f"--device {name}: specgraft evaluates on cpu, cuda or mps; use one of them")
    return name
