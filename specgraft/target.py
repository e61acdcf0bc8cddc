"""The frozen target model that heads are grafted onto.

:class:`Target` wraps any decoder-only transformers causal LM (a local folder, a Hub id, or an in-memory model),
freezes it, and exposes in one forward the logits and the hidden states of any requested layers, plus the
modules heads borrow (input embeddings, final norm, output head). :class:`TargetIdentity` records what a head was
made for, so that loading it onto another model fails with a clear message.

Layer indices follow transformers' ``output_hidden_states`` convention: index 0 is the embedding output, index
``i`` the output of decoder layer ``i - 1``, and index ``N`` (the last) is after the final norm in Llama-family
models. EAGLE-3 fuses indices ``(2, N//2, N-3)``; Medusa and EAGLE-1 read index ``N``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.gguf import read_source, resolve_model_path
from specgraft.utils.models import DTYPES, load_tokenizer, require_causal_lm, resolve_dtype  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A short stable hash of a tokenizer's vocabulary and special-token ids (None without a tokenizer)."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    payload = json.dumps({"vocab": vocab, "special": specials}, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class TargetIdentity:
    """What a head, feature cache or draft was made for."""

    name_or_path: str
    architecture: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    tokenizer_fingerprint: str | None = None
    #: Where the weights came from when not a plain folder or Hub id, e.g. ``gguf:NAME.gguf sha256:HEX`` (None
    #: otherwise, and in configs saved before this field existed). Informative: not a strict field.
    source: str | None = None

    #: Fields that must agree for a head to be usable; the name may differ (a local copy of the same model).
    STRICT_FIELDS = ("architecture", "hidden_size", "vocab_size", "num_hidden_layers", "tokenizer_fingerprint")

    @classmethod
    def of(cls, model: Any, tokenizer: Any = None, name_or_path: str | None = None,
           source: str | None = None) -> TargetIdentity:
        """The identity of ``model`` (a transformers causal LM, or a :class:`Target`, whose own tokenizer is used
        when ``tokenizer`` is None) with ``tokenizer``: what a head records when built, and what every drafter
        compares the decoder's model against (:meth:`require_same_model`)."""
        if isinstance(model, Target):
            tokenizer = model.tokenizer if tokenizer is None else tokenizer
            name_or_path = name_or_path or model.name_or_path
            model = model.model
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(
            name_or_path=str(name_or_path or getattr(model, "name_or_path", "") or type(model).__name__),
            architecture=type(model).__name__,
            model_type=str(getattr(text_config, "model_type", getattr(config, "model_type", ""))),
            hidden_size=int(text_config.hidden_size),
            vocab_size=int(text_config.vocab_size),
            num_hidden_layers=int(text_config.num_hidden_layers),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetIdentity:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    def mismatches(self, other: TargetIdentity) -> list[str]:
        """Human-readable differences in the strict fields (a missing fingerprint on either side is ignored)."""
        diffs = []
        for name in self.STRICT_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "tokenizer_fingerprint" and (mine is None or theirs is None):
                continue
            if mine != theirs:
                label = "tokenizer" if name == "tokenizer_fingerprint" else name
                diffs.append(f"{label} {mine} vs {theirs}")
        return diffs

    def require_same_model(self, model: Any, tokenizer: Any = None, what: str = "head") -> None:
        """Raise :class:`TargetMismatchError` if the model a decoder runs (and its tokenizer, when given) is not
        the target this object was made for (the drafters' ``bind`` check; names are not compared). ``model`` may
        be a :class:`Target`; only the ``tokenizer`` given is compared (None: the tokenizer is not checked)."""
        model = model.model if hasattr(model, "identity") and hasattr(model, "model") else model  # a Target
        diffs = self.mismatches(TargetIdentity.of(model, tokenizer))
        if diffs:
            raise TargetMismatchError(f"this {what} was made for {self.name_or_path}, not the model being decoded "
                                      f"({'; '.join(diffs)}); decode with the {what}'s own target and its tokenizer")

    def require_compatible(self, actual: TargetIdentity, what: str = "head") -> None:
        """Raise :class:`TargetMismatchError` if ``actual`` is not the target this object was made for."""
        diffs = self.mismatches(actual)
        if diffs:
            raise TargetMismatchError(
                f"this {what} was made for target {self.name_or_path} but the loaded target is "
                f"{actual.name_or_path} ({'; '.join(diffs)}); load it onto {self.name_or_path} "
                f"or train a new {what} for {actual.name_or_path}"
            )
        if self.name_or_path != actual.name_or_path:
            logger.warning("%s was made for %s; loading onto %s (same architecture, sizes and tokenizer)",
                           what, self.name_or_path, actual.name_or_path)
        if self.source and actual.source and self.source != actual.source:
            # Another quantization of the same model (e.g. Q4_1 vs Q8_0) fits but drafts a little differently.
            logger.warning("%s was made from %s; the loaded target comes from %s", what, self.source, actual.source)


@dataclass
class TargetOutput:
    """One target forward: logits [B, T, V] (None when not requested) and requested hidden states [B, T, h]."""

    logits: torch.Tensor | None
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    cache: Any = None


class Target:
    """A frozen decoder-only causal LM with the accessors draft heads need.

    Args:
        model: a transformers causal LM (``*ForCausalLM``).
        tokenizer: its tokenizer (optional, but needed for the identity's tokenizer fingerprint and for data).
        name_or_path: what to record as the target's name; defaults to ``model.name_or_path``.
        source: where the weights came from when converted (see :attr:`TargetIdentity.source`).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: Any = None, name_or_path: str | None = None,
                 source: str | None = None) -> None:
        require_causal_lm(model.config, name_or_path or getattr(model, "name_or_path", "") or "the model")
        self.model = model
        self.tokenizer = tokenizer
        self.model.requires_grad_(False)
        self.model.eval()
        self.config = model.config
        self.name_or_path = name_or_path or getattr(model, "name_or_path", "") or type(model).__name__
        text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.text_config = text_config
        self.identity = TargetIdentity.of(model, tokenizer, name_or_path=str(self.name_or_path), source=source)

    # -- sizes -----------------------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.identity.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.identity.vocab_size

    @property
    def num_layers(self) -> int:
        return self.identity.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.text_config, "max_position_embeddings", None)

    def default_eagle3_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's default fused layers ``(2, N//2, N-3)`` in output_hidden_states indices.

        For shallow targets where that formula repeats a layer (N <= 6, e.g. (2, 2, 2) for N = 5) three distinct
        layers spread over the stack are used instead: fusing one layer three times wastes the head's input.
        """
        n = self.num_layers
        layers = tuple(min(max(i, 0), n) for i in (2, n // 2, n - 3))
        if len(set(layers)) == 3:
            return layers
        candidates = list(range(1, n)) if n - 1 >= 3 else list(range(0, n + 1))
        return tuple(candidates[round(i * (len(candidates) - 1) / 2)] for i in range(3))

    def check_layer_indices(self, layers: Sequence[int], what: str = "layer index") -> None:
        """Raise if any index is outside ``[0, N]`` (output_hidden_states convention)."""
        bad = [i for i in layers if not 0 <= int(i) <= self.num_layers]
        if bad:
            raise SpecgraftError(
                f"{what} {bad} out of range for {self.name_or_path}, which has {self.num_layers} layers "
                f"(valid output_hidden_states indices: 0..{self.num_layers})"
            )

    # -- borrowed modules ------------------------------------------------------------------------------------
    @property
    def input_embeddings(self) -> nn.Module:
        """The token embedding module (Gemma's scaled embedding included: it returns what layer 0 sees)."""
        return self.model.get_input_embeddings()

    @property
    def output_head(self) -> nn.Module:
        """The vocabulary projection (lm_head)."""
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        """The decoder's final normalisation layer."""
        decoder = self.model.get_decoder()
        for name in ("norm", "final_layernorm", "ln_f"):
            module = getattr(decoder, name, None)
            if isinstance(module, nn.Module):
                return module
        raise SpecgraftError(f"could not find the final norm of {type(decoder).__name__}; this architecture is "
                             "not supported by heads that reuse the target's norm")

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, h] input embeddings (equal to ``output_hidden_states[0]``)."""
        return self.input_embeddings(input_ids)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., h] post-norm hidden states -> [.., V] logits, with the target's final logit soft-capping if any.

        ``hidden`` is cast to the lm_head's dtype: an offline feature cache decodes to fp32 whatever the target's."""
        logits = self.output_head(hidden.to(self.output_head.weight.dtype))
        softcap = getattr(self.text_config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def plain_output_head(self) -> nn.Linear | None:
        """The lm_head when :meth:`logits_from_hidden` is a plain linear map (an ``nn.Linear``, no soft-capping), so a
        loss over the vocabulary can be computed chunk by chunk from its weight; None otherwise."""
        head = self.output_head
        if getattr(self.text_config, "final_logit_softcapping", None) or type(head) is not nn.Linear:
            return None
        return head

    # -- forward ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        layers: Sequence[int] = (),
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        logits: bool = True,
    ) -> TargetOutput:
        """Run the target once.

        Args:
            input_ids: [B, T] token ids.
            attention_mask: [B, T] padding mask, or a 4D additive mask (tree attention).
            layers: output_hidden_states indices to return (0..N).
            position_ids: [B, T] explicit positions (tree verification).
            cache: a transformers ``Cache`` to read and extend.
            use_cache: return the (new) cache.
            logits: compute logits (skip for heads that only need hidden states).
        """
        if layers:
            self.check_layer_indices(layers)
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=use_cache, output_hidden_states=bool(layers))
        if cache is not None:
            kwargs["cache"] = cache
        if logits:
            out = self.model(**kwargs)
            hidden = out.hidden_states
            result_logits = out.logits
        else:
            out = self.model.get_decoder()(**kwargs)
            hidden = out.hidden_states
            result_logits = None
        # transformers 5 names the returned cache `cache`; older 5.x releases used `past_key_values`.
        new_cache = out["cache"] if "cache" in out else out.get("past_key_values")
        states = {int(i): hidden[int(i)] for i in layers} if layers else {}
        return TargetOutput(logits=result_logits, hidden_states=states, cache=new_cache if use_cache else None)

    __call__ = forward

    def __repr__(self) -> str:
        i = self.identity
        return (f"Target({i.name_or_path!r}, {i.architecture}, layers={i.num_hidden_layers}, "
                f"hidden={i.hidden_size}, vocab={i.vocab_size})")


def load_target(
    model: str | Path | PreTrainedModel,
    tokenizer: Any = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    flag: str | None = None,
    with_tokenizer: bool = True,
) -> Target:
    """Load and freeze a target from a local folder, a Hub id, a ``.gguf`` file or an in-memory model.

    The tokenizer is loaded from the same place when not given (a missing tokenizer is allowed for in-memory
    models only). A ``.gguf`` is converted once into a cached folder (:func:`specgraft.gguf.resolve_model_path`);
    the target keeps the GGUF path as its name and records the file's hash in its identity's ``source``.
    ``flag``: the command-line flag that named the model, quoted by a tokenizer that fails to load. This is the one
    model loader: targets, draft models and regeneration all load through it. ``with_tokenizer=False``: a model
    whose folder holds no tokenizer (a draft model checked by its vocabulary size alone) gets none.
    """
    if isinstance(model, PreTrainedModel):
        if device is not None:
            model = model.to(device)
        return Target(model, tokenizer)

    given = str(model)
    name = resolve_model_path(given)
    local = Path(name).expanduser()
    looks_local = local.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_local and not local.exists():
        raise SpecgraftError(f"model path {name} does not exist; pass a folder with config.json or a Hub id")
    if local.exists() and local.is_dir() and not (local / "config.json").exists():
        raise SpecgraftError(f"{name} has no config.json, so it is not a transformers model folder; "
                             "pass a folder made by save_pretrained (see scripts/convert_llama2c.py) or a Hub id")
    try:
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecgraftError(f"could not load the model config of {name} ({first}); check the path or Hub id, "
                             "and log in with `hf auth login` for gated models") from None
    require_causal_lm(config, name)
    kwargs: dict[str, Any] = dict(revision=revision, trust_remote_code=trust_remote_code,
                                  dtype=resolve_dtype(dtype))
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    loaded = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    if device is not None:
        loaded = loaded.to(device)
    if tokenizer is None and with_tokenizer:
        what, fix = ((f"{flag} {given}", f"check {flag} (a hand-edited tokenizer.json must stay valid)") if flag else
                     (name, "save the tokenizer beside the model with tokenizer.save_pretrained (a hand-edited "
                            "tokenizer.json must stay valid)"))
        tokenizer = load_tokenizer(name, what, fix, revision=revision, trust_remote_code=trust_remote_code)
    gguf_source = read_source(local) if local.is_dir() else None
    return Target(loaded, tokenizer, name_or_path=given, source=gguf_source.describe() if gguf_source else None)


def target_from_config(model_cfg: Any, device: str | torch.device | None = None) -> Target:
    """:func:`load_target` from a recipe's :class:`~specgraft.config.ModelConfig`."""
    return load_target(model_cfg.name_or_path, dtype=model_cfg.dtype, device=device, revision=model_cfg.revision,
                       trust_remote_code=model_cfg.trust_remote_code,
                       attn_implementation=model_cfg.attn_implementation)
