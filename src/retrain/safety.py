"""Opening what a batch names, safely: file names that must stay inside their root, and PIL's own image opener.

Shared by the batch checks, the master's loaders and the served model: every file name that comes from a batch's
labels goes through ``safe_member`` before it is opened.
"""

from __future__ import annotations

import io
import stat
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath

from PIL import Image


class UnsafePath(ValueError):
    """A file name that is empty, absolute, escapes its root, is missing or is no regular file."""



def safe_member(root: Path, base: Path, name: str) -> Path:
    """Resolve a file name and make sure it stays inside ``root``.

    Args:
        root: The folder nothing may escape (resolved).
        base: The folder ``name`` is relative to.
        name: The name as written.

    Returns:
        The resolved path of a regular file inside ``root``.

    Raises:
        UnsafePath: Why the name is refused.
    """
    if not name or "\x00" in name:
        raise UnsafePath("empty file name")
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        raise UnsafePath("absolute path: files must be named relative to the batch")
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise UnsafePath("'..' in path: files must stay inside the batch")
    try:
        resolved = (base / name).resolve(strict=True)
    except FileNotFoundError as e:
        raise UnsafePath("file not found") from e
    except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop
        raise UnsafePath(f"cannot be resolved ({e})") from e
    if not resolved.is_relative_to(root):
        raise UnsafePath(f"resolves outside the batch (to {resolved}); symlinks must stay inside the batch")
    if not stat.S_ISREG(resolved.stat().st_mode):
        raise UnsafePath("not a regular file (directory, FIFO or device)")
    return resolved


def pil_open(fp: io.BytesIO) -> Image.Image:
    """PIL's own ``Image.open``, also when ultralytics has been imported in this process.

    Importing ultralytics replaces ``PIL.Image.open`` with a wrapper that, on an unidentified file, installs and
    registers the HEIF plugin (``check_requirements('pi-heif')``: a pip install at run time, or a
    ``ModuleNotFoundError`` offline).  A validator must never install anything, and HEIF is not an accepted
    format, so the check calls the original function that the wrapper keeps.
    """
    patches = sys.modules.get("ultralytics.utils.patches")
    opener = getattr(patches, "_image_open", None) if patches is not None else None
    return (opener or Image.open)(fp)
