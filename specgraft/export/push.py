"""Upload an exported head folder to the Hugging Face Hub.

``specgraft push DIR --repo-id ORG/NAME`` creates the repo (``--private`` to make it private), regenerates the
folder's model card for that repo when the folder was written by ``specgraft export``, and uploads the folder in
one commit (``--revision`` for a branch, ``--commit-message``). ``--dry-run`` lists exactly what would be uploaded
and touches nothing (no token, no network). A repo that already has files is refused unless ``--overwrite``, which
then makes the repo mirror the folder (stale weight files would otherwise be loaded by engines).

The token comes from the environment variable named by ``--token-env`` (default ``HF_TOKEN``) or from
``hf auth login``; it is never printed or logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.export.exporter import (
    CARD_NAME,
    EXPORT_META_NAME,
    card_from_export_meta,
    read_export_meta,
    vllm_name_warnings,
)
from specgraft.utils.io import atomic_write_text

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_ENV = "HF_TOKEN"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: Files never uploaded: temporaries of atomic writes, caches, VCS metadata.
_SKIP_PARTS = ("__pycache__", ".git", ".cache")
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft push``."""
    parser.add_argument("dir", metavar="DIR", help="A folder written by `specgraft export`.")
    parser.add_argument("--repo-id", required=True, metavar="ORG/NAME", help="The Hub model repo to push to.")
    parser.add_argument("--private", action="store_true", help="Create the repo as private.")
    parser.add_argument("--revision", metavar="BRANCH", help="Branch to commit to (created if missing).")
    parser.add_argument("--commit-message", metavar="M", help="Commit message.")
    parser.add_argument("--dry-run", action="store_true", help="List what would be uploaded and stop.")
    parser.add_argument("--overwrite", action="store_true",
                        help="Push into a repo that already has files (the repo then mirrors the folder).")
    parser.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, metavar="VAR",
                        help=f"Environment variable holding the token (default {DEFAULT_TOKEN_ENV}; falls back to "
                             "the token saved by `hf auth login`).")


def plan_push(folder: str | Path, repo_id: str) -> PushPlan:
    """The exact files ``push`` would upload from ``folder`` (hidden files, temporaries and caches excluded)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecgraftError(f"{folder} is not a folder; pass the output folder of `specgraft export`")
    if not _REPO_ID.match(repo_id):
        raise SpecgraftError(f"repo id {repo_id!r} is not of the form ORG/NAME; e.g. --repo-id my-org/llama-eagle3")
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") or part in _SKIP_PARTS for part in rel.parts):
            continue
        files.append((rel.as_posix(), path.stat().st_size))
    if not files:
        raise SpecgraftError(f"{folder} holds no files to upload; export a head into it first")
    plan = PushPlan(folder, repo_id, files)
    if (folder / EXPORT_META_NAME).is_file():
        meta = read_export_meta(folder)
        plan.card_regenerated = True
        if CARD_NAME not in {f for f, _ in files}:
            plan.files.append((CARD_NAME, 0))
        if meta["format"] == "vllm":
            plan.warnings += vllm_name_warnings(repo_id, meta["head_type"], what="repo id")
    elif CARD_NAME not in {f for f, _ in files}:
        plan.warnings.append(f"{folder} has no {CARD_NAME}: the repo will have no model card")
    return plan


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
) -> tuple[PushPlan, Any]:
    """Push ``folder`` to ``repo_id`` (see the module docstring); returns the plan and the commit info (None for a
    dry run)."""
    plan = plan_push(folder, repo_id)
    if dry_run:
        return plan, None
    token = resolve_token(token_env)
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    api = huggingface_hub.HfApi(token=token)
    try:
        api.whoami()
    except HfHubHTTPError as exc:
        raise SpecgraftError(f"the Hugging Face token was rejected ({_scrub(exc, token)}); log in again with "
                             "`hf auth login` or set a valid write token") from None
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
        existing = [f for f in api.list_repo_files(repo_id=repo_id, repo_type="model", revision=revision)
                    if f not in _HUB_DEFAULT_FILES]
        if existing and not overwrite:
            raise SpecgraftError(f"{repo_id} already has files ({', '.join(sorted(existing)[:5])}); pass --overwrite "
                                 "to replace the repo's content with this folder, or push to a new repo")
        if plan.card_regenerated:
            atomic_write_text(plan.folder / CARD_NAME, card_from_export_meta(read_export_meta(plan.folder), repo_id))
        message = commit_message or f"Upload {plan.folder.name} with specgraft"
        info = api.upload_folder(
            folder_path=str(plan.folder), repo_id=repo_id, repo_type="model", revision=revision,
            commit_message=message, allow_patterns=[name for name, _ in plan.files],
            delete_patterns=["*"] if overwrite and existing else None,
        )
    except HfHubHTTPError as exc:
        raise SpecgraftError(f"the Hub refused the upload to {repo_id} ({_scrub(exc, token)}); check that the token "
                             "can write to that organisation") from None
    return plan, info


def _scrub(exc: BaseException, token: str) -> str:
    """The first line of an error message with the token masked (Hub errors can echo request headers)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.replace(token, "***") if token else text


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    """Run ``specgraft push``."""
    plan, info = push_folder(args.dir, args.repo_id, private=args.private, revision=args.revision,
                             commit_message=args.commit_message, dry_run=args.dry_run, overwrite=args.overwrite,
                             token_env=args.token_env)
    for warning in plan.warnings:
        print(f"WARNING: {warning}")
    verb = "would upload" if args.dry_run else "uploaded"
    branch = args.revision or "main"
    visibility = "private" if args.private else "public"
    print(f"{verb} {len(plan.files)} files ({_size(sum(s for _, s in plan.files))}) to {args.repo_id} "
          f"({visibility}, revision {branch}):")
    for name, size in plan.files:
        extra = f" (model card regenerated for {args.repo_id})" if name == CARD_NAME and plan.card_regenerated else ""
        print(f"  {name}  {_size(size)}{extra}")
    if info is not None:
        url = getattr(info, "commit_url", None) or getattr(info, "oid", None)
        if url:
            print(f"commit: {url}")
    return 0
