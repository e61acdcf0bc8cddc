"""Facts about torch dtypes and transformers models shared by target loading, GGUF conversion, distillation,
export and the feature cache (one copy of each map and check)."""

from __future__ import annotations

from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.utils.args import DTYPE_NAMES

#: Floating dtype names accepted by recipes and CLIs.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """Map a recipe dtype name to a torch dtype (``auto`` is passed through to transformers)."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise SpecgraftError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} or auto") from None


def require_causal_lm(config: Any, where: str) -> None:
    """Refuse a config that is not a decoder-only causal LM, naming what it is."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    archs_saved = getattr(config, "architectures", None) or []
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    # Encoder families (BERT, RoBERTa, ...) have a causal-LM class too; a checkpoint saved as an encoder is not one.
    saved_as_other = bool(archs_saved) and not any(a in causal_classes for a in archs_saved)
    if (getattr(config, "is_encoder_decoder", False) or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            or saved_as_other):
        archs = ", ".join(getattr(config, "architectures", None) or []) or model_type
        raise SpecgraftError(
            f"{where} is a {model_type} model ({archs}), not a decoder-only causal LM; "
            "pass a model that AutoModelForCausalLM loads (Llama, Qwen, Mistral, Gemma, Phi, ...)"
        )


def load_tokenizer(name: str, what: str, fix: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(name, **kwargs)`` whose failures are one :class:`SpecgraftError` naming
    ``what`` (the input) and ending with ``fix``: missing files (OSError), rejected values (ValueError) and the
    bare ``Exception`` the Rust ``tokenizers`` library raises on a malformed ``tokenizer.json`` (a merge rule
    that is not a pair, say)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        reason = exc
    except Exception as exc:  # noqa: BLE001 (tokenizers raises plain Exception; anything else is re-raised)
        if type(exc) is not Exception:
            raise
        reason = exc
    first = (str(reason).strip().splitlines() or [type(reason).__name__])[0][:160]
    raise SpecgraftError(f"could not load the tokenizer of {what} ({type(reason).__name__}: {first}); {fix}")
