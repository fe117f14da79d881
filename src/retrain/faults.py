"""Named fault-injection points for the fault tests (``tests/faults``).

``RETRAIN_FAULT=<site>`` (or ``<site>:kill``) makes the process SIGKILL itself when it reaches
``fault_point(<site>)``; ``<site>:enospc`` raises ``OSError(ENOSPC)`` there instead, naming the file being
written; ``<site>:stall`` creates the file named by ``RETRAIN_FAULT_FLAG`` and waits there until the test
removes it (so that the test can stop a service at exactly that point).  ``<site>:<action>:<n>`` fires the
n-th time the process reaches the point.  Unset in normal use, where a fault point costs one lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

_reached: dict[str, int] = {}


def fault_point(site: str, path: Path | str | None = None) -> None:
    """Inject the fault configured for ``site`` in ``RETRAIN_FAULT``, if any.

    Args:
        site: The point's name (``merge.half-written``, ``train.checkpoint`` ...).
        path: The file being written there, named by an injected ``ENOSPC``.
    """
    spec = os.environ.get("RETRAIN_FAULT")
    if not spec:
        return
    name, _, rest = spec.partition(":")
    if name != site:
        return
    action, _, nth = rest.partition(":")
    _reached[site] = _reached.get(site, 0) + 1
    if _reached[site] != int(nth or 1):
        return
    if action in ("", "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path is not None else None)
    elif action == "stall":
        flag = Path(os.environ["RETRAIN_FAULT_FLAG"])
        flag.write_text(str(os.getpid()))
        deadline = time.monotonic() + 600
        while flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
