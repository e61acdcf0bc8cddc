"""``specgraft push``: its arguments, and the command as a call of :func:`specgraft.export.push.push_folder`."""

from __future__ import annotations

import argparse

from specgraft.export.options import DEFAULT_TOKEN_ENV


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
    parser.add_argument("--base-model", metavar="ORG/NAME",
                        help="Hub id of the target, when the export recorded it as a local path (written into the "
                             "uploaded card, config.json and specgraft_export.json).")
    parser.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, metavar="VAR",
                        help=f"Environment variable holding the token (default {DEFAULT_TOKEN_ENV}; falls back to "
                             "the token saved by `hf auth login`).")


def run(args: argparse.Namespace) -> int:
    """Push the folder (or list what would be pushed) and print what went where."""
    from specgraft.export.push import CARD_NAME, format_size, push_folder

    plan, info = push_folder(args.dir, args.repo_id, private=args.private, revision=args.revision,
                             commit_message=args.commit_message, dry_run=args.dry_run, overwrite=args.overwrite,
                             token_env=args.token_env, base_model=args.base_model)
    for warning in plan.warnings:
        print(f"WARNING: {warning}")
    verb = "would upload" if args.dry_run else "uploaded"
    branch = args.revision or "main"
    visibility = "private" if (args.private if plan.private is None else plan.private) else "public"
    print(f"{verb} {len(plan.files)} files ({format_size(sum(s for _, s in plan.files))}) to {args.repo_id} "
          f"({visibility}, revision {branch}):")
    for name, size in plan.files:
        extra = f" (model card regenerated for {args.repo_id})" if name == CARD_NAME and plan.card_regenerated else ""
        print(f"  {name}  {format_size(size)}{extra}")
    if info is not None:
        url = getattr(info, "commit_url", None) or getattr(info, "oid", None)
        if url:
            print(f"commit: {url}")
    return 0
