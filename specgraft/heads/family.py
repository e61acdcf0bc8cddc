"""The head-family contract: what one folder ``specgraft/heads/<name>/`` declares, with named, typed members.

A family's ``__init__.py`` builds one :class:`HeadFamily` and binds it to the module-level name ``FAMILY``; the
registry (:mod:`specgraft.heads.registry`) finds the built-in folders by scanning ``specgraft/heads`` and reads
that name. A family imports this module (never the registry), the head base class
(:mod:`specgraft.heads.head`), the decoding protocol, the tuning search helpers (:mod:`specgraft.tuning.search`)
and the export layout primitives (:mod:`specgraft.export.layouts`, :mod:`specgraft.export.engine`), so the
lookup layer above it is never part of a cycle.

Every family uses the same files (``docs/adding-a-head-family.md``): ``__init__.py`` (``FAMILY``), ``config.py``
(the recipe's ``head:`` section), ``model.py`` (the :class:`~specgraft.heads.head.DraftHead`), ``drafter.py``
(the decoder's drafter and the three setting functions), ``tune.py`` (its :class:`TuningSearch`) and ``export.py``
(engine layouts and :class:`CardText`). A family may reuse another's drafter or search by importing it (EAGLE-3
drafts and tunes as EAGLE does).

The standalone draft model (``specgraft distill``) is not a head family but is tuned the same way: its
:class:`TuningSearch` lives in :mod:`specgraft.distill.tune`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from specgraft.decoding.drafter import Drafter
    from specgraft.heads.head import DraftHead

#: A predicted setting as the tuner takes it: ``setting``, ``expected_accepted``, ``draft_s`` and the step fields
#: of :meth:`~specgraft.tuning.cost.CostProfile.step_prediction` (``step_s``, ``verified_tokens``, ``tree``).
Prediction = dict[str, Any]


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
    vllm_path_marker: tuple[str, str] | None = None
    """What vLLM looks for in a draft's path to pick this method when none is given, and the suffix that adds it
    (EAGLE-1: ``("eagle-", "-eagle-1")``); None: vLLM does not read this family from the path."""
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


class TuningSearch(ABC):
    """A drafter kind's `specgraft tune` search: its candidate settings and their predicted cost and acceptance.

    :mod:`specgraft.tuning.tune` ranks, confirms and records what a search predicts; the search itself knows its
    settings (a Medusa static tree, an EAGLE chain or dynamic tree, DFlash's per-slot trees, a draft model's
    chain). ``source`` is what drafts: a head, or a draft model. ``profile`` is a
    :class:`~specgraft.tuning.cost.CostProfile`, ``costs`` its section for this drafter (what
    :meth:`profile_drafter` measured), ``calibration`` the numbers of a calibration eval (``reach``,
    ``statistics``, ``drafter``, ... and ``prior``: :meth:`prior`)."""

    kind: str
    """The ``kind`` written in ``tuned.json`` and in the cost profile's drafter section (file formats: fixed)."""

    @abstractmethod
    def default_setting(self, source: Any) -> dict[str, Any]:
        """The setting an untuned ``specgraft eval`` drafts (what the tuned setting is compared against)."""

    def calibration_setting(self, source: Any) -> dict[str, Any]:
        """The setting of the calibration eval whose statistics predict every candidate (default: the default)."""
        return self.default_setting(source)

    def calibration_label(self, setting: Mapping[str, Any]) -> str:
        """How the log names the calibration run's setting."""
        return self.label(setting)

    @abstractmethod
    def drafter(self, source: Any, setting: Mapping[str, Any]) -> Drafter:
        """A drafter of ``source`` at ``setting``."""

    @abstractmethod
    def profile_drafter(self, source: Any, timed: Callable[[Any], float]) -> dict[str, Any]:
        """The cost profile's section for ``source`` (``kind`` included); ``timed(drafter)`` times one propose
        call in the profile's units."""

    @abstractmethod
    def candidates(self, profile: Any, costs: Mapping[str, Any], calibration: Mapping[str, Any]) -> list[Prediction]:
        """Every candidate setting with its prediction."""

    @abstractmethod
    def predict(self, setting: Mapping[str, Any], profile: Any, costs: Mapping[str, Any],
                calibration: Mapping[str, Any]) -> Prediction:
        """The prediction of one given setting (e.g. the default), by the same model as :meth:`candidates`."""

    @abstractmethod
    def label(self, setting: Mapping[str, Any]) -> str:
        """A setting in words, for tables and logs."""

    @abstractmethod
    def same_setting(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
        """Whether two settings draft alike."""

    def is_default_run(self, report: Mapping[str, Any], source: Any) -> bool:
        """Whether an eval report was drafted at :meth:`default_setting` (it then doubles as the default's
        confirming measurement)."""
        return False

    def prior(self, source: Any) -> list[list[float]] | None:
        """Per-(depth, rank) acceptance to assume where the calibration never tried a cell (Medusa: the head's
        stored top-k accuracies); None: no prior."""
        return None

    def expected_accepted(self, setting: Mapping[str, Any], probs: list[list[float]]) -> float | None:
        """Accepted drafts per step of ``setting`` under per-(depth, rank) acceptance ``p[d][r]``: the trainer's
        simulated tau (``training.eval_every``). None: this search cannot simulate it."""
        return None

    @property
    def simulates_acceptance(self) -> bool:
        """Whether :meth:`expected_accepted` is implemented (the trainer refuses ``eval_every`` otherwise)."""
        return type(self).expected_accepted is not TuningSearch.expected_accepted

    def setting_from_report(self, drafter: Mapping[str, Any], statistics: Mapping[str, Any] | None, depth: int,
                            mode: str) -> dict[str, Any]:
        """The setting an eval report's ``drafter`` section drafted, cut to ``depth`` (``specgraft simulate
        --cost-profile``). Default: a chain of ``depth`` slots, or ``top_k`` per slot."""
        return {"mode": mode, "depth": depth, **({"top_k": drafter.get("top_k")} if mode == "tree" else {})}

    def engine_settings(self, setting: Mapping[str, Any], default_tokens: int) -> dict[str, Any]:
        """What a tuned ``setting`` tells each serving engine (vLLM's ``num_speculative_tokens``, SGLang's
        ``speculative_*`` flags, TensorRT-LLM's ``max_draft_len``); default: a chain of ``k`` (or ``depth``)."""
        k = int(setting.get("k") or setting.get("depth") or default_tokens)
        return {"vllm": {"num_speculative_tokens": k}, "trtllm": {"max_draft_len": k}}


@dataclass
class FamilyTrainStep:
    """A family's own training step (Medusa-2's joint LoRA step), as its :attr:`HeadFamily.train_step` builds it."""

    step: Any
    """The ``nn.Module`` whose forward computes the :class:`~specgraft.heads.head.HeadLoss` of a batch."""
    adapter: Any
    """The peft-wrapped target whose adapter trains with the head (saved in the head folder's ``adapter/``)."""
    adapter_learning_rate: float
    """The adapter's learning rate (its own parameter group)."""


#: ``(head, target, recipe) -> FamilyTrainStep | None``: a family's own training step, or None (the recipe asks for
#: none) to train the head's own loss.
TrainStepFactory = Callable[[Any, Any, Any], "FamilyTrainStep | None"]


@dataclass(eq=False)
class HeadFamily:
    """One head family: everything the CLI, trainer, decoder, tuner, exporter and card read about it."""

    name: str
    """The head type written in ``head_config.json`` and chosen by a recipe's ``head.type``."""
    config: type
    """The family's typed config: the recipe's ``head:`` section and the saved ``head_config.json`` ``config``."""
    head: type[DraftHead]
    """The :class:`~specgraft.heads.head.DraftHead` subclass."""
    drafter: Callable[[DraftHead, Mapping[str, Any]], Drafter]
    """``(head, setting) -> Drafter``; ``setting`` as written by :attr:`setting_from_flags` or ``tuned.json``."""
    setting_from_flags: Callable[..., dict[str, Any]]
    """``(mode=, k=, tree_size=, top_k=) -> setting`` from ``specgraft eval``'s flags (None = default); raises
    SpecgraftError for a flag the family does not take."""
    describe_drafter: Callable[[Drafter], dict[str, Any]]
    """What ``report.json`` records of a built drafter (k, tree_size, top_k, ...)."""
    search: TuningSearch | None = None
    """The family's `specgraft tune` search (None: not tunable; eval uses its defaults / flags)."""
    exporters: Mapping[str, EngineExporter] = field(default_factory=dict)
    """Engine format -> exporter; ``native`` holds every family and is not listed."""
    apply_tuned: Callable[[dict[str, Any], str, Mapping[str, Any]], None] | None = None
    """``(engine config, fmt, tuned engine settings)``: write a tuned setting into an exported engine config
    (TensorRT-LLM Medusa's ``medusa_choices``); None: the engines take it from the command line."""
    card: CardText | None = None
    """What the model card says about the family (None: a generic card)."""
    train_step: TrainStepFactory | None = None
    """A family-specific training step (Medusa-2's joint LoRA step when its ``lora`` is enabled); None, or a
    factory returning None, trains the head's own :meth:`~specgraft.heads.head.DraftHead.training_loss`."""
    train_metrics: Callable[..., dict[str, Any]] | None = None
    """``(head, target, batches, max_batches, measured_on) -> facts``: measured once after training and stored in
    the head (Medusa: per-head top-k accuracy, its static tree's source)."""
    description: str = ""
    """One line for ``--help`` texts and errors."""
    listing_order: int = 100
    """Where the family is listed among the others (help texts, errors): lower first, then by name."""
    default: bool = False
    """The family of a recipe whose ``head:`` section names no ``type`` (exactly one family sets it)."""

    @property
    def formats(self) -> tuple[str, ...]:
        """The export formats that hold this family, in the CLI's order, native last."""
        return (*self.exporters, "native")

    @property
    def tuning(self) -> str | None:
        """The ``tuned.json`` kind of the family's search (None: not tunable)."""
        return self.search.kind if self.search is not None else None
