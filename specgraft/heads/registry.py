"""The head-family registry: the one place the CLI, trainer, eval, tune, card, convert and export consult.

A family is one folder (``specgraft/heads/<name>/``) holding its config, module, training loss, drafter and export
layouts, and one :func:`register_head` call in that folder's ``__init__.py``::

    register_head("medusa", config=MedusaConfig, head=MedusaHead, drafter=medusa_drafter,
                  exporters={"vllm": ..., "trtllm": ...}, tuning="medusa", hooks=tune.HOOKS, ...)

Built-in families are imported on the first lookup (nothing happens at import of this module); a third-party
family registers itself when its module is imported (e.g. from a test or a plug-in package). Names are unique:
registering a taken name is refused, so a plug-in cannot silently replace a built-in.

The families depend on ``specgraft.eval``'s public drafter protocol (drafter, tree, verify, kv, acceptance); that
machinery never imports a family, and this registry imports none at module level, so there is no import cycle.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from specgraft.errors import SpecgraftError

if TYPE_CHECKING:  # annotations only
    from specgraft.decoding.drafter import Drafter
    from specgraft.heads.base import DraftHead

#: The tuned.json ``kind`` of a family's `specgraft tune` search, which the family registers as ``tune_*`` hooks in
#: its own ``tune.py`` (Medusa: "medusa", static trees; EAGLE-1/2 and EAGLE-3 share "eagle", chains and dynamic
#: trees; DFlash: "dflash", chains and per-slot trees). None: the family is not tunable (eval uses its defaults /
#: flags).
Tuning = Literal["medusa", "eagle"] | str | None

#: Built-in families, imported on the first lookup.
BUILTIN_FAMILIES: tuple[str, ...] = ("medusa", "eagle", "eagle3", "dflash")


@dataclass(frozen=True)
class EngineExporter:
    """How one serving engine's layout holds a family's heads (see :mod:`specgraft.export.convert`)."""

    weights_file: str
    """File name of the weights in the exported folder (``model.safetensors``, ``medusa_lm_head.safetensors``)."""
    layout: tuple[Any, ...] | None
    """The engine's exact tensors: :class:`specgraft.export.layouts.TensorRule` entries (None: ``to_engine``
    states them in ``EngineCheckpoint.expected``, derived from the engine config)."""
    to_engine: Callable[..., Any]
    """``(fmt, state, head_cfg, info, base_model, speculative_tokens) -> EngineCheckpoint``."""
    from_engine: Callable[..., dict[str, Any]]
    """``(fmt, tensors, config, head_cfg, want, used, target_lm_head) -> head state dict`` (the round trip)."""
    checked_config_keys: tuple[str, ...] = ("hidden_size", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                                            "num_attention_heads", "rope_theta")
    """Keys of the exported ``config.json`` (or its ``transformer_layer_config``) that must equal the target's
    when the export is loaded back (a draft of Llama layers carries them all; Medusa's only the sizes)."""
    speculators_model_type: str | None = None
    """The ``speculators_model_type`` this layout's config carries (speculators-format exports): an export whose
    config names another is refused when read back as this family."""
    architectures: tuple[str, ...] = ()
    """The ``architectures`` this layout's config names when they are the family's own (SGLang's
    ``DFlashDraftModel``): another family's reader of the same format refuses an export that names them."""
    container: str = "safetensors"
    """``safetensors`` (weights file + ``config.json``) or ``gguf`` (llama.cpp: one GGUF file holding the tensors,
    the config as GGUF metadata and the target's tokenizer; see :mod:`specgraft.export.llamacpp`)."""


@dataclass(frozen=True)
class CardText:
    """What a model card says about a family (the rest of the card is generic)."""

    title: str
    """Human name in the card's title ("Medusa", "EAGLE-3")."""
    describe: Callable[[Mapping[str, Any], str], str]
    """``(head config, size phrase) -> one paragraph`` on what the head is."""
    vllm_method: str | None = None
    """vLLM's ``--speculative-config`` method (None: vLLM does not serve it)."""
    sglang_algorithm: str | None = None
    """SGLang's ``--speculative-algorithm`` (None: SGLang does not serve it)."""
    sglang_args: Callable[[Mapping[str, Any], Mapping[str, Any]], str] | None = None
    """``(head config, tuned sglang settings) -> the launch flags after the draft path`` (None: EAGLE's
    ``--speculative-num-steps/--speculative-eagle-topk/--speculative-num-draft-tokens``)."""
    vllm_tokens_are_heads: bool = False
    """vLLM maps num_speculative_tokens onto the number of heads (Medusa): the card writes num_heads."""
    config_is_self_contained: bool = False
    """The vLLM export carries a ``speculators_config``, so ``vllm serve DIR`` alone works."""
    trtllm_lines: Callable[..., list[str]] | None = None
    """``(head config, base, where, tuned engine settings, max_draft_len) -> markdown lines`` for TensorRT-LLM
    (None: TensorRT-LLM does not serve it)."""
    llamacpp_spec_type: str | None = None
    """llama.cpp's ``--spec-type`` for the family's GGUF draft (None: llama.cpp does not serve it)."""


@dataclass(frozen=True)
class HeadFamily:
    """One registered head family."""

    name: str
    """The head type written in ``head_config.json`` and chosen by a recipe's ``head.type``."""
    config: type
    """The family's typed config: the recipe's ``head:`` section and the saved ``head_config.json`` ``config``."""
    head: type[DraftHead]
    """The :class:`~specgraft.heads.base.DraftHead` subclass."""
    drafter: Callable[[DraftHead, Mapping[str, Any]], Drafter]
    """``(head, setting) -> Drafter``; ``setting`` as written by :attr:`setting_from_flags` or ``tuned.json``."""
    setting_from_flags: Callable[..., dict[str, Any]]
    """``(mode=, k=, tree_size=, top_k=) -> setting`` from ``specgraft eval``'s flags (None = default); raises
    SpecgraftError for a flag the family does not take."""
    describe_drafter: Callable[[Drafter], dict[str, Any]]
    """What ``report.json`` records of a built drafter (k, tree_size, top_k, ...)."""
    exporters: Mapping[str, EngineExporter] = field(default_factory=dict)
    """Engine format -> exporter; ``native`` holds every family and is not listed."""
    card: CardText | None = None
    tuning: Tuning = None
    description: str = ""
    """One line for ``--help`` texts and errors."""
    hooks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """Optional family hooks, by name: ``train_step(trainer, recipe) -> TrainStep | None`` (a family-specific
    training step, e.g. Medusa-2's), ``train_metrics(head, batches) -> dict`` (measured once after training, e.g.
    Medusa's per-head top-k accuracy, stored in head_config.json), ``tuning_prior(head) -> list | None``,
    ``default_setting(head) -> dict`` (the untuned setting ``tune`` compares against), ``apply_tuned(config,
    fmt, engines)`` (a tuned setting into an engine config), ``profile_drafter(head, timed) -> dict`` (the
    family's cost-profile section; ``timed(drafter)`` times one propose call).

    A tunable family (``tuning`` set) also registers ``profile_drafter`` and ``tune_candidates(profile,
    costs, calibration) -> [prediction]`` and ``tune_predict(setting, profile, costs, calibration) ->
    prediction`` (a prediction: a dict of ``setting``, ``expected_accepted``, ``draft_s``, ``step_s``),
    ``default_setting``, ``setting_label(setting) -> str``, ``same_setting(a, b) -> bool`` and optionally
    ``calibration_setting(head) -> dict`` (the calibration eval's setting, default: the default setting) and
    ``is_default_run(report, head) -> bool`` (see :mod:`specgraft.tuning.tune`). With ``expected_accepted(setting,
    probs) -> float`` (accepted drafts per step of a setting under per-(depth, rank) acceptance ``p[d][r]``) and
    :meth:`~specgraft.heads.base.DraftHead.acceptance_ranks`, the trainer measures a simulated tau on held-out
    rows during training (``training.eval_every``)."""

    @property
    def formats(self) -> tuple[str, ...]:
        """The export formats that hold this family, in the CLI's order, native last."""
        return (*self.exporters, "native")


_FAMILIES: dict[str, HeadFamily] = {}
_builtins_loaded = False


def register_head(name: str, *, config: type, head: type, drafter: Callable[..., Any],
                  setting_from_flags: Callable[..., dict[str, Any]], describe_drafter: Callable[[Any], dict[str, Any]],
                  exporters: Mapping[str, EngineExporter] | None = None, card: CardText | None = None,
                  tuning: Tuning = None, description: str = "",
                  hooks: Mapping[str, Callable[..., Any]] | None = None) -> HeadFamily:
    """Register a head family under ``name`` (refused when the name is taken, built-ins included); returns its
    entry."""
    _load_builtins()  # a plug-in must not take a built-in's name (a no-op while the built-ins register)
    if not name or not name.replace("_", "").isalnum() or not name.islower():
        raise ValueError(f"head family name {name!r} must be lower-case letters, digits and '_'")
    if name in _FAMILIES:
        raise SpecgraftError(f"a head family named {name!r} is already registered "
                             f"({_FAMILIES[name].head.__module__}); choose another name")
    if getattr(head, "head_type", None) != name:
        raise ValueError(f"{head.__name__}.head_type is {getattr(head, 'head_type', None)!r}, not {name!r}")
    if "native" in (exporters or {}):
        raise ValueError("the native format holds every family; do not register an exporter for it")
    family = HeadFamily(name=name, config=config, head=head, drafter=drafter, setting_from_flags=setting_from_flags,
                        describe_drafter=describe_drafter, exporters=dict(exporters or {}), card=card, tuning=tuning,
                        description=description, hooks=dict(hooks or {}))
    _FAMILIES[name] = family
    return family


def unregister_head(name: str) -> None:
    """Remove a family (for tests that register a toy family)."""
    _FAMILIES.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for name in BUILTIN_FAMILIES:
        module = f"specgraft.heads.{name}"
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def get_family(name: str) -> HeadFamily:
    """The registered family ``name`` (built-ins are imported on first use)."""
    _load_builtins()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise SpecgraftError(f"unknown head type {name!r}; known types: {', '.join(family_names()) or 'none'}") \
            from None


def family_names() -> tuple[str, ...]:
    """Every registered family, built-ins first in their fixed order."""
    _load_builtins()
    builtin = [n for n in BUILTIN_FAMILIES if n in _FAMILIES]
    return (*builtin, *sorted(n for n in _FAMILIES if n not in BUILTIN_FAMILIES))


def family_of(head: Any) -> HeadFamily:
    """The family of a built head."""
    return get_family(head.head_type)
