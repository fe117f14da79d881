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
from typing import Any

from retrain.errors import WorkspaceBusy
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
    """
    paths.cache.mkdir(parents=True, exist_ok=True)
    path = paths.cache / "run.lock"
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
