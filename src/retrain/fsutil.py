"""Atomic file-system operations: nothing is left half-written.

Files are written to a temporary sibling, flushed and renamed over the target.  A directory is
built beside its target and exchanged with it in one ``renameat2(RENAME_EXCHANGE)`` call where
the kernel offers it (Linux >= 3.15), so a reader or a kill sees either the old or the new tree.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import orjson

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def dumps_canonical(obj: Any) -> str:
    """Deterministic JSON: sorted keys, two-space indent, a trailing newline.

    orjson (C) rather than ``json``: with an indent, ``json`` falls back to its pure-Python encoder, which
    costs seconds on a 100k-image master. orjson writes a NaN as ``null``: callers pass finite numbers only
    (ingest refuses non-finite boxes before anything is written).
    """
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE).decode()


def fsync_dir(path: Path) -> None:
    """Flush a directory entry so a rename in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file, fsync, rename).

    Args:
        path: The target file; its parent is created if needed.
        text: UTF-8 content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2; False when the platform cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, target: Path) -> None:
    """Put the directory ``new`` at ``target``, replacing what is there, atomically.

    Args:
        new: A complete directory on the same file system as ``target``.
        target: Where it must end up; the old tree there is deleted after the swap.
    """
    fsync_dir(new)
    if not target.exists():
        os.rename(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new)  # ``new`` now holds the old tree
    else:
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old)
    fsync_dir(target.parent)
