"""Writes that a full disk cannot leave half done, and the one line that says so.

A run's appended files (``metrics.csv``, ``samples.jsonl``) get whole lines or nothing: a write that fails part
way (no space left, a file-size limit, a vanished or read-only directory) is cut back to where it began. The
error is a :class:`NotWritten` naming the file, the space left on its disk and, when known, the space needed.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from torchrl_grpo.core.errors import RunError, one_line


class NotWritten(RunError):
    """A file of the run could not be written (the run stops; what was written before stays whole)."""


def append_whole(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (created if missing) in full, or not at all (:func:`not_written` on failure)."""
    data = memoryview(text.encode("utf-8"))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise not_written(path, err) from None
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as err:
            os.ftruncate(fd, start)  # never a line cut short
            raise not_written(path, err) from None
    finally:
        os.close(fd)


def write_replacing(path: Path, text: str) -> None:
    """``path``'s content replaced by ``text`` atomically (a temporary sibling renamed over it): the old content
    stays whole when the write fails (:func:`not_written`)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise not_written(path, err) from None


def remove_tree(path: Path, aside: str) -> None:
    """Delete folder ``path`` after renaming it to ``aside`` (a sibling name): the rename is atomic, so its name is
    free at once and a kill during the delete leaves only the ``aside`` folder, never ``path`` half gone. Nothing
    there (or a rename that fails): nothing is done."""
    moved = path.with_name(aside)
    try:
        os.replace(path, moved)
    except OSError:
        return
    shutil.rmtree(moved, ignore_errors=True)


def not_written(path: Path, err: Exception, needed: int | None = None) -> NotWritten:
    """The one line for ``path`` that could not be written: the reason, the space left where it goes and, when
    given, about how much is ``needed``."""
    free = free_bytes(path)
    room = "its folder is gone" if free is None else f"{size_text(free)} free there"
    if needed is not None:
        room += f", about {size_text(needed)} needed"
    return NotWritten(f"{path} could not be written ({one_line(err)}; {room})")


def free_bytes(path: Path) -> int | None:
    """Free space on the disk of ``path`` (a folder, or a file's folder); None when that folder is gone."""
    folder = path if path.is_dir() else path.parent
    return shutil.disk_usage(folder).free if folder.is_dir() else None


def tree_bytes(root: Path) -> int:
    """The bytes of the files under ``root`` (0 when it is gone)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
