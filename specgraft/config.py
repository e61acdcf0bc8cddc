"""Typed recipes: YAML files mapped onto config dataclasses.

A recipe has sections ``model``, ``data``, ``head``, ``distill``, ``training``, ``output`` and ``tracking`` (a head
family's own settings, e.g. Medusa-2's ``lora``, live in its ``head:`` section). Loading validates strictly and
reports problems in one line with the dotted path of the field:

* an unknown key fails and suggests the nearest valid key,
* a wrong type fails naming the expected type,
* a missing required field fails naming it,
* command-line overrides ``key.sub=value`` (values parsed as YAML) are applied before validation,
* a number must be finite (NaN passes every range check, since each comparison with NaN is false),
* YAML aliases (``*name``) and duplicate keys are refused: an alias lets a few hundred bytes expand to gigabytes,
  and with a duplicate key the last one silently wins.

The fully resolved recipe is written beside every output with :func:`save_recipe`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specgraft.errors import ConfigError
from specgraft.heads.registry import default_family, family_names, get_family
from specgraft.utils.checks import MAX_LAYER_INDEX, check_choice, check_positive, check_range  # noqa: F401 (re-exported)
from specgraft.utils.io import require_file
from specgraft.utils.recipe_io import save_recipe, to_dict  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    """The frozen target model."""

    name_or_path: str
    """A Hub id or a local folder with a transformers causal LM."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 | float16 | auto. Use float32 on CPU."""
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    """transformers attention backend (sdpa, eager, flash_attention_2); None lets transformers choose."""

    def validate(self, path: str) -> None:
        check_choice(f"{path}.dtype", self.dtype, ("float32", "bfloat16", "float16", "auto"))


@dataclass
class DataConfig:
    """Training data: conversations (assistant tokens are the loss) or plain text (all tokens)."""

    path: str
    """A .json/.jsonl/.txt file, a folder saved by ``datasets.save_to_disk``, or a folder of such files."""
    format: str = "auto"
    """auto | sharegpt | messages | text | disk."""
    split: str = "train"
    """Split to take from a DatasetDict saved with save_to_disk."""
    max_length: int = 2048
    """Tokens per training sequence (longer ones are truncated, or chunked when packing)."""
    packing: bool = False
    """Concatenate documents/conversations and cut them into max_length sequences."""
    num_samples: int | None = None
    """Keep at most this many records (after a seeded shuffle)."""
    eval_fraction: float = 0.0
    """Held-out fraction of records used for evaluation."""
    use_chat_template: bool = True
    """Apply the tokenizer's chat template when it has one (plain concatenation otherwise)."""
    system_prompt: str | None = None
    cache_dir: str | None = None
    """Where tokenized datasets are cached (default: ~/.cache/specgraft/datasets)."""
    num_proc: int = 1
    seed: int = 0
    regenerate: bool = False
    """Train on the target's own rewrites of the assistant turns (self-distillation; matters for chat targets). For
    plain text, each paragraph becomes its first sentence followed by the target's continuation of it."""
    regenerate_max_new_tokens: int = 512
    regenerate_temperature: float = 0.0
    replay_path: str | None = None
    """Rows of another data set mixed into the training rows, read with this section's settings (its own eval split
    is not taken): when adapting a warm-started head (head.init_from) to new data, the head's original data, so its
    original domains do not collapse."""
    replay_share: float = 0.1
    """With replay_path: the share of the training rows drawn from it (seeded; rows repeat when it has too few)."""

    def validate(self, path: str) -> None:
        check_choice(f"{path}.format", self.format, ("auto", "sharegpt", "messages", "text", "disk"))
        check_positive(f"{path}.max_length", self.max_length)
        check_positive(f"{path}.num_proc", self.num_proc)
        if self.num_samples is not None:
            check_positive(f"{path}.num_samples", self.num_samples)
        check_range(f"{path}.eval_fraction", self.eval_fraction, 0.0, 1.0, high_open=True)
        check_positive(f"{path}.regenerate_max_new_tokens", self.regenerate_max_new_tokens)
        check_range(f"{path}.regenerate_temperature", self.regenerate_temperature, 0.0, None)
        check_range(f"{path}.seed", self.seed, 0, None)
        check_range(f"{path}.replay_share", self.replay_share, 0.0, 1.0, high_open=True)


