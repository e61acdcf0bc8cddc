"""Export trained heads for serving engines (vLLM, SGLang, TensorRT-LLM), load exports back, write model cards
and push them to the Hugging Face Hub.

* :func:`export_head` -- a head folder -> an engine folder, checked against the engine's exact weight names
  (:mod:`specgraft.export.layouts`) with configs consistent with the target.
* :func:`load_export` -- any export folder -> a specgraft head (the round trip).
* :func:`render_model_card` -- the README.md of an export.
* :func:`push_folder` -- upload an export folder (``specgraft push``).
"""

from specgraft.utils.lazy import lazy_exports

_EXPORTS = {
    "render_model_card": "card",
    **dict.fromkeys(("ExportResult", "export_head", "load_export", "read_export_meta"), "exporter"),
    **dict.fromkeys(("FORMATS", "formats_for", "supported_formats"), "formats"),
    **dict.fromkeys(("plan_push", "push_folder"), "push"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "FORMATS",
    "ExportResult",
    "export_head",
    "formats_for",
    "supported_formats",
    "load_export",
    "plan_push",
    "push_folder",
    "read_export_meta",
    "render_model_card",
]
