"""Atomic writes: a file or folder either appears complete or not at all; a lock for one writer per folder."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    Works for files and folders. On error the temporary is removed and ``path`` is untouched.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=suffix + ".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.unlink()
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink():
            # os.replace cannot replace a non-empty folder: move the old one aside first, then drop it.
            old = final.with_name(f".{final.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise


def check_output_folder(out: Path, overwrite: bool, flag: str = "--out") -> None:
    """Refuse an output path that is a file, or a non-empty folder unless ``overwrite`` (checked before work)."""
    if out.exists() and not out.is_dir():
        raise SpecgraftError(f"output path {out} is a file; pass a folder path for {flag}")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise SpecgraftError(f"output folder {out} is not empty; pass --overwrite or choose another {flag}")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + fsync + rename)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False, default=str) + "\n")


def read_json_meta(file: Path, required: tuple[str, ...], fix: str) -> dict[str, Any]:
    """Read a metadata JSON file that must hold ``required`` keys; one-line errors end with ``fix``."""
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecgraftError(f"{file} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(meta, dict):
        raise SpecgraftError(f"{file} is not a JSON object; {fix}")
    for key in required:
        if key not in meta:
            raise SpecgraftError(f"{file} lacks {key!r}; {fix}")
    return meta


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks (checkpoint and feature-cache shards can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: The lock file :func:`output_lock` keeps in a folder while a command writes there.
LOCK_NAME = ".specgraft.lock"


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, what: str = "this folder") -> Iterator[Path]:
    """Hold an exclusive lock on ``folder`` (created) while the block writes into it; a second writer fails at
    once with a one-line error instead of mixing its files with the first one's.

    The lock is an ``flock`` on ``folder/.specgraft.lock``: the OS releases it when the process dies, so a killed
    run leaves no stale lock (the empty file itself stays; push and the non-empty checks ignore it). Without
    ``fcntl`` (Windows) the block runs unlocked.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    try:
        import fcntl
    except ImportError:  # pragma: no cover (Windows)
        yield lock
        return
    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise SpecgraftError(f"another specgraft process is writing to {folder} ({what}); wait for it to "
                                     "finish or choose another output folder") from None
            raise
        try:
            yield lock
        finally:
            # The (empty, hidden) file stays: unlinking it would let a third writer lock a new file while a
            # second one holds the unlinked one.
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def folder_has_content(folder: str | os.PathLike) -> bool:
    """True when ``folder`` exists and holds anything besides :func:`output_lock`'s lock file."""
    folder = Path(folder)
    return folder.is_dir() and any(p.name != LOCK_NAME for p in folder.iterdir())
