"""DFlash heads in the speculators / vLLM layout and SGLang's: config keys, tensor names, writing and reading back.

Facts this layout follows (checked against their source, not copied):

* speculators (vllm-project/speculators @c05b95b): ``src/speculators/models/dflash/config.py``
  (``DFlashSpeculatorConfig``: ``speculators_model_type`` "dflash", ``architectures`` ["DFlashSpeculator"],
  ``transformer_layer_config`` (``num_hidden_layers`` = draft layers), ``draft_vocab_size``, ``block_size``,
  ``target_hidden_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``sliding_window_non_causal``,
  ``sample_from_anchor``, ``speculators_config``), ``core.py`` (``DFlashDraftModel``: ``fc``, ``hidden_norm``,
  ``norm``, ``layers``, ``lm_head``, ``d2t``/``t2d`` only when the draft vocabulary is smaller; ``embed_tokens``,
  ``verifier_norm``, ``verifier_lm_head`` come from the verifier) and ``model_definitions.py``
  (``Qwen3DFlashDecoderLayer``: ``self_attn.{q,k,v,o}_proj`` (biases with ``attention_bias``),
  ``self_attn.{q,k}_norm``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``).
* vLLM ``vllm/model_executor/models/qwen3_dflash.py`` (``DFlashQwen3ForCausalLM.load_weights``: ``d2t`` is loaded,
  ``t2d`` skipped, ``lm_head``/``embed_tokens`` optional: a draft without them shares the target's) and
  ``vllm/transformers_utils/configs/speculators/algos.py`` (``update_dflash``: ``aux_hidden_state_layer_ids`` and
  ``mask_token_id`` are required; the ids are output_hidden_states indices, vLLM captures ``i - 1``).

* speculators 0.9.0 (PyPI) ``DFlashDraftModel`` ignores ``embed_tokens.weight`` on save and, for a full-vocabulary
  draft, ``lm_head.weight`` too, reloading both from the verifier (``load_verifier_weights``);
  ``tests/heads/dflash/test_dflash_speculators_client.py`` loads our export with it and gets our block logits.

SGLang (``--speculative-algorithm DFLASH``; sgl-project/sglang, checked, not copied):

* ``python/sglang/srt/models/dflash.py`` @003b23d7 (``DFlashDraftModel``, the ``EntryClass`` that SGLang's model
  registry finds by ``architectures`` ["DFlashDraftModel"]): parameters ``fc`` (``len(target_layer_ids) *
  hidden_size -> hidden_size``, no bias), ``hidden_norm``, ``norm`` and ``layers.{i}`` with Qwen3's q/k norms;
  ``load_weights`` takes the checkpoint names ``self_attn.{q,k,v}_proj`` / ``mlp.{gate,up}_proj`` (stacked into
  its ``qkv_proj`` / ``gate_up_proj``), biases only with ``attention_bias``, and skips every other name silently
  (so an ``lm_head``, ``d2t`` or ``embed_tokens`` would be ignored, not used): the draft has no embeddings and no
  lm_head of its own. ``DFlashMLP`` refuses any ``hidden_act`` but silu; ``layer_types`` "full_attention" is the
  non-causal (ENCODER_ONLY) attention.
* ``python/sglang/srt/speculative/dflash_utils.py`` @00731f0b (``parse_dflash_draft_config``): ``dflash_config``
  ``target_layer_ids`` / ``mask_token_id`` / ``block_size`` / ``num_target_layers``, each falling back to the
  top-level key; the ids must satisfy ``0 <= id < num_target_layers`` and are decoder-layer numbers (the hidden
  state AFTER layer ``id``): ``Qwen3ForCausalLM.set_dflash_layers_to_capture`` captures before layer ``id + 1``,
  i.e. our output_hidden_states index ``id + 1``.
* ``python/sglang/srt/speculative/dflash_worker.py`` (recent versions; @7f151c5e still resolved the mask only
  through the tokenizer): the block is ``[verified token, mask x (block - 1)]`` embedded
  with the TARGET's input embeddings, drafted greedily through the TARGET's lm_head (full vocabulary only);
  ``dflash_config.mask_token_id`` overrides the tokenizer lookup of ``mask_token`` (default "<|MASK|>") and must
  be below the target's vocab size; ``--speculative-num-draft-tokens`` is the block size actually run (default:
  the config's ``block_size``).
* z-lab's published drafts (e.g. ``z-lab/Qwen3-8B-DFlash-b16``) lay the config out the same way: a Qwen3 config
  (``model_type`` qwen3, ``num_hidden_layers`` = draft layers) plus top-level ``block_size``,
  ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``.

So in both layouts the tensors are exactly the head's own state dict (a rename-free copy): the full-vocabulary head
writes no ``lm_head`` (engines share the target's, as the head does) and no embedding table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specgraft.errors import SpecgraftError
from specgraft.export.engine import EngineCheckpoint, engine_layer_ids
from specgraft.export.layouts import Dims
from specgraft.heads.dflash.config import DFlashConfig
from specgraft.heads.dflash.model import DFlashHead
from specgraft.heads.family import CardText, EngineExporter
from specgraft.target import Target
from specgraft.utils.io import atomic_path, read_json_meta

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

#: Per-layer tensors of speculators' ``Qwen3DFlashDecoderLayer`` (vLLM's ``DFlashQwen3DecoderLayer`` loads the same).
_LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
_LAYER_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")

#: Keys of a speculators DFlash config (``DFlashSpeculatorConfig`` fields plus the base ``speculators_config``).
CONFIG_KEYS = frozenset({
    "architectures", "speculators_model_type", "transformer_layer_config", "draft_vocab_size", "block_size",
    "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
    "sample_from_anchor", "speculators_config", "torch_dtype",
})

#: transformers config keys that describe a saved model, not the draft layer (dropped from transformer_layer_config).
_NOT_LAYER_KEYS = ("architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "_name_or_path")


def is_dflash_config(config: Mapping[str, Any]) -> bool:
    """Whether a speculators/engine ``config.json`` describes a DFlash draft."""
    inner = config.get("speculators_config")
    algorithm = inner.get("algorithm") if isinstance(inner, Mapping) else None
    archs = config.get("architectures") or []
    return (config.get("speculators_model_type") == "dflash" or algorithm == "dflash"
            or any(str(a).startswith("DFlash") for a in archs if isinstance(a, str)))


def check_is_dflash(config: Mapping[str, Any], reading_as: str = "EAGLE-3") -> None:
    """Refuse a DFlash export where another family (``reading_as``) is expected: raises SpecgraftError when
    ``config`` is a DFlash one, returns otherwise. (An EAGLE-3 reader calls this before reading EAGLE-3 keys.)"""
    if is_dflash_config(config):
        raise SpecgraftError(f"this export is a DFlash draft (speculators_model_type 'dflash'), not {reading_as}; "
                             "load it with specgraft.heads.dflash.export.load_speculators_export")


def _draft_layer_names(layer_cfg: Mapping[str, Any]) -> set[str]:
    """The fusion, norms and Qwen3 decoder-layer tensors both engines' DFlash drafts hold, for a draft layer
    config (``num_hidden_layers``, ``attention_bias``)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    per_layer = _LAYER_TENSORS + (_LAYER_BIASES if layer_cfg.get("attention_bias") else ())
    for i in range(int(layer_cfg["num_hidden_layers"])):
        names.update(f"layers.{i}.{name}" for name in per_layer)
    return names


