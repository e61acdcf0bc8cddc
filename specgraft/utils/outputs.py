"""The one guard every command that writes an output folder or file goes through.

``--overwrite`` replaces only what the same command wrote before, never an input and never anything else:

* every output is **marked**: a folder holds :data:`MARKER_NAME` naming the command that wrote it; a file gets a
  hidden sidecar ``.<name>.specgraft-output.json`` beside it (also the file's lock);
* :func:`check_output` refuses an output path that equals or contains one of the command's inputs, a non-empty
  folder (or an existing file) without ``--overwrite``, and with ``--overwrite`` anything that does not carry this
  command's marker;
* :func:`writing_output` wraps a whole write: the folder lock of :func:`~specgraft.utils.io.output_lock` (one
  writer at a time), the check, and the marker.

Exports also record what they wrote in a **manifest** (:func:`write_manifest`): ``push`` uploads exactly the listed
files (checked by size and sha256) and refuses a folder without one, so nothing the export did not write (a
link to a token file, the rest of ``/etc``) can reach a public upload.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from specgraft.errors import SpecgraftError
from specgraft.utils.io import (
    CARRIED_OVER,
    OUTPUT_MARKER_NAME,
    atomic_write_text,
    folder_has_content,
    output_lock,
    sha256_file,
)

#: The marker file an output folder carries (names the command that wrote it).
MARKER_NAME = OUTPUT_MARKER_NAME
#: The manifest an export writes: every file it wrote, with size and sha256.
MANIFEST_NAME = "specgraft_manifest.json"


def marker_path(out: Path, file: bool) -> Path:
    """Where ``out``'s marker lives: inside a folder, beside a file."""
    return out.parent / f".{out.name}.specgraft-output.json" if file else out / MARKER_NAME


def marked_by(out: Path, file: bool = False) -> str | None:
    """The command recorded in ``out``'s marker, or None (no marker, or not one of ours)."""
    marker = marker_path(out, file)
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        command = json.loads(marker.read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        return None
    return command if isinstance(command, str) else None


def mark_output(out: Path, command: str, file: bool = False) -> None:
    """Record that ``command`` wrote ``out`` (a folder, created if needed, or a file)."""
    text = json.dumps({"command": command}) + "\n"
    if not file:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(marker_path(out, file), text)
        return
    # A file's marker is also its lock file (:func:`writing_output`): rewritten in place, so the locked inode stays.
    with open(marker_path(out, file), "a+", encoding="utf-8") as fh:
        fh.seek(0)
        fh.truncate()
        fh.write(text)


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.realpath(path)))


def check_output(out: str | os.PathLike, command: str, *, overwrite: bool,
                 inputs: Iterable[str | os.PathLike | None] = (), file: bool = False, flag: str = "--out") -> bool:
    """Refuse (one :class:`SpecgraftError` line) an output the command may not write; True when it replaces an
    earlier output of the same ``command`` (which the caller may then delete or overwrite).

    ``inputs``: the paths the command reads (Hub ids and None are skipped): the output may neither be one of them
    nor contain one. ``file``: the output is a file (else a folder).
    """
    out = Path(out)
    require_utf8_path(out, flag)
    refuse_inputs(out, inputs, flag)
    if file:
        if out.is_dir():
            raise SpecgraftError(f"{flag} {out} is a folder; pass a file path")
        if not out.exists() and not out.is_symlink():
            return False
    else:
        if out.exists() and not out.is_dir():
            raise SpecgraftError(f"{flag} {out} is a file; pass a folder path (it is created)")
        if not folder_has_content(out):
            return False
    if not overwrite:
        what = "exists" if file else "exists and is not empty"
        raise SpecgraftError(f"{flag} {out} {what}; pass --overwrite to replace an earlier `specgraft {command}` "
                             f"output, or choose another {flag}")
    owner = marked_by(out, file)
    if out.is_symlink() or owner != command:
        written = f"by `specgraft {owner}`" if owner else "by another program (it has no specgraft output marker)"
        raise SpecgraftError(f"{flag} {out} was written {written}; --overwrite replaces only an earlier "
                             f"`specgraft {command}` output: choose another {flag} (or delete it yourself)")
    return True


