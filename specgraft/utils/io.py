"""Atomic writes: a file or folder either appears complete or not at all; a lock for one writer per folder."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError

#: The lock file :func:`output_lock` keeps in a folder while a command writes there.
LOCK_NAME = ".specgraft.lock"
#: The marker naming the command that wrote an output folder (see :mod:`specgraft.utils.outputs`).
OUTPUT_MARKER_NAME = ".specgraft-output.json"
#: Bookkeeping files :func:`atomic_path` moves from a replaced folder into its successor: the lock and the output
#: marker of :mod:`specgraft.utils.outputs`.
CARRIED_OVER = (LOCK_NAME, OUTPUT_MARKER_NAME)


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
            # The lock and output marker move into the new folder (a rename keeps the locked inode, so a second
            # writer still finds it held).
            for name in CARRIED_OVER:
                if tmp.is_dir() and (final / name).is_file() and not (tmp / name).exists():
                    os.replace(final / name, tmp / name)
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


class _NonFinite(ValueError):
    """A ``NaN``/``Infinity`` literal in a JSON file (valid for Python's json, never a measured number)."""


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


def read_json_meta(file: Path, required: tuple[str, ...], fix: str) -> dict[str, Any]:
    """Read a metadata JSON file that must hold ``required`` keys; one-line errors end with ``fix``. ``NaN`` and
    ``Infinity`` literals are refused."""
    try:
        meta = json.loads(file.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecgraftError(f"{file} is not valid JSON ({exc}); {fix}") from None
    except _NonFinite as exc:
        raise SpecgraftError(f"{file} holds {exc.args[0]}, which is not a finite number; {fix}") from None
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




@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, what: str = "this folder", name: str = LOCK_NAME) -> Iterator[Path]:
    """Hold an exclusive lock on ``folder`` (created) while the block writes into it; a second writer fails at
    once with a one-line error instead of mixing its files with the first one's.

    The lock is an ``flock`` on ``folder/.specgraft.lock``: the OS releases it when the process dies, so a killed
    run leaves no stale lock (the empty file itself stays; push and the non-empty checks ignore it). Without
    ``fcntl`` (Windows) the block runs unlocked. ``name``: another lock file (a file output locks
    ``.<file name>.lock`` beside it).
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise SpecgraftError(f"{folder} is a file, not a folder; pass a folder path (it is created)")
    # The folders this lock creates (the missing ones along the path), removed again when nothing was written.
    created = [f for f in (folder, *folder.parents) if not f.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError):
        raise SpecgraftError(f"cannot create the folder {folder}: a component of the path is a file, not a "
                             "folder; fix the path") from None
    lock = folder / name
    if importlib.util.find_spec("fcntl") is None:  # pragma: no cover (Windows)
        yield lock
        return
    try:
        with _locked(lock, folder, what):
            yield lock
    finally:
        # A folder this lock created that nothing was written into (a refused or failed run) does not stay.
        if created and folder.is_dir() and not folder_has_content(folder):
            shutil.rmtree(folder, ignore_errors=True)
            for parent in created[1:]:
                with contextlib.suppress(OSError):  # not empty: something else was written there
                    parent.rmdir()


@contextlib.contextmanager
def _locked(lock: Path, folder: Path, what: str) -> Iterator[None]:
    import fcntl

    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise SpecgraftError(f"another specgraft process is writing to {folder} ({what}); wait for it to "
                                     "finish or choose another output folder") from None
            raise
        try:
            yield
        finally:
            # The (empty, hidden) file stays: unlinking it would let a third writer lock a new file while a
            # second one holds the unlinked one.
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def folder_has_content(folder: str | os.PathLike) -> bool:
    """True when ``folder`` exists and holds anything besides :func:`output_lock`'s lock file and the output
    marker."""
    folder = Path(folder)
    return folder.is_dir() and any(p.name not in CARRIED_OVER for p in folder.iterdir())


def iter_lines_limited(path: str | os.PathLike, max_line_bytes: int, max_total_bytes: int | None = None,
                       what: str = "file") -> Iterator[bytes]:
    """The lines of a text file (``.gz``: decompressed as it is read), refusing a line longer than
    ``max_line_bytes`` or more than ``max_total_bytes`` in all before holding them: a small compressed file can
    expand to gigabytes, and a line is otherwise read whole before anything can look at it."""
    import gzip
    import zlib

    path = Path(path)
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    total = 0
    with opener(path, "rb") as fh:
        while True:
            try:
                line = fh.readline(max_line_bytes + 1)
            except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
                raise SpecgraftError(f"{what} {path} is not a complete gzip file ({type(exc).__name__}: {exc}); "
                                     "re-download or re-compress it") from None
            if not line:
                return
            total += len(line)
            if len(line) > max_line_bytes:
                raise SpecgraftError(f"{what} {path} has a line longer than {max_line_bytes >> 20} MiB (decompressed); "
                                     "pass a file with one record per line")
            if max_total_bytes is not None and total > max_total_bytes:
                raise SpecgraftError(f"{what} {path} holds more than {max_total_bytes >> 20} MiB of text "
                                     "(decompressed); pass a smaller file")
            yield line


def require_file(path: Path, what: str, fix: str, error: type[SpecgraftError] = SpecgraftError) -> None:
    """Refuse ``path`` unless it is a regular file, saying what it is instead: missing, a folder, or a device or
    pipe (``what``: how the message names it, ``fix``: the end of the message, ``error``: the exception type)."""
    if path.is_dir():
        raise error(f"{what} {path} is a folder, not a file; {fix}")
    if path.exists() and not path.is_file():
        raise error(f"{what} {path} is not a regular file (a device, pipe or socket); {fix}")
    if not path.is_file():
        raise error(f"{what} {path} does not exist; {fix}")