def expected_speculators_names(config: Mapping[str, Any]) -> set[str]:
    """The exact tensor names of a speculators DFlash checkpoint with this ``config.json`` (see the module
    docstring for the sources)."""
    layer_cfg = config["transformer_layer_config"]
    names = _draft_layer_names(layer_cfg)
    if int(config["draft_vocab_size"]) != int(layer_cfg["vocab_size"]):
        names.update({"lm_head.weight", "d2t", "t2d"})
    return names


def _verifier_architectures(target: Target) -> list[str]:
    return list(getattr(target.config, "architectures", None) or [target.identity.architecture])


def _refuse_unservable(aux_layer_ids: list[int], num_layers: int, scales_embeddings: bool,
                       model_type: str, engine: str = "vLLM") -> None:
    """What vLLM's (and SGLang's) DFlash draft cannot run: aux layers outside the residual stream it captures, and
    targets that scale their input embeddings (both embed the block with the raw embedding table)."""
    bad = [int(i) for i in aux_layer_ids if not 1 <= int(i) <= num_layers - 1]
    if bad:
        raise SpecgraftError(f"DFlash aux layers {bad} cannot be captured by {engine}: it reads the residual stream "
                             f"between decoder layers, output_hidden_states indices 1..{num_layers - 1}; "
                             "retrain with head.aux_layer_ids inside that range or keep the native head folder")
    if scales_embeddings:
        raise SpecgraftError(f"{model_type} scales its input embeddings, which {engine}'s DFlash draft "
                             "(sharing the raw embedding table) does not; keep the native head folder for this target")


