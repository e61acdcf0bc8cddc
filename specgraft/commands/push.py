"""``specgraft push``'s arguments; the command is :func:`specgraft.export.push.run`."""

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
    """The command itself, in :mod:`specgraft.export.push` (imported only now: it loads torch)."""
    from specgraft.export.push import run as push

    return push(args)
