"""The distilled draft on disk: a normal transformers model folder plus what it was made for.

A draft folder holds

* the model (``config.json``, ``generation_config.json``, ``*.safetensors``) and the target's tokenizer, so
  ``AutoModelForCausalLM.from_pretrained(folder)`` loads it and ``target.generate(..., assistant_model=draft)``
  uses it as is;
* ``README.md``: a model card naming the target it drafts for;
* ``specgraft_distill.json``: the target's :class:`~specgraft.target.TargetIdentity`, the student's origin, the
  distillation settings and the held-out ``alpha_exact``. :func:`load_draft` checks it against a target.

Folders are written atomically (temporary folder, then rename).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from specgraft.distill.tune import DRAFT_MODEL_KIND
from specgraft.errors import SpecgraftError
from specgraft.target import Target, TargetIdentity
from specgraft.utils.io import atomic_path

logger = logging.getLogger(__name__)

#: Metadata file of a draft folder.
DRAFT_META = "specgraft_distill.json"
#: Version of the metadata layout.
DRAFT_FORMAT_VERSION = 1
MODEL_CARD = "README.md"


def model_card(meta: dict[str, Any]) -> str:
    """A model card stub for a draft folder described by ``meta`` (the ``specgraft_distill.json`` content)."""
    target = meta["target"]["name_or_path"]
    student = meta.get("student", {})
    distill = meta.get("distill", {})
    metrics = meta.get("metrics", {})
    origin = student.get("origin")
    front = ["---", "library_name: transformers", "tags:", "- speculative-decoding", "- draft-model",
             "- distillation", "- specgraft"]
    if origin and origin != "target":
        front.append(f"base_model: {origin}")
    front.append("---")
    if origin == "target":
        made = f"cut from the target itself (decoder layers {student.get('kept_layers')} of the target"
        made += ", narrower and randomly initialised)" if student.get("random_init") else ", weights copied)"
    else:
        made = f"initialised from `{origin}`"
    lines = [
        *front,
        "",
        f"# Draft model for {target}",
        "",
        f"A draft (assistant) model for speculative decoding with **{target}**, distilled on that target's "
        "outputs with specgraft. It uses the target's tokenizer, so it works as `assistant_model=` in "
        "transformers' `generate` and as a standard draft model in serving engines. Speculative decoding is "
        "lossless: outputs follow the target's distribution whatever the draft.",
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        *_target_loading_lines(target),
        'draft = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        'inputs = tokenizer("Once upon a time", return_tensors="pt")',
        "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=64)",
        "```",
        "",
        "## Training",
        "",
        f"- Student: {made}; {student.get('num_parameters', '?')} parameters, "
        f"{student.get('num_hidden_layers', '?')} layers, hidden size {student.get('hidden_size', '?')}.",
        f"- Loss: `{distill.get('loss', '?')}` (beta {distill.get('beta')}, temperature {distill.get('temperature')});"
        f" on-policy fraction lmbda {distill.get('lmbda')}; sequence-level KD {distill.get('seq_kd')}.",
    ]
    if metrics.get("alpha_exact") is not None:
        lines.append(f"- Held-out alpha_exact (mean over positions of sum_x min(p, q)): "
                     f"{metrics['alpha_exact']:.4f} at step {metrics.get('step')}.")
    lines += ["", f"The target's identity and the full settings are in `{DRAFT_META}`.", ""]
    return "\n".join(lines)


def _target_loading_lines(target: str) -> list[str]:
    """The usage snippet's lines that load the target: a ``.gguf`` file loads as ``(folder, gguf_file=name)``,
    the only form transformers accepts for it (``from_pretrained("x.gguf")`` fails)."""
    from specgraft.gguf import is_gguf_path

    if not is_gguf_path(target):
        return [f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
                f'target = AutoModelForCausalLM.from_pretrained("{target}")']
    where = Path(target)
    args = f'"{where.parent}", gguf_file="{where.name}"'
    return ["# the target is a GGUF file: transformers dequantizes it on load (pip install gguf)",
            f"tokenizer = AutoTokenizer.from_pretrained({args})",
            f"target = AutoModelForCausalLM.from_pretrained({args})"]


def save_draft(folder: str | Path, model: torch.nn.Module, tokenizer: Any, target_identity: TargetIdentity, *,
               student: dict[str, Any] | None = None, distill: dict[str, Any] | None = None,
               metrics: dict[str, Any] | None = None, training: dict[str, Any] | None = None,
               dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` (optionally cast to ``dtype``) + ``tokenizer`` + card + metadata into ``folder`` atomically."""
    folder = Path(folder)
    meta = {
        "format_version": DRAFT_FORMAT_VERSION,
        "kind": DRAFT_MODEL_KIND,
        "target": target_identity.to_dict(),
        "student": student or {},
        "distill": distill or {},
        "metrics": metrics or {},
        "training": training or {},
    }
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        state_dict = None
        if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
            # Cast on the way out; save_pretrained drops the duplicate of tied weights by name.
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.save_pretrained(str(tmp), state_dict=state_dict)
        if state_dict is not None:
            _set_config_dtype(tmp, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / MODEL_CARD).write_text(model_card(meta), encoding="utf-8")
        (tmp / DRAFT_META).write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    return folder


def _set_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def read_draft_meta(folder: str | Path) -> dict[str, Any]:
    """The ``specgraft_distill.json`` of a draft folder.

    Raises:
        SpecgraftError: the folder is not a specgraft draft.
    """
    path = Path(folder) / DRAFT_META
    if not path.is_file():
        raise SpecgraftError(f"{folder} has no {DRAFT_META}, so it is not a draft made by `specgraft distill`; "
                             "pass the draft/ or best/ folder of a distillation run")
    return json.loads(path.read_text(encoding="utf-8"))


def load_draft(folder: str | Path, target: Target | None = None, *, dtype: str | torch.dtype = "float32",
               device: str | torch.device | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """Load a draft folder as ``(model, tokenizer, meta)``; with ``target``, check it was made for that target.

    Raises:
        TargetMismatchError: the draft was distilled for a target with another tokenizer, vocabulary or shape.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgraft.utils.models import resolve_dtype

    meta = read_draft_meta(folder)
    if target is not None:
        TargetIdentity.from_dict(meta["target"]).require_compatible(target.identity, what="draft model")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=resolve_dtype(dtype))
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model, tokenizer, meta


def draft_drafter(folder: str | Path, target: Target | None = None, k: int = 4, **kwargs: Any) -> Any:
    """A :class:`specgraft.decoding.drafters.DraftModelDrafter` for a draft folder (on the target's device)."""
    from specgraft.decoding.drafters import DraftModelDrafter

    model, tokenizer, _ = load_draft(folder, target, device=target.device if target is not None else None)
    return DraftModelDrafter(model, k=k, tokenizer=tokenizer, **kwargs)
