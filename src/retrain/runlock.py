"""One retrain run at a time per workspace: an exclusive ``flock`` on ``.cache/run.lock``.

The kernel drops a ``flock`` when its holder dies, however it dies (SIGKILL included), so a killed run never
leaves the workspace locked.  The file also holds the owner's record (pid, host, flow run id, start time); a
clean exit empties it, so a record found by the next owner is that of a run that was killed, and the flow
marks that run crashed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from retrain.errors import WorkspaceBusy, WorkspaceError
from retrain.fsutil import write_atomic
from retrain.paths import Paths

log = logging.getLogger(__name__)


def _record(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        doc = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"garbled": raw[:200].decode("utf-8", "replace")}
    return doc if isinstance(doc, dict) else {}


def describe(owner: dict[str, Any]) -> str:
    """``pid 123 on host, flow run <id>, since <time>`` (whatever of it the record has)."""
    parts = [f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"]
    if owner.get("flow_run_id"):
        parts.append(f"flow run {owner['flow_run_id']}")
    if owner.get("started"):
        parts.append(f"since {owner['started']}")
    return ", ".join(parts)


#: File systems whose ``flock`` another host never sees (sshfs: always; NFS: with these mount options).
_LOCAL_ONLY_FS = ("fuse.sshfs",)
_LOCAL_ONLY_NFS = ("nolock", "local_lock=flock", "local_lock=all")


def _mount_of(path: Path, mountinfo: str) -> tuple[str, str, list[str]]:
    """The mount holding ``path``: (mount point, file system type, mount + super options), from ``mountinfo``."""
    best: tuple[str, str, list[str]] = ("/", "", [])
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path.as_posix() == point or path.as_posix().startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, rest[0], fields[5].split(",") + (rest[2].split(",") if len(rest) > 2 else []))
    return best


def lock_scope_problem(path: Path, mountinfo: str | None = None) -> str | None:
    """Why the run lock at ``path`` would not be seen by other hosts, or ``None`` when it would.

    A team's workers share a workspace on a file system (README, production deployment); the run lock is what
    makes their runs take turns, so a mount whose locks stay on one host (NFS with ``nolock`` or
    ``local_lock=flock|all``, sshfs) is refused rather than trusted.
    """
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    point, fstype, options = _mount_of(path.resolve(), mountinfo)
    local = [o for o in options if o in _LOCAL_ONLY_NFS] if fstype.startswith("nfs") else []
    if fstype in _LOCAL_ONLY_FS or local:
        how = f"mounted with {', '.join(local)}" if local else "whose locks never leave this host"
        return (f"{path}: the workspace is on {fstype} at {point}, {how}: a run on another host would not see this "
                "run's lock and two runs could write the workspace at once; mount it with working locks (NFS "
                "without nolock/local_lock) or keep the workspace on a local disk with one worker host")
    return None


@contextmanager
def run_lock(paths: Paths, owner: dict[str, Any], timeout: float,
             on_wait: Callable[[dict[str, Any]], None] | None = None, poll: float = 0.5) -> Iterator[dict[str, Any]]:
    """Hold the workspace's run lock for the ``with`` block.

    Args:
        paths: The workspace.
        owner: What to record about this run (``flow_run_id`` ...); pid, host and start time are added.
        timeout: Seconds to wait for a running owner; 0 gives up at once.
        on_wait: Called once with the holder's record when this run has to wait.
        poll: Seconds between tries while waiting.

    Yields:
        The record a previous owner left behind: empty after a clean exit, its details when it was killed.

    Raises:
        WorkspaceBusy: Another run held the lock for longer than ``timeout``.
        WorkspaceError: The workspace's file system keeps locks on this host only (``lock_scope_problem``).
    """
    paths.cache.mkdir(parents=True, exist_ok=True)
    path = paths.cache / "run.lock"
    problem = lock_scope_problem(paths.cache)
    if problem:
        raise WorkspaceError(problem)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _record(fd)
                if time.monotonic() >= deadline:
                    raise WorkspaceBusy(f"{paths.root}: another retrain run holds the workspace ({describe(holder)});"
                                        f" gave up after {timeout:g} s (retrain.lock_timeout)") from None
                if not waited and on_wait is not None:
                    on_wait(holder)
                waited = True
                time.sleep(poll)
        previous = _record(fd)
        mine = {**owner, "pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.now(UTC).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        os.fsync(fd)
        try:
            yield previous
        finally:
            os.ftruncate(fd, 0)  # a clean exit leaves no record: a record found later means its owner was killed
    finally:
        os.close(fd)  # closing drops the flock


def _dvc_process(pid: int) -> bool:
    try:
        return any("dvc" in part for part in psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return False


def repair_dvc_locks(root: Path) -> list[str]:
    """Repair what a killed ``dvc`` left in ``.dvc/tmp/rwlock``, once this run owns the workspace.

    DVC itself drops an rwlock entry whose pid is gone, but a file cut short mid-write ("JSON structure is
    corrupted") stops every later ``dvc repro``, and an entry whose pid now belongs to another program blocks
    its path forever.  Both are repaired only while DVC's own repository lock (``.dvc/tmp/lock``, a ``flock``)
    is free, i.e. no ``dvc`` command works in this workspace.

    Returns:
        What was repaired, one line each.
    """
    tmp = root / ".dvc" / "tmp"
    rw = tmp / "rwlock"
    if not rw.exists():
        return []
    fd = os.open(tmp / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # a dvc command is at work here now: its locks are live
        done: list[str] = []
        raw = rw.read_bytes()
        try:
            doc = json.loads(raw)
            if not (isinstance(doc, dict) and set(doc) <= {"read", "write"}
                    and all(isinstance(v, dict) for v in doc.values())):
                raise ValueError("not a DVC rwlock")
        except ValueError:
            rw.unlink()
            done.append(f"{rw}: unreadable ({raw[:40]!r}...), left by a killed dvc: removed")
        else:
            def stale(info: Any) -> bool:
                try:
                    return not _dvc_process(int(info["pid"]))
                except (KeyError, TypeError, ValueError):
                    return True  # an entry that names no pid blocks its path for good too

            write = {p: i for p, i in doc.get("write", {}).items() if not stale(i)}
            read = {p: [i for i in (infos if isinstance(infos, list) else [infos]) if not stale(i)]
                    for p, infos in doc.get("read", {}).items()}
            read = {p: infos for p, infos in read.items() if infos}
            if write != doc.get("write", {}) or read != doc.get("read", {}):
                write_atomic(rw, json.dumps({"read": read, "write": write}))
                done.append(f"{rw}: dropped entries of processes that are not dvc (killed, pid reused)")
        return done
    finally:
        os.close(fd)
