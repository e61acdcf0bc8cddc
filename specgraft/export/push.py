"""Upload an exported head folder to the Hugging Face Hub.

``specgraft push DIR --repo-id ORG/NAME`` creates the repo (``--private`` to make it private; an existing public
repo is refused, since --private cannot change it), regenerates the folder's model card for that repo when the
folder was written by ``specgraft export``, and uploads the folder in one commit (``--revision`` for a branch,
``--commit-message``). ``--dry-run`` lists exactly what would be uploaded and touches nothing (no token, no
network). A repo that already has files is refused unless ``--overwrite``, which then makes the repo mirror the
folder (stale weight files would otherwise be loaded by engines).

Only the files the export's ``specgraft_manifest.json`` lists are uploaded, each checked to be a regular file
inside the folder (no symlink on the way) with the size and sha256 the export recorded; a folder without a
manifest (a head folder, ``/etc``) is refused. The regenerated card is
uploaded from memory and written into the folder only after the upload succeeded. An export whose target is
recorded as a local path is refused unless ``--base-model ORG/NAME`` gives its Hub id, which is then written into
the uploaded card, ``config.json`` (verifier / base model) and ``specgraft_export.json``.

The token comes from the environment variable named by ``--token-env`` (default ``HF_TOKEN``) or from
``hf auth login``; it is never printed or logged.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.export.exporter import (
    CARD_NAME,
    CONFIG_NAME,
    EXPORT_META_NAME,
    HUB_REPO_ID,
    card_from_export_meta,
    is_hub_id,
    read_export_meta,
    require_hub_base_model,
    vllm_name_warnings,
)
from specgraft.export.options import DEFAULT_TOKEN_ENV
from specgraft.utils.io import atomic_write_text
from specgraft.utils.outputs import MANIFEST_NAME, read_manifest, update_manifest

logger = logging.getLogger(__name__)

_REPO_ID = HUB_REPO_ID
#: Files a fresh Hub repo already holds.
_HUB_DEFAULT_FILES = (".gitattributes",)


@dataclass
class PushPlan:
    """What a push would do."""

    folder: Path
    repo_id: str
    files: list[tuple[str, int]] = field(default_factory=list)
    """(path relative to the folder, size in bytes), in upload order."""
    card_regenerated: bool = False
    warnings: list[str] = field(default_factory=list)
    contents: dict[str, str] = field(default_factory=dict)
    """Files uploaded with new text instead of the folder's (the regenerated card, a retargeted config)."""
    private: bool | None = None
    """The repo's visibility after the push (None before it)."""