@dataclass
class DistillConfig:
    """A standalone draft model distilled on the target's outputs."""

    student: str | None = None
    """A causal LM with the target's tokenizer (local folder or Hub id); None builds one from the target."""
    keep_every_k_layers: int = 4
    """When building from the target: keep every k-th layer."""
    student_hidden_size: int | None = None
    """When building from the target: a narrower hidden size (random init); None keeps the target's weights."""
    loss: str = "fkl"
    """fkl | rkl | jsd | tvd | ce."""
    beta: float = 0.5
    """Generalised JSD interpolation (0 = FKL, 1 = RKL)."""
    temperature: float = 1.0
    lmbda: float = 0.0
    """Fraction of batches made of on-policy student samples scored by the target (GKD)."""
    seq_kd: bool = False
    """Train on target-generated continuations (sequence-level KD)."""
    onpolicy_max_new_tokens: int = 64
    alpha_eval_every: int = 100
    """Evaluate the held-out acceptance proxy alpha_exact every N steps; the best checkpoint is kept."""
    alpha_eval_train_rows: int = 32
    """Rows of the training data alpha_exact is measured on when the data has no eval split."""
    alpha_eval_max_rows: int = 512
    """At most this many eval rows are scored at each alpha_exact evaluation (the first ones)."""

    def validate(self, path: str) -> None:
        check_choice(f"{path}.loss", self.loss, ("fkl", "rkl", "jsd", "tvd", "ce"))
        check_range(f"{path}.beta", self.beta, 0.0, 1.0)
        check_range(f"{path}.lmbda", self.lmbda, 0.0, 1.0)
        check_range(f"{path}.temperature", self.temperature, 0.0, None, low_open=True)
        check_positive(f"{path}.keep_every_k_layers", self.keep_every_k_layers)
        check_positive(f"{path}.alpha_eval_every", self.alpha_eval_every)
        check_positive(f"{path}.alpha_eval_train_rows", self.alpha_eval_train_rows)
        check_positive(f"{path}.alpha_eval_max_rows", self.alpha_eval_max_rows)
        check_positive(f"{path}.onpolicy_max_new_tokens", self.onpolicy_max_new_tokens)
        if self.student_hidden_size is not None:
            check_positive(f"{path}.student_hidden_size", self.student_hidden_size)


