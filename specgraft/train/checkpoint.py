"""Training checkpoints: atomic, checksummed, pickle-free, rotated.

A checkpoint is a folder ``checkpoints/step-XXXXXXX/`` written to a temporary name and renamed into place, with

* ``head/``: the head in its ``save_pretrained`` format (weights, head config, resolved recipe),
* ``adapter/``: a peft LoRA adapter (Medusa-2 only),
* ``optimizer.safetensors``: every optimizer state tensor,
* ``trainer_state.json``: step, data position, scheduler state, optimizer param groups, RNG states,
* ``manifest.json`` (written last): the sha256 and size of every other file.

Loading verifies the manifest; a corrupted or partial checkpoint is skipped with a warning and the previous good
one is used. Nothing is unpickled: tensors go through safetensors, everything else through JSON.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specgraft.utils.io import atomic_path, sha256_file

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def verify_checkpoint(folder: Path) -> str | None:
    """None if every file listed in the manifest is present with the right checksum, else the problem."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (partial write)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "unreadable manifest"
    for rel, info in manifest.items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != info["bytes"] or sha256_file(path) != info["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint folders of a run, newest first."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), reverse=True)


def latest_good_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt ones are reported and skipped."""
    for folder in list_checkpoints(output_dir):
        problem = verify_checkpoint(folder)
        if problem is None:
            return folder
        logger.warning("checkpoint %s is corrupt or partial (%s); falling back to the previous one", folder, problem)
    return None


# -- optimizer / RNG state without pickle ---------------------------------------------------------------------


def optimizer_to_tensors(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state_dict into a flat tensor dict and a JSON-able remainder."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in state_dict["state"].items():
        for name, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    groups = []
    for group in meta["param_groups"]:
        group = dict(group)
        if isinstance(group.get("betas"), list):  # JSON turns torch's tuple into a list
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    return {"state": state, "param_groups": groups}


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able data."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save_checkpoint(
    output_dir: Path,
    step: int,
    write_payload: Callable[[Path], None],
    optimizer_state: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep`` good ones.

    ``write_payload(folder)`` writes the model parts (head, adapter) into the temporary folder.
    If anything fails (including a full disk) the temporary folder is removed and older checkpoints are intact.
    """
    final = Path(output_dir) / CHECKPOINTS_DIR / checkpoint_name(step)
    with atomic_path(final) as tmp:
        tmp.mkdir(parents=True)
        write_payload(tmp)
        tensors, opt_meta = optimizer_to_tensors(optimizer_state)
        save_file(tensors, str(tmp / OPTIMIZER))
        state = dict(trainer_state)
        state["optimizer"] = opt_meta
        (tmp / STATE).write_text(json.dumps(state) + "\n", encoding="utf-8")
        write_manifest(tmp)
    for old in list_checkpoints(output_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint_state(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer_state, optimizer_state_dict) of a verified checkpoint folder."""
    state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    optimizer = optimizer_from_tensors(load_file(str(folder / OPTIMIZER)), state.pop("optimizer"))
    return state, optimizer