def require_utf8_path(path: Path, flag: str = "--out") -> None:
    """Refuse an output path that is not valid UTF-8 (undecodable bytes Python keeps as surrogates): safetensors,
    which writes the weights and checkpoints, cannot open such a path, and would fail only after the work."""
    try:
        os.fsdecode(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsdecode(path).encode("utf-8", "backslashreplace").decode("utf-8")
        raise SpecgraftError(f"{flag} {shown} is not valid UTF-8; choose a path whose names are UTF-8 (safetensors "
                             "cannot write elsewhere)") from None


def refuse_inputs(out: Path, inputs: Iterable[str | os.PathLike | None], flag: str = "--out") -> None:
    """Refuse an output path that is one of ``inputs`` or contains one (Hub ids and None are skipped)."""
    where = _resolved(out)
    for given in inputs:
        if given is None or not os.path.exists(given):
            continue
        source = _resolved(given)
        if source == where:
            raise SpecgraftError(f"{flag} {out} is the input {given}; write the output elsewhere (an input is never "
                                 "replaced)")
        if where in source.parents:
            raise SpecgraftError(f"{flag} {out} contains the input {given}; choose an output path that holds no "
                                 "input")


def clear_output(folder: Path) -> None:
    """Empty an output folder that :func:`check_output` accepted for replacement (keeps the lock and marker)."""
    for child in folder.iterdir():
        if child.name in CARRIED_OVER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@contextlib.contextmanager
def writing_output(out: str | os.PathLike, command: str, *, overwrite: bool,
                   inputs: Iterable[str | os.PathLike | None] = (), file: bool = False, flag: str = "--out",
                   clear: bool = False) -> Iterator[bool]:
    """Lock ``out`` (one writer at a time), check it (:func:`check_output`), mark it, and yield whether it replaces
    an earlier output; ``clear``: empty a replaced folder first. The marker is written again at the end, since an
    atomic writer swaps in a fresh folder."""
    out = Path(out)
    # Checked before the lock too: a refused folder gets no lock file.
    check_output(out, command, overwrite=overwrite, inputs=inputs, file=file, flag=flag)
    lock = file_lock(out, command) if file else output_lock(out, f"`specgraft {command}`")
    with lock:
        replacing = check_output(out, command, overwrite=overwrite, inputs=inputs, file=file, flag=flag)
        if replacing and clear and not file:
            clear_output(out)
        mark_output(out, command, file)
        yield replacing
        mark_output(out, command, file)


@contextlib.contextmanager
def file_lock(out: Path, command: str, keep: Path | None = None) -> Iterator[None]:
    """:func:`~specgraft.utils.io.output_lock` for a file output: its marker beside it is the lock file. A run
    that leaves neither ``out`` nor ``keep`` (a resumable run's parts) behind removes it again."""
    marker = marker_path(out, file=True)
    with output_lock(out.parent, f"`specgraft {command}`", name=marker.name):
        try:
            yield
        finally:  # only by the holder: a refused second writer never touches the first one's lock
            if not out.exists() and not (keep is not None and keep.exists()):
                marker.unlink(missing_ok=True)


# -- manifests ---------------------------------------------------------------------------------------------------


def write_manifest(folder: Path, files: Iterable[str], command: str) -> None:
    """Record ``files`` (relative to ``folder``, all written by ``command``) with their size and sha256."""
    entries = {}
    for name in sorted(set(files)):
        path = folder / name
        entries[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    text = json.dumps({"written_by": f"specgraft {command}", "files": entries}, indent=1) + "\n"
    (folder / MANIFEST_NAME).write_text(text, encoding="utf-8")


def read_manifest(folder: Path) -> dict[str, dict[str, object]]:
    """The files ``folder``'s manifest lists, each checked: a regular file inside the folder (no link on the way)
    with the recorded size and sha256. Refuses a folder without a manifest."""
    manifest = folder / MANIFEST_NAME
    fix = "push uploads only what `specgraft export` wrote: export the head into a fresh folder and push that"
    if manifest.is_symlink() or not manifest.is_file():
        raise SpecgraftError(f"{folder} has no {MANIFEST_NAME}, so it is not the output of `specgraft export`; {fix}")
    try:
        entries = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecgraftError(f"{manifest} is not a specgraft manifest ({exc}); {fix}") from None
    if not isinstance(entries, dict):
        raise SpecgraftError(f"{manifest} is not a specgraft manifest (files is not an object); {fix}")
    root = _resolved(folder)
    for name, info in entries.items():
        rel = Path(name)
        if not isinstance(info, dict) or rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise SpecgraftError(f"{manifest} lists {name!r}, which is not a file inside the folder; {fix}")
        if any((folder / Path(*rel.parts[:i + 1])).is_symlink() for i in range(len(rel.parts))):
            raise SpecgraftError(f"{folder / name} is a symlink; push never follows links; {fix}")
        path = folder / rel
        if not path.is_file() or root not in _resolved(path).parents:
            raise SpecgraftError(f"{folder / name} listed in {MANIFEST_NAME} is missing; {fix}")
        if path.stat().st_size != info.get("bytes") or sha256_file(path) != info.get("sha256"):
            raise SpecgraftError(f"{folder / name} changed since `specgraft export` wrote it (size or sha256 differs "
                                 f"from {MANIFEST_NAME}); {fix}")
    return entries


def update_manifest(folder: Path, names: Iterable[str]) -> None:
    """Re-record ``names`` after specgraft itself rewrote them (push writes back the card it uploaded)."""
    manifest = folder / MANIFEST_NAME
    data = json.loads(manifest.read_text(encoding="utf-8"))
    for name in names:
        path = folder / name
        data["files"][name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    atomic_write_text(manifest, json.dumps(data, indent=1) + "\n")


# -- reading a folder without following links out of it -----------------------------------------------------------


def files_inside(root: Path, names: Iterable[str], what: str) -> list[str]:
    """Of ``names`` (paths relative to ``root``; a folder stands for every file under it, not descending into
    linked folders), the files that exist, relative to ``root``. Refuses (one line) any file or folder reached
    through a symlink that leads outside ``root``: a command that copies or reads them must never pick up a token
    file or an SSH folder a link points at."""
    base = _resolved(root)

    def check(path: Path) -> None:
        if path.is_symlink() and base != _resolved(path) and base not in _resolved(path).parents:
            raise SpecgraftError(f"{path} is a symlink to {os.path.realpath(path)}, outside {root}; {what} never "
                                 "follows links out of the folder it reads: replace the link with the file itself")

    found: list[str] = []
    for name in names:
        path = root / name
        for i in range(len(Path(name).parts)):
            check(root / Path(*Path(name).parts[:i + 1]))
        if path.is_file():
            found.append(name)
        elif path.is_dir():
            for folder, dirs, files in os.walk(path, followlinks=False):
                for entry in [*dirs, *files]:
                    check(Path(folder) / entry)
                found += [str((Path(folder) / f).relative_to(root)) for f in sorted(files)
                          if (Path(folder) / f).is_file()]
    return found
