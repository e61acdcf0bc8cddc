"""The student (draft) model: an existing causal LM with the target's tokenizer, or one cut from the target.

* ``distill.student`` set: load that causal LM and its tokenizer, and refuse (one line naming the difference) when
  its tokenizer is not the target's (vocabulary or special tokens, compared through
  :func:`specgraft.target.tokenizer_fingerprint`). Families often pad the embedding matrix differently per size
  (Qwen2.5-0.5B has 151936 rows, Qwen2.5-32B 152064, same tokenizer): when the tokenizers agree and both matrices
  cover the tokenizer, the student's embedding and output rows are resized to the target's count so the logits
  line up (and ``assistant_model=`` / the eval drafters accept the pair).
* ``distill.student`` unset: build the student from the target itself, for families without a small sibling.
  Decoder layers ``0, k, 2k, ...`` (``k = distill.keep_every_k_layers``) are kept with their weights, as are the
  embeddings, final norm and output head. With ``distill.student_hidden_size`` the student is narrower (same head
  size, proportionally fewer heads and a proportionally smaller MLP) and randomly initialised.

A student with more parameters than the target is allowed with a warning (it would not speed anything up).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.gguf import resolve_model_path
from specgraft.target import Target, tokenizer_fingerprint
from specgraft.utils.models import require_causal_lm, resolve_dtype

logger = logging.getLogger(__name__)

#: Per-layer config lists that must follow the kept layers when cutting layers out of a target.
PER_LAYER_CONFIG_FIELDS = ("layer_types", "no_rope_layers")
#: Special tokens whose ids are part of a tokenizer's identity.
SPECIAL_TOKEN_NAMES = ("bos", "eos", "pad", "unk")


@dataclass
class Student:
    """A student ready for distillation and what it was made from."""

    model: PreTrainedModel
    tokenizer: Any
    origin: str
    """``distill.student`` (a path or Hub id), or ``target`` when cut from the target."""
    kept_layers: list[int] | None = None
    """Target decoder layers the student was built from (None for a loaded student)."""
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.model)

    def describe(self) -> dict[str, Any]:
        """JSON-able facts recorded beside the trained draft."""
        cfg = self.model.config.get_text_config()
        return {
            "origin": self.origin,
            "kept_layers": self.kept_layers,
            "num_parameters": self.num_parameters,
            "num_hidden_layers": int(cfg.num_hidden_layers),
            "hidden_size": int(cfg.hidden_size),
            "vocab_size": int(cfg.vocab_size),
            **self.notes,
        }


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def kept_layer_indices(num_layers: int, keep_every_k: int) -> list[int]:
    """Decoder layers a student cut from an ``num_layers``-layer target keeps: ``0, k, 2k, ...``."""
    if keep_every_k < 1:
        raise SpecgraftError(f"distill.keep_every_k_layers must be positive, got {keep_every_k}")
    return list(range(0, num_layers, keep_every_k))


# -- tokenizer checks --------------------------------------------------------------------------------------------


def tokenizer_difference(student_tokenizer: Any, target_tokenizer: Any) -> str | None:
    """None when both tokenizers have the same fingerprint, else a short description of the first difference."""
    if tokenizer_fingerprint(student_tokenizer) == tokenizer_fingerprint(target_tokenizer):
        return None
    s_vocab, t_vocab = student_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if len(s_vocab) != len(t_vocab):
        return f"{len(s_vocab)} vs {len(t_vocab)} tokens"
    for name in SPECIAL_TOKEN_NAMES:
        s_id = getattr(student_tokenizer, f"{name}_token_id", None)
        t_id = getattr(target_tokenizer, f"{name}_token_id", None)
        if s_id != t_id:
            return f"{name} token id {s_id} vs {t_id}"
    s_inv = {i: tok for tok, i in s_vocab.items()}
    t_inv = {i: tok for tok, i in t_vocab.items()}
    for i in sorted(set(s_inv) | set(t_inv)):
        if s_inv.get(i) != t_inv.get(i):
            return f"token id {i} is {s_inv.get(i)!r} vs {t_inv.get(i)!r}"
    return "different vocabularies"


def check_student_tokenizer(student_tokenizer: Any, target_tokenizer: Any, student_name: str,
                            target_name: str, student_vocab: int | None = None,
                            target_vocab: int | None = None) -> None:
    """Raise :class:`TargetMismatchError` (one line naming the difference) unless the tokenizers agree.

    Embedding sizes are reported alongside; they may differ when both cover the tokenizer (see the module docs).
    """
    if target_tokenizer is None:
        raise SpecgraftError(f"the target {target_name} has no tokenizer, so the student's cannot be checked; "
                             "save the tokenizer beside the target")
    diff = tokenizer_difference(student_tokenizer, target_tokenizer)
    sizes = (f"; model vocab sizes {student_vocab} vs {target_vocab}"
             if student_vocab is not None and target_vocab is not None and student_vocab != target_vocab else "")
    if diff is not None:
        raise TargetMismatchError(
            f"the student {student_name} does not use the target's tokenizer (student vs target: {diff}{sizes}); "
            f"pick a student of the same family as {target_name}, or leave distill.student unset to build one "
            "from the target")
    n_tokens = len(target_tokenizer)
    for who, size in (("student", student_vocab), ("target", target_vocab)):
        if size is not None and size < n_tokens:
            raise TargetMismatchError(
                f"the {who} has {size} vocabulary rows but the shared tokenizer has {n_tokens} tokens; "
                f"use a {who} whose embedding covers its tokenizer")


# -- building ----------------------------------------------------------------------------------------------------


def _layers_prefix(model: PreTrainedModel) -> str:
    """State-dict prefix of the decoder layer list (``model.layers`` for Llama-family models)."""
    layers = model.get_decoder().layers
    for name, module in model.named_modules():
        if module is layers:
            return name
    raise SpecgraftError(f"could not find the decoder layers of {type(model).__name__}; "
                         "pass a small model of the same family as distill.student instead")


def _narrow_config(config: Any, hidden_size: int) -> None:
    """Shrink ``config`` in place to ``hidden_size``: same head size, fewer heads, proportionally smaller MLP."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if hidden_size % head_dim:
        raise SpecgraftError(f"distill.student_hidden_size {hidden_size} is not a multiple of the target's head "
                             f"size {head_dim}; use a multiple of {head_dim}")
    new_heads = hidden_size // head_dim
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    group = max(1, heads // kv)  # query heads per key/value head (GQA), kept when possible
    new_kv = new_heads // group if new_heads % group == 0 and new_heads >= group else math.gcd(new_heads, kv)
    scale = hidden_size / int(config.hidden_size)
    config.hidden_size = hidden_size
    config.num_attention_heads = new_heads
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = max(1, new_kv)
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = head_dim
    if getattr(config, "intermediate_size", None):
        config.intermediate_size = max(1, round(int(config.intermediate_size) * scale))


def student_from_target(target: Target, keep_every_k_layers: int, hidden_size: int | None = None,
                        dtype: torch.dtype = torch.float32) -> Student:
    """Cut a student out of ``target``: keep layers ``0, k, 2k, ...`` with their weights (see the module docs).

    Args:
        target: the frozen target.
        keep_every_k_layers: k.
        hidden_size: a narrower width; the student is then randomly initialised (seed it first).
        dtype: the student's parameter dtype (float32: it is trained).
    """
    model = target.model
    config = copy.deepcopy(model.config)
    if config.get_text_config() is not config:
        raise SpecgraftError(f"building a student from the multimodal target {target.name_or_path} is not "
                             "supported; pass a small text model with its tokenizer as distill.student")
    n = int(config.num_hidden_layers)
    kept = kept_layer_indices(n, keep_every_k_layers)
    config.num_hidden_layers = len(kept)
    for name in PER_LAYER_CONFIG_FIELDS:
        values = getattr(config, name, None)
        if isinstance(values, (list, tuple)) and len(values) == n:
            setattr(config, name, [values[i] for i in kept])
    narrow = hidden_size is not None and hidden_size != int(config.hidden_size)
    if narrow:
        _narrow_config(config, int(hidden_size))
    student = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not narrow:
        prefix = _layers_prefix(model) + "."
        position = {old: new for new, old in enumerate(kept)}
        state = {}
        for key, value in model.state_dict().items():
            if key.startswith(prefix):
                index, rest = key[len(prefix):].split(".", 1)
                if int(index) not in position:
                    continue
                key = f"{prefix}{position[int(index)]}.{rest}"
            state[key] = value.detach().to(dtype)
        student.load_state_dict(state, strict=True)
    if getattr(model, "generation_config", None) is not None:
        student.generation_config = copy.deepcopy(model.generation_config)
    student.train()
    logger.info("student built from the target: layers %s of %d%s, %d parameters", kept, n,
                f", hidden size {hidden_size} (random init)" if narrow else "", count_parameters(student))
    return Student(model=student, tokenizer=target.tokenizer, origin="target", kept_layers=kept,
                   notes={"random_init": narrow})


def load_student(name_or_path: str, target: Target, dtype: torch.dtype | str = torch.float32,
                 revision: str | None = None, trust_remote_code: bool = False) -> Student:
    """Load ``name_or_path`` as the student, check its tokenizer against the target's, align vocabulary rows."""
    from pathlib import Path

    from transformers import AutoConfig

    origin = name_or_path
    name_or_path = resolve_model_path(name_or_path)  # a .gguf becomes its cached converted folder
    local = Path(name_or_path).expanduser()
    if not local.exists() and (name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1):
        raise SpecgraftError(f"distill.student {name_or_path} does not exist; pass a folder with config.json or "
                             "a Hub id")
    try:
        config = AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise SpecgraftError(f"could not load the config of distill.student {name_or_path} ({first}); "
                             "check the path or Hub id") from None
    require_causal_lm(config, f"distill.student {name_or_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise SpecgraftError(f"could not load the tokenizer of distill.student {name_or_path} "
                             f"({type(exc).__name__}); the student must ship the target's tokenizer") from None
    student_vocab = int(config.get_text_config().vocab_size)
    check_student_tokenizer(tokenizer, target.tokenizer, name_or_path, target.name_or_path,
                            student_vocab, target.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=resolve_dtype(dtype), revision=revision,
                                                 trust_remote_code=trust_remote_code)
    notes: dict[str, Any] = {}
    if student_vocab != target.vocab_size:
        # Same tokenizer, differently padded embedding matrices: rows past the tokenizer are never real text.
        model.resize_token_embeddings(target.vocab_size, mean_resizing=False)
        notes["resized_vocab_from"] = student_vocab
        logger.info("student vocabulary rows resized from %d to the target's %d (same tokenizer)",
                    student_vocab, target.vocab_size)
    model.train()
    return Student(model=model, tokenizer=tokenizer, origin=origin, notes=notes)


def precheck_student_tokenizer(model_cfg: Any, distill_cfg: Any) -> None:
    """Compare the student's tokenizer with the target's before anything heavy is loaded (no-op without a
    ``distill.student``; a target whose tokenizer cannot be loaded is left to the full check)."""
    from transformers import AutoConfig

    if not distill_cfg.student:
        return
    target_name = resolve_model_path(model_cfg.name_or_path)
    student_name = resolve_model_path(distill_cfg.student)
    try:
        target_tok = AutoTokenizer.from_pretrained(target_name, revision=model_cfg.revision,
                                                   trust_remote_code=model_cfg.trust_remote_code)
        target_vocab = int(AutoConfig.from_pretrained(
            target_name, revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code).get_text_config().vocab_size)
    except (OSError, ValueError):
        return
    try:
        student_tok = AutoTokenizer.from_pretrained(student_name)
        student_vocab = int(AutoConfig.from_pretrained(student_name).get_text_config().vocab_size)
    except (OSError, ValueError):
        return  # load_student reports it with the full context
    check_student_tokenizer(student_tok, target_tok, distill_cfg.student, model_cfg.name_or_path,
                            student_vocab, target_vocab)


def build_student(target: Target, distill_cfg: Any, dtype: torch.dtype = torch.float32) -> Student:
    """The student a recipe's ``distill`` section describes; warns when it is larger than the target."""
    if distill_cfg.student:
        if distill_cfg.student_hidden_size is not None:
            logger.warning("distill.student_hidden_size applies only when building from the target; ignored for %s",
                           distill_cfg.student)
        student = load_student(distill_cfg.student, target, dtype=dtype)
    else:
        student = student_from_target(target, distill_cfg.keep_every_k_layers, distill_cfg.student_hidden_size,
                                      dtype=dtype)
    warn_if_larger(student.model, target)
    return student


def warn_if_larger(student: torch.nn.Module, target: Target) -> bool:
    """Log a warning (and return True) when the student has more parameters than the target."""
    n_student, n_target = count_parameters(student), count_parameters(target.model)
    if n_student > n_target:
        logger.warning("the student has %d parameters, more than the target's %d: drafting with it will be slower "
                       "than decoding with the target alone; use a smaller student", n_student, n_target)
        return True
    return False
