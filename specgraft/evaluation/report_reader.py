"""The one reader of ``report.json`` (what ``specgraft eval`` writes) and of ``tuned.json`` (what ``specgraft tune``
writes beside a head or draft), with their schemas checked where they are read.

``tune --calibration``, ``simulate --report`` and ``export --report`` all read reports through
:func:`read_report`: a JSON object whose sections have the right JSON types, whose metrics are finite
non-negative numbers (rates within [0, 1]) and that holds no ``NaN``/``Infinity`` literal, so a hand-edited or
damaged report is refused with one line instead of reaching a tuned.json, a prediction or a published card.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.tuning.search import MAX_TREE_TOKENS
from specgraft.utils.io import read_json_meta, require_file
from specgraft.utils.numbers import check_number, check_number_tree, is_number

REPORT_FILE = "report.json"
TUNED_NAME = "tuned.json"
#: The setting that drafts nothing: plain decoding. ``specgraft tune`` stores it when no drafting setting is faster
#: than plain decoding on the device (measured by the confirming evals, else predicted); ``specgraft eval`` then
#: decodes plainly and the exports carry no tuned engine hints.
PLAIN_SETTING: dict[str, Any] = {"mode": "plain"}
#: Report sections and the JSON type each must have when present.
SECTION_TYPES: dict[str, type] = {"drafter": dict, "overall": dict, "domains": dict, "plots": dict,
                                  "settings": dict, "target": dict}
#: Metrics that are rates (in [0, 1]).
RATE_METRICS = ("acceptance_by_depth", "reach_by_depth", "alpha_exact")


def report_file(path: str | Path) -> Path:
    """``path`` itself, or the report.json in the folder ``path``."""
    path = Path(path)
    return path / REPORT_FILE if path.is_dir() else path


def report_problem(report: Any) -> str | None:
    """What makes ``report`` no `specgraft eval` report (a section of the wrong JSON type), or None."""
    if not isinstance(report, dict):
        return "not a JSON object"
    for key, kind in SECTION_TYPES.items():
        value = report.get(key)
        if value is not None and not isinstance(value, kind):
            return f"its {key!r} is {type(value).__name__}, expected a JSON object"
    for name, values in (report.get("domains") or {}).items():
        if values is not None and not isinstance(values, dict):
            return f"its domain {name!r} is {type(values).__name__}, expected a JSON object"
    return None


def check_metrics(values: dict[str, Any], where: str, fix: str) -> None:
    """Every number among ``values`` (``overall`` or one domain) finite and >= 0, rates <= 1; lists of numbers
    (nulls allowed: depths never reached) alike."""
    for key, value in values.items():
        high = 1.0 if key in RATE_METRICS else None
        if is_number(value):
            check_number(value, f"{where}.{key}", fix, high=high)
        elif isinstance(value, list) and all(v is None or is_number(v) for v in value):
            check_number_tree(value, f"{where}.{key}", fix, high=high, allow_null=True)
        elif key in RATE_METRICS and value is not None:
            raise SpecgraftError(f"{where}.{key} is {value!r}, not a rate or a list of rates; {fix}")


def read_report(path: str | Path, fix: str = "pass the report.json that `specgraft eval` wrote",
                required: tuple[str, ...] = ("overall",)) -> tuple[dict[str, Any], Path]:
    """The report at ``path`` (a report.json or its folder) and its file, checked (see the module docstring)."""
    file = report_file(path)
    require_file(file, "eval report", fix)
    report = read_json_meta(file, required, fix)
    problem = report_problem(report)
    if problem is not None:
        raise SpecgraftError(f"{file} is not a `specgraft eval` report ({problem}); {fix}")
    if report.get("overall") is not None:
        check_metrics(report["overall"], f"{file}: overall", fix)
    for name, values in (report.get("domains") or {}).items():
        check_metrics(values or {}, f"{file}: domains.{name}", fix)
    return report, file


def check_report_for_head(report: dict[str, Any], file: Path, head_type: str, head_dir: Path) -> list[str]:
    """Refuse a report that measured another kind of drafter (``head_type``: a head family, or ``draft_model``);
    warnings when it names another folder than ``head_dir``."""
    drafter = report.get("drafter") or {}
    measured = drafter.get("type")
    if measured != head_type:
        raise SpecgraftError(f"{file} measured the {measured or 'unknown'} drafter, not this {head_type} drafter "
                             f"({head_dir}); pass a report of `specgraft eval` with {head_dir} (or none)")
    recorded = drafter.get("path")
    if not isinstance(recorded, str) or not same_path(recorded, head_dir, file.parent):
        return [f"{file} was measured on the drafter at {recorded}, not {head_dir}; its numbers are used as this "
                "drafter's, so make sure it is the same one"]
    return []


def same_path(recorded: str, head_dir: Path, base: Path) -> bool:
    """Whether ``recorded`` (absolute, or relative to the cwd or to ``base``) names ``head_dir``."""
    candidate = Path(recorded)
    candidates = [candidate] if candidate.is_absolute() else [candidate, base / candidate]
    return any(c.exists() and c.resolve() == head_dir.resolve() for c in candidates)


def is_plain(setting: Mapping[str, Any] | None) -> bool:
    """Whether a (tuned) setting is plain decoding: draft nothing."""
    return bool(setting) and setting.get("mode") == PLAIN_SETTING["mode"]


# -- tuned.json ----------------------------------------------------------------------------------------------------
def read_tuned(folder: str | Path) -> dict[str, Any] | None:
    """The tuned setting stored in a head or draft folder (None when it was never tuned)."""
    file = Path(folder) / TUNED_NAME
    if not file.is_file():
        return None
    fix = f"re-run `specgraft tune --overwrite` for {folder}"
    record = read_json_meta(file, ("kind", "setting", "device"), fix)  # NaN/Infinity literals refused
    # The schema, checked here: the setting drives eval and the exported engine configs, the rest the card.
    if not isinstance(record["kind"], str):
        raise SpecgraftError(f"{file}: kind is {record['kind']!r}, not a name; {fix}")
    for key in ("setting", "device"):
        if not isinstance(record[key], dict):
            raise SpecgraftError(f"{file}: {key} is {type(record[key]).__name__}, not an object; {fix}")
    for key, value in record["setting"].items():
        if not isinstance(value, str):
            check_number_tree(value, f"{file}: setting.{key}", fix, high=MAX_TREE_TOKENS)
    for key in ("predicted", "measured", "default", "candidates"):
        if record.get(key) is not None and not isinstance(record[key], (dict, list)):
            raise SpecgraftError(f"{file}: {key} is {type(record[key]).__name__}, not an object; {fix}")
    return record


def drafter_info(kind: str, head_type: str, path: str, setting: dict[str, Any], source: str) -> dict[str, Any]:
    """What report.json records under ``drafter`` for a tuned/default setting."""
    info: dict[str, Any] = {"type": head_type, "path": path, "mode": setting.get("mode"), "setting_source": source}
    for key in ("k", "depth", "top_k", "total_tokens", "tree_size"):
        if key in setting:
            info[key] = setting[key]
    if "paths" in setting:  # a static tree (Medusa): eval's k is its depth
        info["k"] = setting["depth"]
    return info
