"""``export_head``: a trained head folder -> a folder an engine serves as is; ``load_export``: back into specgraft.

Every export folder holds the engine's files (weights as safetensors, ``config.json``), a ``README.md`` model card,
the eval report's plots when one is given, and ``specgraft_export.json`` (format, head type, the head's config and
target identity, and the report) so that :func:`load_export` and ``specgraft push`` can rebuild the head and the
card. The folder is written atomically: it appears complete or not at all.

Directory names and vLLM: when no method is given, vLLM picks the speculative method from the draft's PATH,
checking ``"eagle-"`` first, then ``"eagle3"``, before it reads a Medusa ``model_type``. vLLM exports of EAGLE
heads therefore get a name that says what they are: ``--out runs/llama`` becomes ``runs/llama-eagle-1``
(EAGLE-1) or ``runs/llama-eagle3`` (EAGLE-3) unless the name already has the marker or ``keep_name`` is set
(then a warning says what vLLM will do). A path that would make vLLM pick the wrong method always warns.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specgraft.config import safe_load_yaml
from specgraft.distill.output import DRAFT_META, read_draft_meta
from specgraft.distill.tune import DRAFT_MODEL_KIND
from specgraft.errors import SpecgraftError
from specgraft.evaluation.report_reader import (
    TUNED_NAME,
    check_report_for_head,
    is_plain,
    read_report,
    read_tuned,
    report_problem,
    same_path,
)
from specgraft.export.card import (
    HUB_REPO_ID,
    is_hub_id,
    llamacpp_serve_lines,
    llamacpp_tuned_lines,
    render_model_card,
)
from specgraft.export.convert import (
    DEFAULT_SPECULATIVE_TOKENS,
    apply_tuned,
    from_engine,
    to_engine,
    tuned_engine_settings,
)
from specgraft.export.formats import engine_exporter, require_supported
from specgraft.export.llamacpp import (
    DRAFT_FILE,
    check_gguf_tokens,
    check_target_gguf,
    read_target_gguf,
    write_draft_model_gguf,
)
from specgraft.export.target_info import TargetInfo, resolve_target, rope_fields
from specgraft.gguf import gguf_origin, is_gguf_path, resolve_model_path
from specgraft.heads.base import (
    ADAPTER_DIR,
    HEAD_CONFIG_NAME,
    HEAD_WEIGHTS_NAME,
    RECIPE_NAME,
    DraftHead,
    HeadWeightsMismatch,
    head_config_from_dict,
    load_checked_state,
    load_head,
    read_head_config,
    read_head_weights,
    rebuild_head,
)
from specgraft.heads.registry import family_names, get_family
from specgraft.target import Target, TargetIdentity, load_target
from specgraft.tuning.search import MAX_TREE_TOKENS
from specgraft.utils.io import atomic_path, read_json_meta
from specgraft.utils.models import DTYPES
from specgraft.utils.outputs import check_output, files_inside, write_manifest, writing_output

logger = logging.getLogger(__name__)

EXPORT_META_NAME = "specgraft_export.json"
CARD_NAME = "README.md"
CONFIG_NAME = "config.json"
EXPORT_VERSION = 1
REPORT_NAME = "report.json"

DTYPE_NAMES = DTYPES


@dataclass
class ExportResult:
    """Where an export went and what the user should know about it."""

    path: Path
    format: str
    head_type: str
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# Names

#: A Hub repo id: ORG/NAME (names of at most 96 characters of letters, digits, '-', '_', '.').
def require_hub_base_model(base_model: str, flag: str = "--base-model") -> None:
    """An explicit base model must be a Hub repo id (configs and cards written with it are read elsewhere)."""
    if not HUB_REPO_ID.match(base_model) or ".." in base_model:
        raise SpecgraftError(f"{flag} {base_model!r} is not a Hub repo id; give the target's id on the Hub, e.g. "
                             f"{flag} meta-llama/Llama-3.1-8B-Instruct")


def local_base_model_warning(base: str) -> str | None:
    """A warning when the target is recorded as a local path (what no other machine can load), else None."""
    if is_hub_id(base):
        return None
    return (f"the target is recorded as {base!r}, not a Hub repo id: the engine config (verifier / base model) and "
            "the card's base_model then name a path no other machine has; pass --base-model ORG/NAME (the target's "
            "Hub id)")


def vllm_path_markers() -> dict[str, tuple[str, str]]:
    """vLLM method -> (what vLLM looks for in a draft's path to pick it, the suffix that adds it), from the families'
    cards (:attr:`~specgraft.heads.family.CardText.vllm_path_marker`), in the order vLLM checks them."""
    cards = [get_family(name).card for name in family_names()]
    return {card.vllm_method: card.vllm_path_marker for card in cards
            if card is not None and card.vllm_method is not None and card.vllm_path_marker is not None}


def vllm_method_from_path(path: str) -> str | None:
    """The method vLLM infers from a draft path when none is given (None: it falls back to the config)."""
    lowered = path.lower()
    return next((method for method, (marker, _) in vllm_path_markers().items() if marker in lowered), None)


def _vllm_method(head_type: str) -> str | None:
    """The vLLM method name of a family (its card's ``vllm_method``), when vLLM serves it."""
    card = get_family(head_type).card
    return card.vllm_method if card is not None else None


def vllm_name_warnings(path: str, head_type: str, what: str = "path") -> list[str]:
    """Warnings for a draft ``path`` (a folder or a Hub repo id) that vLLM's name detection would misread."""
    markers = vllm_path_markers()
    inferred = vllm_method_from_path(path)
    method = _vllm_method(head_type)
    expected = method if method in markers else None
    if inferred == expected:
        return []
    if expected is None:
        return [f"the {what} {path} contains {markers[inferred][0]!r}, so vLLM will serve this {head_type} head as "
                f"{inferred} unless the method is given; rename it"]
    marker = markers[expected][0]
    if inferred is None:
        return [f"the {what} {path} lacks {marker!r}, so vLLM will not recognise this {head_type} head unless the "
                f"method is given (--speculative-config '{{\"method\": \"{head_type}\", ...}}')"]
    found = markers[inferred][0]
    titles = [get_family(name).card.title for name in family_names()
              if get_family(name).card is not None and get_family(name).card.vllm_method == inferred]
    return [f"the {what} {path} contains {found!r}, so vLLM will serve this {head_type} head as "
            f"{titles[0] if titles else inferred} unless the method is given; rename it without {found!r}"]


def export_path(out: str | Path, head_type: str, fmt: str, keep_name: bool = False) -> tuple[Path, list[str]]:
    """The folder to write (``out``, with vLLM's method marker appended when it lacks one) and warnings."""
    out = Path(out)
    if fmt != "vllm":
        return out, []
    method = _vllm_method(head_type)
    markers = vllm_path_markers()
    if method in markers and not keep_name:
        marker, suffix = markers[method]
        if marker not in out.name.lower():
            out = out.with_name(out.name + suffix)
    return out, vllm_name_warnings(str(out.resolve()), head_type)


# ----------------------------------------------------------------------------------------------------------------
# Reading the head


def read_head_state(head_dir: Path, meta: dict[str, Any], info: TargetInfo) -> dict[str, torch.Tensor]:
    """``head.safetensors``, rebuilt into a head of the same config on the target's skeleton
    (:func:`~specgraft.heads.base.rebuild_head`: every tensor present, none extra, right shapes) and finite."""
    weights = head_dir / HEAD_WEIGHTS_NAME
    state = read_head_weights(head_dir)
    try:
        rebuild_head(info.skeleton, meta["head_type"], meta["config"], state, str(weights), load=False)
    except HeadWeightsMismatch as exc:
        if exc.missing:
            # Either file can be the wrong one: weights cut short, or a head_config.json edited to ask for more.
            raise SpecgraftError(f"{weights} and {head_dir / HEAD_CONFIG_NAME} disagree: the config asks for missing "
                                 f"tensors {exc.missing[:6]}; if {HEAD_CONFIG_NAME} was edited, restore it, else the "
                                 "checkpoint is incomplete: re-save the head (or re-run training)") from None
        if exc.unexpected:
            raise SpecgraftError(f"head checkpoint {weights} has unexpected tensors {exc.unexpected[:6]} for a "
                                 f"{meta['head_type']} head of this config; its {HEAD_CONFIG_NAME} was edited or "
                                 "belongs to another head") from None
        raise
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SpecgraftError(f"head checkpoint {weights}: tensor {name} holds NaN or infinite values (training "
                                 "diverged); export an earlier checkpoint or retrain with a lower learning rate")
    return state


def _load_recipe_dict(head_dir: Path) -> dict[str, Any] | None:
    path = head_dir / RECIPE_NAME
    if not path.is_file():
        return None
    import yaml


    try:
        raw = safe_load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        logger.warning("%s is not valid YAML; the model card will not describe the training recipe", path)
        return None
    return raw if isinstance(raw, dict) else None


def load_report(path: str | Path) -> tuple[dict[str, Any], Path]:
    """An eval report (``report.json``, or a folder holding one), checked
    (:func:`~specgraft.evaluation.report_reader.read_report`), and the folder its plots are relative to."""
    report, file = read_report(path, "pass a report `specgraft eval` wrote, or re-run the evaluation", required=())
    return report, file.parent


def find_latest_report(head_dir: Path) -> Path | None:
    """The newest ``report.json`` near a head folder (in it, or an ``eval*`` folder beside it) whose drafter is
    this head (or that names none)."""
    found = []
    for root in (head_dir, head_dir.parent):
        for pattern in (REPORT_NAME, f"eval*/{REPORT_NAME}", f"eval*/*/{REPORT_NAME}"):
            found.extend(p for p in root.glob(pattern) if p.is_file())
    matching = []
    for path in set(found):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            continue
        drafter = report.get("drafter") if isinstance(report, dict) else None
        drafter_path = drafter.get("path") if isinstance(drafter, dict) else None
        # Only a report of THIS head: self/random/draft-model runs (path null or another folder) measured
        # another drafter, and their numbers would be published as this head's.
        if isinstance(drafter_path, str) and same_path(drafter_path, head_dir, path.parent) \
                and report_problem(report) is None:
            matching.append(path)
    return max(matching, key=lambda p: p.stat().st_mtime) if matching else None


# ----------------------------------------------------------------------------------------------------------------
# Export


def export_head(
    head_dir: str | Path,
    fmt: str,
    out: str | Path,
    *,
    target: str | Path | Target | None = None,
    overwrite: bool = False,
    report: str | Path | None = None,
    repo_id: str | None = None,
    base_model: str | None = None,
    dtype: str | None = None,
    keep_name: bool = False,
    speculative_tokens: int | None = None,
    license: str = "other",
    target_gguf: str | Path | None = None,
) -> ExportResult:
    """Export the head saved in ``head_dir`` as ``fmt`` (vllm | sglang | trtllm | native) into ``out``.

    Args:
        target: the target the head was trained for (a folder, a Hub id or a loaded Target); default: the
            ``name_or_path`` recorded in the head config. Only its config is read, plus its lm_head for Medusa
            heads that share it.
        report: an eval report (folder or ``report.json``) to embed in the card; default: the newest one found
            beside the head.
        repo_id: the Hub repo the export is meant for (used in the card's serving commands).
        base_model: the Hub id of the target written into configs and the card (default: the recorded name; see
            :func:`recorded_base_model` for a target recorded as a ``.gguf`` file).
        dtype: cast floating-point weights (float32 | bfloat16 | float16); default: keep the head's dtype.
        keep_name: do not append vLLM's method marker to ``out``.
        speculative_tokens: draft length written into EAGLE-3's speculators_config (default: the tuned depth
            from the head's ``tuned.json``, else 3).
        license: the card's license field.
        target_gguf: the target's GGUF as llama.cpp serves it (``llamacpp`` format: its tokenizer is copied into
            the draft and its sizes and tokens are checked against the head's target); default: the recorded
            target when that is a ``.gguf`` file.
    """
    head_dir = Path(head_dir)
    if _is_distilled_draft(head_dir):
        if fmt != "llamacpp":
            raise SpecgraftError(f"{head_dir} is a distilled draft model (a plain transformers model): vLLM and SGLang "
                                 "load the folder itself as a draft model, so only --format llamacpp converts it")
        return _export_draft_model(head_dir, Path(out), overwrite, target_gguf, speculative_tokens)
    # What the export reads from the head folder: never through a link that leads out of it.
    head_files = files_inside(head_dir, NATIVE_FILES, "export")
    meta = read_head_config(head_dir)
    head_type = meta["head_type"]
    require_supported(head_type, fmt)
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise SpecgraftError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
    tuned = read_tuned(head_dir)
    engines = tuned_engine_settings(tuned) if tuned is not None else {}
    explicit_tokens = speculative_tokens
    if speculative_tokens is None:
        speculative_tokens = (engines.get("vllm", {}).get("num_speculative_tokens", DEFAULT_SPECULATIVE_TOKENS))
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) \
            or not 1 <= speculative_tokens <= MAX_TREE_TOKENS:
        raise SpecgraftError(f"speculative tokens must be an integer in [1, {MAX_TREE_TOKENS}] (the longest draft "
                             f"specgraft verifies), got {speculative_tokens!r}")
    if repo_id is not None and (not HUB_REPO_ID.match(repo_id) or ".." in repo_id):
        raise SpecgraftError(f"--repo-id {repo_id!r} is not a Hub repo id of the form ORG/NAME; e.g. "
                             "my-org/llama-eagle3")
    base = base_model or recorded_base_model(meta["target"]["name_or_path"])
    final, warnings = export_path(out, head_type, fmt, keep_name)
    inputs = [head_dir, report, target if not isinstance(target, Target) else None]
    check_output(final, "export", overwrite=overwrite, inputs=inputs)
    info = resolve_target(meta, target)
    state = read_head_state(head_dir, meta, info)
    if base_model is not None:
        require_hub_base_model(base_model)
    if tuned is not None and is_plain(tuned["setting"]):
        device = tuned.get("device") or {}
        warnings.append(f"{head_dir / TUNED_NAME} found no drafting setting faster than plain decoding on "
                        f"{device.get('device')} ({device.get('device_name')}, {device.get('dtype')}); the export "
                        "carries the engines' default draft lengths: re-run `specgraft tune` on the serving device")
    container = engine_exporter(head_type, fmt).container if fmt != "native" else None
    llamacpp_target, llamacpp_notes = (_llamacpp_target(target_gguf, meta, info) if container == "gguf"
                                       else (None, []))
    llamacpp_tuned = None
    if llamacpp_target is not None:
        llamacpp_tuned, tuned_warnings = _llamacpp_tuned(head_dir, llamacpp_target.path.name)
        warnings += tuned_warnings
        if llamacpp_tuned is not None and explicit_tokens is None and llamacpp_tuned["draft_tokens"] > 0:
            speculative_tokens = int(llamacpp_tuned["draft_tokens"])  # chosen in llama.cpp itself
    local_warning = local_base_model_warning(base) if fmt not in ("native", "llamacpp") else None
    if local_warning is not None:
        warnings.append(local_warning)
    notes: list[str] = list(llamacpp_notes)
    if (head_dir / ADAPTER_DIR).is_dir() and fmt != "native":
        warnings.append("this is a Medusa-2 head trained with a LoRA adapter on the target: serve it with the "
                        "adapter MERGED into the target (peft merge_and_unload), not with the base target")

    report_dict, report_root = None, None
    report_path = Path(report) if report is not None else find_latest_report(head_dir)
    if report_path is not None:
        report_dict, report_root = load_report(report_path)
        if report is not None:
            warnings += check_report_for_head(report_dict, report_path, head_type, head_dir)
    recipe = _load_recipe_dict(head_dir)

    files: list[str] = []
    with writing_output(final, "export", overwrite=overwrite, inputs=inputs), atomic_path(final) as tmp:
        tmp.mkdir(parents=True)
        if fmt == "native":
            files += _write_native(head_dir, head_files, tmp, dtype=DTYPE_NAMES[dtype] if dtype else None,
                                   base_model=base_model)
        else:
            ckpt = to_engine(head_type, fmt, state, meta, info, base_model=base,
                             dtype=DTYPE_NAMES[dtype] if dtype else None, speculative_tokens=speculative_tokens)
            notes += ckpt.notes
            apply_tuned(ckpt.config, head_type, fmt, engines)
            weights_name = engine_exporter(head_type, fmt).weights_file
            if llamacpp_target is not None:
                from specgraft.export.llamacpp import write_gguf

                # The draft's own tokenizer keys (DFlash's mask token) replace the target's.
                tokenizer = [f for f in llamacpp_target.tokenizer_fields if f[0] not in ckpt.config]
                write_gguf(tmp / weights_name, _gguf_arch(ckpt.config), {"general.name": f"{base} {head_type} draft",
                                                                       **ckpt.config},
                           ckpt.tensors, tokenizer)
                files.append(weights_name)
            else:
                save_file({k: v.contiguous() for k, v in ckpt.tensors.items()}, str(tmp / weights_name),
                          metadata={"format": "pt"})
                _verify_written(tmp / weights_name, ckpt.tensors)
                (tmp / CONFIG_NAME).write_text(json.dumps(ckpt.config, indent=2) + "\n", encoding="utf-8")
                files += [weights_name, CONFIG_NAME]
        plots = _copy_plots(report_dict, report_root, tmp, warnings)
        files += plots.values()
        if report_dict is not None:  # the card links only the plots that were copied
            report_dict = dict(report_dict, plots=plots)
        export_meta = {
            "specgraft_export_version": EXPORT_VERSION,
            "format": fmt,
            "head_type": head_type,
            "base_model": base,
            "license": license,
            "head": meta,
            "recipe": recipe,
            "report": report_dict,
            "notes": notes,
            "tuned": ({"setting": {k: v for k, v in tuned["setting"].items()}, "device": tuned.get("device"),
                       "predicted": tuned.get("predicted"), "measured": tuned.get("measured"), "engines": engines,
                       "speculative_tokens": speculative_tokens} if tuned is not None else None),
        }
        if llamacpp_target is not None:
            # A block drafter (DFlash) runs a block of draft_tokens + 1 slots in llama.cpp: unless asked otherwise,
            # the block it was trained on.
            block = ckpt.config.get(f"{_gguf_arch(ckpt.config)}.block_size")
            draft_tokens = (int(block) - 1 if block is not None and explicit_tokens is None and llamacpp_tuned is None
                            else speculative_tokens)
            export_meta["llamacpp"] = {"target_gguf": llamacpp_target.path.name, "draft_file": weights_name,
                                       "draft_tokens": draft_tokens}
            if llamacpp_tuned is not None:
                export_meta["llamacpp"]["tuned"] = llamacpp_tuned
        (tmp / EXPORT_META_NAME).write_text(json.dumps(export_meta, indent=2, default=str) + "\n", encoding="utf-8")
        files.append(EXPORT_META_NAME)
        (tmp / CARD_NAME).write_text(card_from_export_meta(export_meta, repo_id, local_path=final), encoding="utf-8")
        files.append(CARD_NAME)
        write_manifest(tmp, files, "export")  # what `push` uploads, and nothing else
    for message in warnings:
        logger.warning("%s", message)
    return ExportResult(final, fmt, head_type, sorted(files), warnings, notes)


def _is_distilled_draft(folder: Path) -> bool:

    return (folder / DRAFT_META).is_file() and not (folder / HEAD_CONFIG_NAME).is_file()


def _export_draft_model(folder: Path, out: Path, overwrite: bool, target_gguf: str | Path | None,
                        speculative_tokens: int | None) -> ExportResult:
    """A distilled draft model as llama.cpp's ``-md`` GGUF, with the target GGUF's tokenizer."""


    meta = read_draft_meta(folder)
    inputs = [folder, target_gguf]
    check_output(out, "export", overwrite=overwrite, inputs=inputs)
    recorded = TargetIdentity.from_dict(meta["target"])
    target = read_target_gguf(_target_gguf_path(target_gguf, recorded.name_or_path))
    wrong = [f"{what} {found} (the draft's target has {want})" for what, found, want in (
        ("layers", target.block_count, recorded.num_hidden_layers), ("hidden size", target.hidden_size,
                                                                    recorded.hidden_size),
        ("vocabulary", len(target.tokens), recorded.vocab_size)) if found != want]
    if wrong:
        raise SpecgraftError(f"--target-gguf {target.path} is not the target this draft was distilled for: it has "
                             f"{', '.join(wrong)}; pass the GGUF of that target")
    draft = load_target(folder, dtype="float32", device="cpu")  # the one model loader
    tokenizer, model = draft.tokenizer, draft.model
    notes = check_gguf_tokens(target, [str(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))])
    tuned, warnings = _llamacpp_tuned(folder, target.path.name)
    if speculative_tokens is None and tuned is not None and tuned["draft_tokens"] > 0:
        speculative_tokens = int(tuned["draft_tokens"])  # chosen in llama.cpp itself
    n = int(speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)
    export_meta = {"specgraft_export_version": EXPORT_VERSION, "format": "llamacpp", "head_type": DRAFT_MODEL_KIND,
                   "draft": meta, "llamacpp": {"target_gguf": target.path.name, "draft_file": DRAFT_FILE,
                                               "draft_tokens": n}}
    if tuned is not None:
        export_meta["llamacpp"]["tuned"] = tuned
    card = "\n".join([
        f"# Distilled draft model for {recorded.name_or_path} (llama.cpp GGUF)", "",
        f"A {model.config.num_hidden_layers}-layer draft model distilled by specgraft; it carries the tokenizer of "
        f"`{target.path.name}`, so llama.cpp accepts it as that target's draft.", "",
        *llamacpp_tuned_lines(tuned),
        *llamacpp_serve_lines(target.path.name, f"{out}/{DRAFT_FILE}", "draft-simple", n), ""])
    files = [DRAFT_FILE, EXPORT_META_NAME, CARD_NAME]
    with writing_output(out, "export", overwrite=overwrite, inputs=inputs), atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        write_draft_model_gguf(model, target, tmp / DRAFT_FILE, f"{recorded.name_or_path} draft")
        (tmp / EXPORT_META_NAME).write_text(json.dumps(export_meta, indent=2, default=str) + "\n", encoding="utf-8")
        (tmp / CARD_NAME).write_text(card, encoding="utf-8")
        write_manifest(tmp, files, "export")  # what `push` uploads, and nothing else
    for message in warnings:
        logger.warning("%s", message)
    return ExportResult(out, "llamacpp", DRAFT_MODEL_KIND, sorted(files), warnings, notes)


