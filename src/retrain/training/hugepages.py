"""Transparent huge pages for the training process's malloc'd memory (glibc's ``glibc.malloc.hugetlb`` tunable).

A training step streams through activation buffers of tens of MB each (PyTorch's CPU tensors are malloc'd).
With 4 KiB pages every pass through them walks the page tables again; with 2 MiB pages it barely does.  The
kernel backs memory with huge pages only where the process asks (``madvise``, this machine's and most
distributions' default mode), and glibc's malloc asks only when its ``glibc.malloc.hugetlb=1`` tunable is set,
which glibc reads once, when the process starts.  So ``retrain train`` sets it and re-executes itself (same pid,
same arguments) before anything heavy is imported.  What a step gains by it is in ``bench/RESULTS.md`` ("measured
in development"); ``bench/train_throughput.py`` trains ours with it, as here.

Nothing is changed where it would do nothing or could not work: another OS or C library, glibc older than 2.35,
the kernel's THP mode ``always`` (the heap gets huge pages anyway) or ``never``, ``runtime.hugepages: off``, or the
tunable already set (by the user, or by the first execution).  Only this process and its children (DDP ranks,
loader workers) are affected.  This module imports nothing heavy: it runs before torch is loaded.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``); None where unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else None


def glibc_version() -> tuple[int, int] | None:
    """glibc's (major, minor), or None where the C library is another one."""
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return None
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def applied(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``env`` already sets the tunable (to anything: a user's own value is kept)."""
    return any(item.split("=", 1)[0] == TUNABLE for item in env.get("GLIBC_TUNABLES", "").split(":"))


def why_not(setting: str, mode: str | None = None, glibc: tuple[int, int] | None = None) -> str | None:
    """Why huge pages are not asked for (a phrase for the log), or None when they should be.

    Args:
        setting: ``runtime.hugepages`` (``auto`` or ``off``).
        mode: The kernel's THP mode (default: read it).
        glibc: glibc's version (default: this process's).
    """
    if setting == "off":
        return "runtime.hugepages is off"
    if sys.platform != "linux":
        return f"not Linux ({sys.platform})"
    glibc = glibc if glibc is not None else glibc_version()
    if glibc is None or glibc < (2, 35):
        return "the C library is not glibc 2.35 or newer"
    mode = mode if mode is not None else thp_mode()
    if mode != "madvise":
        return f"the kernel's transparent huge pages are '{mode or 'unknown'}' (only 'madvise' needs asking)"
    return None


def with_tunable(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` whose ``GLIBC_TUNABLES`` also sets ``glibc.malloc.hugetlb=1`` (other tunables kept)."""
    out = dict(env)
    items = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
    out["GLIBC_TUNABLES"] = ":".join([*items, f"{TUNABLE}=1"])
    return out


def reexec(setting: str) -> None:
    """Re-execute this process with the tunable set, when huge pages are wanted and not yet asked for.

    Returns only when nothing is to be done or ``execve`` failed (then training goes on without them); otherwise
    the process image is replaced: same pid, same arguments, same environment plus the tunable.  Call it before
    torch is imported (the time spent importing is lost) and before anything is written.
    """
    if applied() or why_not(setting) is not None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, with_tunable(os.environ))
    except OSError as e:  # pragma: no cover - exec of the running interpreter failing is exotic
        log.warning("huge pages: could not re-execute %s (%s); training without them", sys.executable, e)


def describe(setting: str) -> str:
    """One line for the training log: whether this process's malloc uses transparent huge pages, and why."""
    if applied():
        value = next(item for item in os.environ.get("GLIBC_TUNABLES", "").split(":")
                     if item.split("=", 1)[0] == TUNABLE)
        return f"memory: GLIBC_TUNABLES has {value}" + (": malloc'd memory in transparent huge pages"
                                                        if value.endswith("=1") else "")
    reason = why_not(setting)
    return f"memory: 4 KiB pages for malloc'd memory ({reason or 'this process was not started by retrain train'})"