@dataclass
class TrainingConfig:
    """Optimisation, checkpoints and features (shared by head training and distillation)."""

    seed: int = 42
    max_steps: int = 1000
    """Optimizer steps."""
    micro_batch_size: int = 4
    """Sequences per process per forward."""
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    lr_scheduler: str = "cosine"
    """cosine | linear | constant (all with linear warm-up)."""
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    mixed_precision: str = "no"
    """no | bf16 | fp16 (through accelerate)."""
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_every: int = 0
    """Every N optimizer steps and at the last, measure the head's acceptance on the held-out split (data.eval_fraction
    > 0): the simulated tau of its served drafting setting (``eval_setting``) from teacher-forced per-(depth, rank)
    acceptance, and a real decoder run when ``eval_prompts`` > 0. Logged to the tracker (``eval/...``), the progress
    bar and ``metrics.jsonl`` in output.dir; the head with the best tau so far is kept in ``best/``. Head training
    only; 0 disables."""
    eval_batches: int = 8
    """Held-out micro-batches read by each simulated-tau measurement (the first ones)."""
    eval_prompts: int = 0
    """Held-out prompts (rows cut before their first assistant token) decoded at each measurement by the lossless
    speculative decoder and by plain decoding: the decoder's tau and a token-identity check. 0: simulated tau
    only."""
    eval_max_new_tokens: int = 32
    """Tokens generated per prompt by the decoder run of ``eval_prompts``."""
    eval_setting: dict[str, Any] | None = None
    """The drafting setting measured (the keys of a tuned.json setting, e.g. ``{mode: chain, depth: 4}`` or ``{mode:
    tree, top_k: 4, depth: 4, total_tokens: 16}``); None: the family's default (what ``specgraft eval --head``
    drafts untuned)."""
    eval_best_by: str = "sim_tau"
    """Which measurement picks ``best/``: sim_tau | decoder_tau (needs ``eval_prompts`` > 0)."""
    features: str = "online"
    """online (target forward each step) | offline (precomputed feature cache)."""
    feature_cache_dir: str | None = None
    feature_dtype: str = "bfloat16"
    """Storage of an offline feature cache: bfloat16 | float16 (float32: exact, for tests and debugging), or
    compressed: int8 | int4 (per-channel affine, L*h or L*h/2 B/token) | vq (one feature_vq_bits-bit code per channel
    per token for all the stored layers together: h*bits/8 B/token). Part of the cache's key."""
    feature_vq_bits: int = 7
    """Bits per channel code of feature_dtype=vq (1-8; 7 keeps the cache under half of EAGLE-1's fp16 bytes/token
    with the codebook counted)."""
    train_metrics_batches: int = 16
    """Micro-batches of held-out data (training rows when there is no eval split) that the family's post-training
    measurement reads (Medusa: each head's top-k accuracy, from which its static tree is built)."""
    compile: bool = False
    """Head training only: ``torch.compile`` the head's draft layers (EAGLE-1/2 decoder layers, EAGLE-3's midlayer
    and extra layers; none for Medusa, whose cost is its matmuls, nor yet for DFlash), fusing their element-wise
    work (norms, rotary, gated MLP) forward and backward. The first steps compile (tens of seconds on a CPU, which
    needs a C++ compiler), a second sequence length compiles once more for all lengths; results equal the eager ones
    to float rounding. The gain is largest where the draft layers' element-wise work dominates (small hidden sizes);
    where vocabulary matmuls dominate, it is small."""

    def validate(self, path: str) -> None:
        # torch's manual_seed takes seeds in [0, 2**64); numpy's (datasets' shuffles) in [0, 2**32).
        check_range(f"{path}.seed", self.seed, 0, MAX_SEED)
        check_range(f"{path}.adam_eps", self.adam_eps, 0.0, None, low_open=True)
        check_positive(f"{path}.max_steps", self.max_steps)
        check_positive(f"{path}.micro_batch_size", self.micro_batch_size)
        check_positive(f"{path}.gradient_accumulation_steps", self.gradient_accumulation_steps)
        check_range(f"{path}.learning_rate", self.learning_rate, 0.0, None, low_open=True)
        check_range(f"{path}.weight_decay", self.weight_decay, 0.0, None)
        check_range(f"{path}.warmup_steps", self.warmup_steps, 0, None)
        check_range(f"{path}.max_grad_norm", self.max_grad_norm, 0.0, None)
        check_positive(f"{path}.checkpoint_every", self.checkpoint_every)
        check_positive(f"{path}.keep_checkpoints", self.keep_checkpoints)
        check_positive(f"{path}.log_every", self.log_every)
        check_range(f"{path}.eval_every", self.eval_every, 0, None)
        check_positive(f"{path}.eval_batches", self.eval_batches)
        check_range(f"{path}.eval_prompts", self.eval_prompts, 0, None)
        check_positive(f"{path}.eval_max_new_tokens", self.eval_max_new_tokens)
        check_choice(f"{path}.eval_best_by", self.eval_best_by, ("sim_tau", "decoder_tau"))
        if self.eval_best_by == "decoder_tau" and self.eval_prompts == 0:
            raise ConfigError(f"{path}.eval_best_by is decoder_tau but {path}.eval_prompts is 0; set "
                              f"{path}.eval_prompts to the number of held-out prompts to decode, or eval_best_by="
                              "sim_tau")
        check_positive(f"{path}.train_metrics_batches", self.train_metrics_batches)
        if len(self.adam_betas) != 2 or not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in self.adam_betas):
            raise ConfigError(f"{path}.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        check_choice(f"{path}.lr_scheduler", self.lr_scheduler, ("cosine", "linear", "constant"))
        check_choice(f"{path}.mixed_precision", self.mixed_precision, ("no", "bf16", "fp16"))
        check_choice(f"{path}.features", self.features, ("online", "offline"))
        check_choice(f"{path}.feature_dtype", self.feature_dtype,
                     ("bfloat16", "float16", "float32", "int8", "int4", "vq"))
        check_range(f"{path}.feature_vq_bits", self.feature_vq_bits, 1, 8)


@dataclass
class OutputConfig:
    """Where checkpoints, the final head and the resolved recipe go."""

    dir: str
    overwrite: bool = False
    """Allow writing into a non-empty output folder that is not a resumable run of this recipe."""


@dataclass
class TrackingConfig:
    """Experiment tracking through accelerate's trackers (offline-safe)."""

    backend: str = "tensorboard"
    """tensorboard | wandb | none."""
    project: str = "specgraft"
    run_name: str | None = None

    def validate(self, path: str) -> None:
        check_choice(f"{path}.backend", self.backend, ("tensorboard", "wandb", "none"))
        # The trackers write under output.dir/<project>[/<run_name>]: a path there would write elsewhere.
        for name in ("project", "run_name"):
            value = getattr(self, name)
            if value is not None and not _PLAIN_NAME.fullmatch(value):
                raise ConfigError(f"{path}.{name} must be a plain name (letters, digits, '.', '_', '-'; no '/' or "
                                  f"'..'), got {value!r}; the tracker writes it as a folder inside output.dir")


@dataclass
class Recipe:
    """A head-training job (``specgraft train``): a draft head grafted onto the frozen target."""

    model: ModelConfig
    data: DataConfig
    output: OutputConfig
    head: Any = field(default_factory=lambda: _default_head(), metadata={"convert": lambda v, p: head_section(v, p)})
    """The draft head: ``type`` (a registered family: medusa | eagle | eagle3 | dflash) and that family's own typed
    fields (its ``config.py``)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    description: str = ""
    """Free text shown in model cards and reports."""


@dataclass
class DistillRecipe:
    """A distillation job (``specgraft distill``): a standalone draft model trained on the target's outputs."""

    model: ModelConfig
    data: DataConfig
    output: OutputConfig
    distill: DistillConfig = field(default_factory=DistillConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    description: str = ""
    """Free text shown in model cards and reports."""


def recipe_schema(raw: Mapping[str, Any], path: Any = "recipe") -> type:
    """Which job a recipe describes: a ``distill:`` section makes it a distillation recipe, else head training;
    both kinds of sections at once are refused."""
    if "distill" in raw:
        heads = [k for k in ("head", "lora") if k in raw]
        if heads:
            raise ConfigError(f"{path} has a distill: section and {', '.join(k + ':' for k in heads)}; a recipe is "
                              "either head training (head:, lora:; `specgraft train`) or distillation (distill:; "
                              "`specgraft distill`): split it in two")
        return DistillRecipe
    return Recipe


def _default_head() -> Any:
    return default_family().config()


def head_section(value: Any, path: str) -> Any:
    """A recipe's ``head:`` section -> the typed config of the family its ``type`` names (default: the registry's
    :func:`~specgraft.heads.registry.default_family`, Medusa)."""
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path} must be a mapping, got {_tname(value)}")
    head_type = value.get("type", default_family().name)
    if not isinstance(head_type, str):
        raise ConfigError(f"{path}.type must be a string, got {_tname(head_type)} {head_type!r}")
    check_choice(f"{path}.type", head_type, family_names())
    return from_dict(get_family(head_type).config, {k: v for k, v in value.items() if k != "type"}, path)


# ----------------------------------------------------------------------------------------------------------------
# Loading

#: Largest seed: numpy (datasets' shuffles) takes seeds below 2**32.
MAX_SEED = 2**32 - 1
#: A tracker project / run name: one folder name, no path.
_PLAIN_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.-][A-Za-z0-9_. -]*")


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases (a 300-byte alias bomb expands to gigabytes) and duplicate keys
    (the last one would silently win)."""

    def compose_node(self, parent, index):  # noqa: ANN001, ANN201 (PyYAML's signature)
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, f"alias *{event.anchor} is not allowed in recipes; write the value out",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001, ANN201
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"duplicate key {key!r}; keep one (the last would silently win)", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def safe_load_yaml(text: str) -> Any:
    """Parse YAML with :class:`_StrictLoader` (no aliases, no duplicate keys, plain data only)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (_StrictLoader is a SafeLoader)