def _scales_embeddings(target: Target) -> bool:
    """Whether ``target`` multiplies its input embeddings (Gemma), measured on a few rows."""
    probe = torch.arange(min(4, target.vocab_size), device=target.device)[None]
    with torch.no_grad():
        return not torch.equal(target.embed(probe), target.input_embeddings.weight[probe])


def _check_exportable(head: DFlashHead) -> None:
    target = head.target
    _refuse_unservable(head.config.aux_layer_ids, target.num_layers, _scales_embeddings(target),
                       target.identity.model_type)


def speculators_config(head: DFlashHead, base_model: str | None = None,
                       dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` of the speculators/vLLM export of ``head`` (``base_model``: the verifier's Hub id or
    path, default the target's recorded name)."""
    target = head.target
    cfg = head.config
    layer_cfg = {k: v for k, v in head.draft_config.to_diff_dict().items() if k not in _NOT_LAYER_KEYS}
    layer_cfg.update({"num_hidden_layers": cfg.num_layers, "vocab_size": target.vocab_size,
                      "model_type": head.draft_config.model_type})
    vocab = cfg.draft_vocab_size if cfg.reduced_vocab else target.vocab_size
    dtype_name = str(dtype or head.param_dtype).removeprefix("torch.")
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": int(vocab),
        "block_size": int(cfg.block_size),
        "target_hidden_size": int(target.hidden_size),
        "aux_hidden_state_layer_ids": [int(i) for i in cfg.aux_layer_ids],
        "mask_token_id": int(cfg.mask_token_id),
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(cfg.block_size) - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": base_model or target.name_or_path,
                         "architectures": _verifier_architectures(target)},
        },
        "torch_dtype": dtype_name,
    }


def speculators_state_dict(head: DFlashHead) -> dict[str, torch.Tensor]:
    """The head's tensors under speculators' names (the same names: a copy), checked against
    :func:`expected_speculators_names`; raises SpecgraftError for heads the engines cannot run."""
    _check_exportable(head)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    expected = expected_speculators_names(speculators_config(head))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise SpecgraftError(f"this DFlash head's layers ({type(head.layers[0]).__name__}) do not have speculators' "
                             f"Qwen3 DFlash layout (missing {missing[:3]}, unexpected {unexpected[:3]}); train it "
                             "with head.draft_layers: qwen3 to serve it with vLLM/speculators, or keep the native "
                             "head folder")
    return state


def save_speculators_export(head: DFlashHead, path: str | Path, base_model: str | None = None,
                            overwrite: bool = False) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``path`` atomically (refuses an existing folder unless
    ``overwrite``)."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise SpecgraftError(f"{path} already exists; pass overwrite=True (--overwrite) or choose another folder")
    state = speculators_state_dict(head)
    config = speculators_config(head, base_model)
    with atomic_path(path) as tmp:
        tmp.mkdir(parents=True)
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def _config_from_export(config: Mapping[str, Any], target: Target, where: Path) -> DFlashConfig:
    layer_cfg = config["transformer_layer_config"]
    if not isinstance(layer_cfg, Mapping) or "num_hidden_layers" not in layer_cfg:
        raise SpecgraftError(f"{where}: transformer_layer_config has no num_hidden_layers; the export is corrupt")
    for key, actual in (("target_hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        recorded = config.get(key) if key == "target_hidden_size" else layer_cfg.get(key)
        if recorded is not None and int(recorded) != int(actual):
            raise SpecgraftError(f"{where} was exported for a target with {key} {recorded}, but "
                                 f"{target.name_or_path} has {actual}; load it onto its own target")
    if config.get("sample_from_anchor"):
        raise SpecgraftError(f"{where} was trained with sample_from_anchor=True (DSpark's mode), which specgraft's "
                             "DFlash head does not run")
    vocab = int(config["draft_vocab_size"])
    layers_kind = "qwen3" if target.identity.model_type != "qwen3" and layer_cfg.get("model_type") == "qwen3" \
        else "target"
    return DFlashConfig(block_size=int(config["block_size"]), num_layers=int(layer_cfg["num_hidden_layers"]),
                        aux_layer_ids=[int(i) for i in config["aux_hidden_state_layer_ids"]],
                        mask_token_id=int(config["mask_token_id"]),
                        draft_vocab_size=0 if vocab == target.vocab_size else vocab, draft_layers=layers_kind)


def load_speculators_export(target: Target, path: str | Path) -> DFlashHead:
    """Rebuild a :class:`DFlashHead` on ``target`` from a speculators DFlash folder (``config.json`` +
    ``model.safetensors``), checking the exact tensor names and shapes."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not config_file.is_file() or not weights_file.is_file():
        raise SpecgraftError(f"{path} lacks {CONFIG_NAME} or {WEIGHTS_NAME}; pass a folder written by the DFlash "
                             "speculators export")
    config = read_json_meta(config_file, ("transformer_layer_config", "draft_vocab_size"),
                            "the export is corrupt or not a speculators checkpoint, re-export it")
    if not is_dflash_config(config):
        kind = config.get("speculators_model_type") or (config.get("architectures") or ["unknown"])[0]
        raise SpecgraftError(f"{path} holds a {kind} draft, not DFlash; load it with that family's loader")
    missing_keys = sorted({"block_size", "aux_hidden_state_layer_ids", "mask_token_id"} - set(config))
    if missing_keys:
        raise SpecgraftError(f"{config_file} lacks {missing_keys}, which vLLM requires of a DFlash config; re-export")
    head = DFlashHead(_config_from_export(config, target, path), target)
    try:
        state = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        raise SpecgraftError(f"{weights_file} is not a readable safetensors file ({type(exc).__name__}); "
                             "re-export the head") from None
    expected = expected_speculators_names(config)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise SpecgraftError(f"{weights_file} does not hold speculators' DFlash tensors for its config (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}); re-export the head")
    own = head.state_dict()
    bad = [k for k in own if k not in state or tuple(state[k].shape) != tuple(own[k].shape)]
    if bad or set(own) != set(state):
        k = bad[0] if bad else sorted(set(own) ^ set(state))[0]
        raise SpecgraftError(f"{weights_file}: tensor {k} does not fit this target's DFlash head (shape "
                             f"{tuple(state[k].shape) if k in state else 'absent'}); the export belongs to another "
                             "target or config")
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)
    return head.to(device=target.device)


# -- SGLang's DFlash draft (``DFlashDraftModel``; sources in the module docstring) --------------------------------
SGLANG_ARCHITECTURE = "DFlashDraftModel"
#: The only MLP activation SGLang's ``DFlashMLP`` runs.
_SGLANG_ACTIVATION = "silu"
#: SGLang's non-causal block attention (its ENCODER_ONLY layer type); "sliding_attention" would run causally.
_SGLANG_LAYER_TYPE = "full_attention"


def sglang_config(head: DFlashHead, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` of the SGLang export of ``head``: the draft layer's Qwen3 config with SGLang's
    DFlash keys (``block_size``, ``num_target_layers``, ``dflash_config``) at the places its parser reads."""
    target = head.target
    cfg = head.config
    config = {k: v for k, v in head.draft_config.to_diff_dict().items() if k not in _NOT_LAYER_KEYS}
    config.update({
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": head.draft_config.model_type,
        "num_hidden_layers": int(cfg.num_layers),
        "vocab_size": int(target.vocab_size),
        "tie_word_embeddings": False,
        "layer_types": [_SGLANG_LAYER_TYPE] * int(cfg.num_layers),
        "block_size": int(cfg.block_size),
        "num_target_layers": int(target.num_layers),
        # SGLang numbers the decoder layer whose output is fused: our output_hidden_states index minus one.
        "dflash_config": {"mask_token_id": int(cfg.mask_token_id),
                          "target_layer_ids": engine_layer_ids(cfg.aux_layer_ids, "sglang")},
        "torch_dtype": str(dtype or head.param_dtype).removeprefix("torch."),
    })
    return config


def expected_sglang_names(config: Mapping[str, Any]) -> set[str]:
    """The exact checkpoint names SGLang's ``DFlashDraftModel.load_weights`` fills for this ``config.json``: the
    speculators names of a full-vocabulary draft (SGLang reads no lm_head, d2t or embeddings)."""
    return _draft_layer_names(config)


def _refuse_for_sglang(head: DFlashHead) -> None:
    """What SGLang's DFlash draft cannot hold beyond vLLM's limits: a draft vocabulary (it drafts through the
    target's lm_head and skips ``lm_head``/``d2t``), another activation than silu, causal/sliding layers."""
    cfg = head.config
    if cfg.reduced_vocab:
        raise SpecgraftError(f"SGLang's DFlash draft predicts with the target's own lm_head and loads no lm_head or "
                             f"d2t, so this head's {cfg.draft_vocab_size}-token draft vocabulary cannot be served by "
                             "it; export it as vllm (speculators keeps the draft vocabulary) or retrain with "
                             "head.draft_vocab_size: 0")
    act = str(getattr(head.draft_config, "hidden_act", _SGLANG_ACTIVATION))
    if act != _SGLANG_ACTIVATION:
        raise SpecgraftError(f"SGLang's DFlash MLP runs only {_SGLANG_ACTIVATION}, but this head's draft layers use "
                             f"{act}; export it as vllm or native")
    kinds = sorted({str(k) for k in getattr(head.draft_config, "layer_types", None) or ()} - {_SGLANG_LAYER_TYPE})
    if kinds:
        raise SpecgraftError(f"this head's draft layers have layer_types {kinds}, which SGLang's DFlash draft runs "
                             f"as causal sliding attention; train with head.draft_layers: qwen3 or export as native")


# -- the registry's engine exporter (``specgraft export --format vllm|sglang``) ----------------------------------
#: A DFlash export's config carries the draft layer's sizes; the loader checks them against the target.
_SIZES = ("hidden_size", "vocab_size")
#: How the errors and notes name each format's engine.
_ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def _info_scales_embeddings(info: Any) -> bool:
    """:func:`_scales_embeddings` on the real target when the exporter has it, else read from the config (the
    skeleton lives on the meta device)."""
    real = getattr(info, "real", None)
    if real is not None:
        return _scales_embeddings(real)
    return str(getattr(info.config, "model_type", "")).startswith("gemma")


def to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: Any, base_model: str,
              speculative_tokens: int) -> EngineCheckpoint:
    """The speculators / vLLM layout (:func:`speculators_config`) or SGLang's (:func:`sglang_config`) of a head
    state dict: the same tensors (a rename-free copy), checked against the engine's exact names
    (:func:`expected_speculators_names` / :func:`expected_sglang_names`) with the head's shapes."""
    engine = _ENGINE_NAMES[fmt]
    skeleton = DFlashHead(DFlashConfig(**cfg), info.skeleton)  # meta device: sizes and names only
    _refuse_unservable(skeleton.config.aux_layer_ids, info.skeleton.num_layers, _info_scales_embeddings(info),
                       str(getattr(info.config, "model_type", "?")), engine)
    if fmt == "sglang":
        _refuse_for_sglang(skeleton)
        config = sglang_config(skeleton)
        names = expected_sglang_names(config)
    else:
        config = speculators_config(skeleton, base_model)
        names = expected_speculators_names(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if set(shapes) != names:
        missing, unexpected = sorted(names - set(shapes)), sorted(set(shapes) - names)
        raise SpecgraftError(f"this DFlash head's layers do not have the Qwen3 DFlash layout {engine} loads (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}); train it with head.draft_layers: qwen3 "
                             f"to serve it with {engine}, or export as native")
    kinds = {"d2t": "int64", "t2d": "bool"}
    expected = {name: (shapes[name], kinds.get(name, "float")) for name in names}
    tensors = {name: state[name] for name in names if name in state}
    dims = Dims(hidden=int(info.config.hidden_size), vocab=int(info.config.vocab_size),
                draft_layers=int(cfg["num_layers"]), num_features=len(cfg["aux_layer_ids"]))
    slots = int(cfg["block_size"]) - 1
    shared = ("the target's embedding table (and, for a full-vocabulary draft, its lm_head) is not written: engines "
              "share the target's")
    if fmt == "sglang":
        ids = config["dflash_config"]["target_layer_ids"]
        notes = [f"fused target layers {list(cfg['aux_layer_ids'])} (output_hidden_states) are written as SGLang "
                 f"dflash_config.target_layer_ids {ids} (the decoder layer whose output is taken: index - 1)",
                 f"SGLang runs the whole block of {slots + 1} (--speculative-num-draft-tokens {slots + 1}, the "
                 "anchor counted; its default is the config's block_size): a smaller value runs a shorter block, "
                 "not the first slots of the trained one, so a tuned shorter chain or tree is not carried over",
                 shared]
    else:
        notes = [f"fused target layers {list(cfg['aux_layer_ids'])} (output_hidden_states) are written as "
                 "aux_hidden_state_layer_ids (vLLM's numbering is the same)",
                 f"vLLM drafts block_size - 1 = {slots} tokens per step (speculative_tokens)", shared]
    return EngineCheckpoint(tensors, config, dims, notes, expected=expected)


def from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], cfg: Mapping[str, Any],
                want: Mapping[str, torch.Tensor], used: set[str],
                target_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The round trip: both layouts hold the head's own tensor names."""
    if not is_dflash_config(config):
        kind = config.get("speculators_model_type") or (config.get("architectures") or ["unknown"])[0]
        raise SpecgraftError(f"this export holds a {kind} draft, not DFlash; load it with that family's loader")
    state = {name: tensors[name] for name in want if name in tensors}
    used.update(state)
    return state


def apply_tuned(config: dict[str, Any], fmt: str, engines: Mapping[str, Any]) -> None:
    """A tuned draft length (``specgraft tune``) reaches vLLM/speculators as the proposal's ``speculative_tokens``
    (vLLM drafts that many of the block's slots; a tuned per-slot tree is served as its spine, a chain of the
    same depth, since vLLM's DFlash proposer drafts chains).

    SGLang gets nothing from a tuned setting: its ``--speculative-num-draft-tokens`` is the size of the block it
    RUNS (one non-causal forward), so a shorter value is a shorter block whose drafts the head was neither trained
    nor tuned on; the config keeps the trained ``block_size`` (SGLang's default) and the card's command passes
    the same number (:func:`sglang_args`)."""
    tokens = (engines.get("vllm") or {}).get("num_speculative_tokens")
    if fmt != "vllm" or tokens is None:
        return
    slots = int(config["block_size"]) - 1
    for method in config["speculators_config"]["proposal_methods"]:
        method["speculative_tokens"] = min(int(tokens), slots)


def sglang_args(cfg: Mapping[str, Any], engines: Mapping[str, Any]) -> str:
    """SGLang's DFLASH launch flags after the draft path: the trained block (see :func:`apply_tuned`)."""
    return f"--speculative-num-draft-tokens {int(cfg.get('block_size', DFlashConfig.block_size))}"


def describe(cfg: Mapping[str, Any], size: str) -> str:
    vocab = cfg.get("draft_vocab_size") or "the full"
    tokens = int(cfg.get("block_size", 8)) - 1
    return (f"A DFlash draft{size}: one non-causal forward of {cfg.get('num_layers')} draft layer(s) drafts a block "
            f"of {tokens} tokens at once from fused target layers {cfg.get('aux_layer_ids')} (transformers "
            f"output_hidden_states indices), over {vocab} vocabulary; the target's embeddings are shared.")


EXPORTERS = {"vllm": EngineExporter(WEIGHTS_NAME, None, to_engine, from_engine, _SIZES,
                                    speculators_model_type="dflash"),
             "sglang": EngineExporter(WEIGHTS_NAME, None, to_engine, from_engine, _SIZES,
                                      architectures=(SGLANG_ARCHITECTURE,))}
CARD = CardText(title="DFlash", describe=describe, vllm_method="dflash", sglang_algorithm="DFLASH",
                config_is_self_contained=True, sglang_args=sglang_args, llamacpp_spec_type="draft-dflash")