def _llamacpp_tuned(folder: Path, target_gguf_name: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The card's summary of ``specgraft tune --engine llamacpp`` for this target GGUF (None: never tuned for it)."""
    from specgraft.tuning.llamacpp import card_summary, tuned_for_target

    record, warnings = tuned_for_target(folder, target_gguf_name)
    return (card_summary(record) if record is not None else None), warnings


def _target_gguf_path(target_gguf: str | Path | None, recorded: str) -> str | Path:
    """``--target-gguf``, else the recorded target when it is a ``.gguf`` file here; refused otherwise."""

    if target_gguf is None and is_gguf_path(recorded) and Path(recorded).expanduser().is_file():
        target_gguf = recorded
    if target_gguf is None:
        raise SpecgraftError("the llamacpp format needs the target's GGUF (llama.cpp copies its tokenizer into the "
                             "draft and serves the target from it): pass --target-gguf TARGET.gguf, converted with "
                             "llama.cpp's convert_hf_to_gguf.py")
    return target_gguf


def _gguf_arch(metadata: dict[str, Any]) -> str:
    """The architecture a draft's GGUF metadata is prefixed with (``eagle3.block_count`` -> ``eagle3``)."""
    return next(iter(metadata)).split(".", 1)[0]


def _llamacpp_target(target_gguf: str | Path | None, meta: dict[str, Any], info: TargetInfo) -> tuple[Any, list[str]]:
    """The target GGUF a llama.cpp draft is written for (its tokenizer goes into the draft), checked against the
    head's target; refused in one line when absent or another model's."""

    target = read_target_gguf(_target_gguf_path(target_gguf, str(meta["target"]["name_or_path"])))
    return target, check_target_gguf(target, info.config, _target_tokens(info))


def _target_tokens(info: TargetInfo) -> list[str] | None:
    """The head's target tokenizer's token strings by id (None when no tokenizer is available here)."""
    from transformers import AutoTokenizer


    tokenizer = info.real.tokenizer if info.real is not None else None
    if tokenizer is None:
        local = Path(resolve_model_path(info.name_or_path)).expanduser()
        if not local.is_dir():
            return None
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local))
        except (OSError, ValueError):
            return None
    return [str(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]


def recorded_base_model(name_or_path: str) -> str:
    """The base model configs and the card name when ``--base-model`` is not given: the recorded target, except
    that a ``.gguf`` file (which no engine config or ``from_pretrained(name)`` loads) becomes the Hub repository
    its metadata says it was converted from.

    Raises:
        SpecgraftError: a ``.gguf`` target whose Hub source is unknown (file absent here, or metadata silent).
    """

    if not is_gguf_path(name_or_path):
        return name_or_path
    origin = gguf_origin(name_or_path)
    if origin is not None and origin.hub_id:
        logger.info("base model %s: the Hub source recorded in %s", origin.hub_id, name_or_path)
        return origin.hub_id
    called = f" ({origin.name!r})" if origin is not None and origin.name else ""
    raise SpecgraftError(
        f"this head's target was loaded from the GGUF file {name_or_path}{called}, which engine configs and "
        "`from_pretrained` cannot take by that path, and no Hub source is recorded for it; pass --base-model "
        "with the Hub id of the model the GGUF was made from (e.g. HuggingFaceTB/SmolLM2-135M-Instruct for "
        "SmolLM2-135M-Instruct.Q4_1.gguf) or a folder written by `specgraft convert-gguf`")


def card_from_export_meta(export_meta: dict[str, Any], repo_id: str | None, local_path: Path | None = None) -> str:
    """The README.md of an export folder from its ``specgraft_export.json`` content."""

    head_meta = dict(export_meta["head"], base_model=export_meta.get("base_model"),
                     license=export_meta.get("license", "other"), export_notes=export_meta.get("notes", []),
                     tuned=export_meta.get("tuned"), llamacpp=export_meta.get("llamacpp"))
    if local_path is not None:
        head_meta["local_path"] = str(local_path)
    return render_model_card(head_meta, export_meta.get("recipe"), export_meta.get("report"), export_meta["format"],
                             repo_id)


#: What a native export copies from the head folder (``adapter/``: Medusa-2's LoRA adapter, every file under it).
NATIVE_FILES = (HEAD_WEIGHTS_NAME, HEAD_CONFIG_NAME, RECIPE_NAME, TUNED_NAME, ADAPTER_DIR)


def _write_native(head_dir: Path, head_files: list[str], tmp: Path, dtype: torch.dtype | None = None,
                  base_model: str | None = None) -> list[str]:
    """Copy ``head_files`` (:func:`~specgraft.utils.outputs.files_inside` checked that none leads out of the head
    folder) byte for byte, except that ``dtype`` casts the weights' floating-point tensors (integer buffers, such as
    EAGLE-3's draft vocabulary map, are kept) and ``base_model`` replaces the target's recorded ``name_or_path`` (a
    local path another machine does not have) by its Hub id; returns their names."""
    for name in head_files:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        if name == HEAD_WEIGHTS_NAME and dtype is not None:
            state = {}
            with safe_open(str(head_dir / name), framework="pt") as fh:  # one read: tensors and metadata
                metadata = dict(fh.metadata() or {})
                for key in fh.keys():
                    tensor = fh.get_tensor(key)
                    state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
            save_file(state, str(tmp / name), metadata={**metadata, "dtype": str(dtype).removeprefix("torch.")})
            _verify_written(tmp / name, state)
        elif name == HEAD_CONFIG_NAME and base_model is not None:
            meta = json.loads((head_dir / name).read_text(encoding="utf-8"))
            meta["target"]["name_or_path"] = base_model
            (tmp / name).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(head_dir / name, tmp / name)
    return [Path(name).as_posix() for name in head_files]


def _verify_written(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Read the written file's header back: the same names and shapes (a truncated write fails here)."""
    with safe_open(str(path), framework="pt") as fh:
        written = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
    expected = {name: tuple(t.shape) for name, t in tensors.items()}
    if written != expected:
        raise SpecgraftError(f"{path} did not read back as written; check free disk space and retry")


#: File types a report's plots may have (what `specgraft eval` writes, and images a card can show).
PLOT_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".webp", ".gif")


def _copy_plots(report: dict[str, Any] | None, root: Path | None, tmp: Path, warnings: list[str]) -> dict[str, str]:
    """Copy the report's plots into ``tmp``; returns plot key -> file name of those copied.

    A report is untrusted input: only image files that resolve INSIDE the report folder (no absolute path, no
    ``..``, no symlink out of it) are copied, and never over a file the exporter wrote (``config.json``, ...),
    so an edited report cannot put other files into an export (which ``push`` would publish).
    """
    if not report or root is None:
        return {}
    plots = report.get("plots") or {}
    copied: dict[str, str] = {}
    inside = root.resolve()
    for key, name in plots.items() if isinstance(plots, dict) else []:
        rel = Path(str(name))
        src = root / rel
        if rel.is_absolute() or ".." in rel.parts or inside not in src.resolve().parents:
            warnings.append(f"the eval report names plot {name}, which is outside its folder {root}; not copied")
            continue
        if src.suffix.lower() not in PLOT_SUFFIXES:
            warnings.append(f"the eval report names plot {name}, which is not an image ({', '.join(PLOT_SUFFIXES)}); "
                            "not copied")
            continue
        if not src.is_file():
            warnings.append(f"the eval report names plot {name} but {src} does not exist; the card omits it")
            continue
        if (tmp / src.name).exists() or src.name in (CARD_NAME, EXPORT_META_NAME):
            warnings.append(f"the eval report's plot {name} has the name of an export file; not copied")
            continue
        shutil.copyfile(src.resolve(), tmp / src.name)
        copied[str(key)] = src.name
    return copied


# ----------------------------------------------------------------------------------------------------------------
# Loading an export back


def read_export_meta(path: str | Path) -> dict[str, Any]:
    """The ``specgraft_export.json`` of an export folder."""
    path = Path(path)
    file = path / EXPORT_META_NAME
    if not file.is_file():
        raise SpecgraftError(f"{path} has no {EXPORT_META_NAME}, so it is not a specgraft export; pass a folder "
                             "written by `specgraft export`")
    return read_json_meta(file, ("format", "head_type", "head"), "re-export the head")


def load_export(path: str | Path, target: Target) -> DraftHead:
    """Rebuild a specgraft head from an export folder of any format, reading the weights from the ENGINE's files
    (the round trip that proves an export holds exactly the trained head)."""
    path = Path(path)
    export_meta = read_export_meta(path)
    fmt, head_type, meta = export_meta["format"], export_meta["head_type"], export_meta["head"]
    if fmt == "native":
        return load_head(target, path)
    TargetIdentity.from_dict(meta["target"]).require_compatible(target.identity, what=f"{head_type} export")
    exporter = engine_exporter(head_type, fmt)
    config_file = path / CONFIG_NAME
    weights = path / exporter.weights_file
    for file in (config_file, weights) if exporter.container == "safetensors" else (weights,):
        if not file.is_file():
            raise SpecgraftError(f"{path} lacks {file.name}; the export is incomplete, re-export the head")
    if exporter.container == "gguf":
        from specgraft.export.llamacpp import read_gguf

        engine_config, tensors = read_gguf(weights)
    else:
        engine_config = json.loads(config_file.read_text(encoding="utf-8"))
        tensors = load_file(str(weights))
    _check_engine_config(engine_config, head_type, fmt, target)
    # Built first (the engine reader needs the tensors it must produce), then loaded as rebuild_head loads.
    cls, config = head_config_from_dict(head_type, meta["config"], f"{path}/{EXPORT_META_NAME}")
    head = cls(config, target)
    lm_head = target.output_head.weight.detach().cpu()  # for families that borrow it (Medusa's shared lm_head)
    state = from_engine(head_type, fmt, tensors, engine_config, meta["config"], head.state_dict(), lm_head)
    try:
        load_checked_state(head, state, str(weights))
    except HeadWeightsMismatch as exc:
        if exc.bad_shape is None:
            raise
        found, expected = exc.shapes
        raise SpecgraftError(f"{weights}: tensor for {exc.bad_shape} has shape {found}, expected {expected}; the "
                             "export was made for another head") from None
    head.to(device=target.device)
    return head


def _check_engine_config(config: dict[str, Any], head_type: str, fmt: str, target: Target) -> None:
    """The exported config must describe ``target`` (sizes, RoPE base, norms)."""
    tc = target.text_config
    layer = config.get("transformer_layer_config", config)

    checks = {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size,
              "max_position_embeddings": tc.max_position_embeddings, "rms_norm_eps": float(tc.rms_norm_eps),
              "num_attention_heads": tc.num_attention_heads, "rope_theta": rope_fields(tc)["rope_theta"]}
    for key in engine_exporter(head_type, fmt).checked_config_keys:
        value = checks[key]
        if layer.get(key) != value:
            raise SpecgraftError(f"the {fmt} export's config has {key}={layer.get(key)!r} but the target has "
                                 f"{value!r}; it was exported for another target")