def plan_push(folder: str | Path, repo_id: str, base_model: str | None = None) -> PushPlan:
    """The exact files ``push`` would upload from ``folder`` (hidden files, temporaries, caches and symlinks
    excluded) and the texts it would upload instead of the folder's."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecgraftError(f"{folder} is not a folder; pass the output folder of `specgraft export`")
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise SpecgraftError(f"repo id {repo_id!r} is not of the form ORG/NAME; e.g. --repo-id my-org/llama-eagle3")
    if base_model is not None:
        require_hub_base_model(base_model)
    # Exactly what the export wrote (each checked: inside the folder, no link, unchanged since), nothing else.
    listed = read_manifest(folder)
    files = [(name, (folder / name).stat().st_size) for name in sorted(listed)]
    skipped = sorted(p.relative_to(folder).as_posix() for p in folder.iterdir()
                     if not p.name.startswith(".") and p.name != MANIFEST_NAME and p.name not in listed
                     and not any(name.startswith(p.name + "/") for name in listed))
    if not files:
        raise SpecgraftError(f"{folder} holds no files to upload; export a head into it first")
    plan = PushPlan(folder, repo_id, files)
    if skipped:
        plan.warnings.append(f"skipped {', '.join(skipped[:5])}: not written by `specgraft export` (push uploads only "
                             f"the files {MANIFEST_NAME} lists)")
    if (folder / EXPORT_META_NAME).is_file():
        meta = read_export_meta(folder)
        base = base_model or str(meta.get("base_model") or "")
        if not is_hub_id(base):
            if meta["format"] != "native":
                raise SpecgraftError(f"the export records its target as {base!r}, not a Hub repo id, so its config "
                                     "and card would name a path no other machine has; pass --base-model ORG/NAME "
                                     "(the target's Hub id) or re-export with --base-model")
            plan.warnings.append(f"the target is recorded as {base!r}, not a Hub repo id: the card has no base_model; "
                                 "pass --base-model ORG/NAME")
        if base_model is not None:
            meta = dict(meta, base_model=base_model)
            plan.contents[EXPORT_META_NAME] = json.dumps(meta, indent=2, default=str) + "\n"
            config = _retargeted_config(folder / CONFIG_NAME, base_model)
            if config is not None:
                plan.contents[CONFIG_NAME] = config
        plan.contents[CARD_NAME] = card_from_export_meta(meta, repo_id)
        plan.card_regenerated = True
        if CARD_NAME not in {f for f, _ in files}:
            plan.files.append((CARD_NAME, 0))
        if meta["format"] == "vllm":
            plan.warnings += vllm_name_warnings(repo_id, meta["head_type"], what="repo id")
    elif CARD_NAME not in {f for f, _ in files}:
        plan.warnings.append(f"{folder} has no {CARD_NAME}: the repo will have no model card")
    plan.files = [(name, len(plan.contents[name].encode("utf-8")) if name in plan.contents else size)
                  for name, size in plan.files]
    return plan


def _retargeted_config(path: Path, base_model: str) -> str | None:
    """``config.json`` with the target named as ``base_model`` (Medusa's base model, EAGLE-3's verifier)."""
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    if "base_model_name_or_path" in config:
        config["base_model_name_or_path"] = base_model
    verifier = (config.get("speculators_config") or {}).get("verifier")
    if isinstance(verifier, dict):
        verifier["name_or_path"] = base_model
    return json.dumps(config, indent=2) + "\n"


def resolve_token(token_env: str = DEFAULT_TOKEN_ENV) -> str:
    """The Hub token from ``$token_env`` or the saved login; a clear error (never the token) when there is none."""
    token = os.environ.get(token_env) or None
    if token is None:
        from huggingface_hub import get_token

        token = get_token()
    if not token:
        raise SpecgraftError(f"no Hugging Face token found: set {token_env} to a write token (or name another "
                             "variable with --token-env), or log in once with `hf auth login`")
    return token


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    token_env: str = DEFAULT_TOKEN_ENV,
    base_model: str | None = None,
) -> tuple[PushPlan, Any]:
    """Push ``folder`` to ``repo_id`` (see the module docstring); returns the plan and the commit info (None for a
    dry run)."""
    plan = plan_push(folder, repo_id, base_model)
    if dry_run:
        return plan, None
    token = resolve_token(token_env)
    import huggingface_hub
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError

    api = huggingface_hub.HfApi(token=token)
    try:
        api.whoami()
    except HfHubHTTPError as exc:
        raise SpecgraftError(f"the Hugging Face token was rejected ({_scrub(exc, token)}); log in again with "
                             "`hf auth login` or set a valid write token") from None
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        plan.private = bool(getattr(api.repo_info(repo_id=repo_id, repo_type="model"), "private", private))
        if private and not plan.private:
            raise SpecgraftError(f"{repo_id} exists and is public; --private cannot change an existing repo: make it "
                                 "private in its Settings on the Hub first, or push to a new repo id")
        if revision:
            api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
        existing = [f for f in api.list_repo_files(repo_id=repo_id, repo_type="model", revision=revision)
                    if f not in _HUB_DEFAULT_FILES]
        if existing and not overwrite:
            raise SpecgraftError(f"{repo_id} already has files ({', '.join(sorted(existing)[:5])}); pass --overwrite "
                                 "to replace the repo's content with this folder, or push to a new repo")
        names = [name for name, _ in plan.files]
        operations: list[Any] = [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=plan.contents[name].encode("utf-8")
                               if name in plan.contents else str(plan.folder / name))
            for name in names]
        # --overwrite: the repo mirrors the folder, so stale files (old weights engines would load) go.
        operations += [CommitOperationDelete(path_in_repo=f) for f in existing if f not in names]
        message = commit_message or f"Upload {plan.folder.name} with specgraft"
        info = api.create_commit(repo_id=repo_id, repo_type="model", revision=revision, operations=operations,
                                 commit_message=message)
    except HfHubHTTPError as exc:
        raise SpecgraftError(f"the Hub refused the upload to {repo_id} ({_scrub(exc, token)}); check that the token "
                             "can write to that organisation") from None
    # Only now that the repo has them: the folder keeps mirroring what was published.
    for name, text in plan.contents.items():
        atomic_write_text(plan.folder / name, text)
    update_manifest(plan.folder, plan.contents)
    return plan, info


def _scrub(exc: BaseException, token: str) -> str:
    """The first line of an error message with the token masked (Hub errors can echo request headers)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.replace(token, "***") if token else text


def format_size(n: int) -> str:
    """``n`` bytes as push prints them (B, KB, MB or GB)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