def load_recipe(path: str | Path, overrides: Sequence[str] = (), schema: type | None = None) -> Any:
    """Read a YAML recipe, apply ``key.sub=value`` overrides and return the validated ``schema`` instance
    (default: :class:`Recipe` or :class:`DistillRecipe`, by the recipe's sections; a given schema that does not
    match them is refused naming the command to run)."""
    path = Path(path)
    require_file(path, "recipe file", "pass the path of a YAML recipe (see recipes/)", ConfigError)
    try:
        raw = safe_load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(f"recipe {path} is not valid YAML{where} ({problem}); fix the YAML syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(f"recipe {path} is not UTF-8 text; pass a YAML recipe file") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path} must be a YAML mapping of sections (model:, data:, ...), got {_tname(raw)}")
    raw = apply_overrides(raw, overrides)
    kind = recipe_schema(raw, path)
    if schema is not None and kind is not schema and {kind, schema} == {Recipe, DistillRecipe}:
        command = "specgraft distill" if kind is DistillRecipe else "specgraft train"
        raise ConfigError(f"recipe {path} is a {'distillation' if kind is DistillRecipe else 'head-training'} "
                          f"recipe; run it with `{command}`")
    return from_dict(schema or kind, raw)


def move_family_sections(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """An older recipe's recipe-level section that now lives in its head family's section (Medusa-2's ``lora:``,
    which the family's config lists in ``legacy_recipe_sections``) moved into ``head:``, with a deprecation warning;
    refused when the recipe has it in both places or when its family has no such section."""
    fields = {f.name for f in dataclasses.fields(Recipe)}
    stray = [key for key in raw if key not in fields]
    if not stray:
        return raw
    head = raw.get("head") if isinstance(raw.get("head"), Mapping) else {}
    head_type = head.get("type", default_family().name)
    if head_type not in family_names():
        return raw  # the head section's own check names the unknown type
    owned = getattr(get_family(head_type).config, "legacy_recipe_sections", ())
    others = {key: name for name in family_names()
              for key in getattr(get_family(name).config, "legacy_recipe_sections", ())}
    moved = dict(raw)
    head = dict(head)
    for key in stray:
        if key not in owned:
            if key in others:
                raise ConfigError(f"{where}: the {key}: section belongs to {others[key]} heads (head.{key}), but "
                                  f"head.type is {head_type}; remove it or set head.type={others[key]}")
            continue  # from_dict names the unknown key and the valid ones
        if key in head:
            raise ConfigError(f"{where} has both {key}: and head.{key}:; keep only head.{key}")
        logger.warning("%s: the recipe-level %s: section is deprecated; move it into the head: section "
                       "(head.%s)", where, key, key)
        head[key] = moved.pop(key)
    moved["head"] = head
    return moved


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``a.b.c=value`` override set (value parsed as YAML)."""
    result = _deep_copy(raw)
    for item in overrides:
        key, sep, value_text = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value; e.g. training.max_steps=100")
        try:
            value = safe_load_yaml(value_text) if value_text.strip() else None
        except yaml.YAMLError:
            value = value_text
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section; use key.sub=value")
            node = child
        node[parts[-1]] = value
    return result


def from_dict(schema: type, raw: Mapping[str, Any], path: str = "") -> Any:
    """Build dataclass ``schema`` from ``raw`` with strict validation (see module docstring)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or 'recipe'} must be a mapping, got {_tname(raw)}")
    if schema is Recipe:
        raw = move_family_sections(dict(raw), path or "recipe")
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in raw:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {(path + '.' if path else '') + close[0]}?" if close else ""
            valid = ", ".join(fields)
            raise ConfigError(f"unknown recipe key {where}{hint} (valid keys here: {valid})")
    values = {}
    for name, f in fields.items():
        dotted = f"{path}.{name}" if path else name
        if name in raw:
            convert = f.metadata.get("convert")
            values[name] = convert(raw[name], dotted) if convert else _convert(hints[name], raw[name], dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required recipe field {dotted}; add it to the recipe or pass {dotted}=...")
    obj = schema(**values)
    # A head family's config checks its recipe fields with check_recipe (its validate() checks a complete one).
    check = getattr(obj, "check_recipe", None) or getattr(obj, "validate", None)
    if check is not None:
        check(path or schema.__name__.lower())
    return obj


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for option in non_none:
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        return from_dict(tp, value, path)
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {_tname(value)} {value!r}")
        item_type = args[0] if args else Any
        return [_convert(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {_tname(value)}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be true or false, got {_tname(value)} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            raise ConfigError(f"{path} must be an integer, got {value!r}; write {int(value)}")
        raise ConfigError(f"{path} must be an integer, got {_tname(value)} {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:  # YAML 1.1 reads "1e-3" as a string
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{path} must be a number, got {_tname(value)} {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{path} must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path} must be a string, got {_tname(value)} {value!r}")
    return value


def _tname(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw
