"""Named fault-injection points for the fault tests.

``RETRAIN_FAULT=<site>`` (or ``<site>:kill``) makes the process SIGKILL itself when it reaches
``fault_point(<site>)``; ``<site>:enospc`` raises ``OSError(ENOSPC)`` there instead.  Unset in
normal use, where a fault point costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal


def fault_point(site: str) -> None:
    """Inject the fault configured for ``site`` in ``RETRAIN_FAULT``, if any."""
    spec = os.environ.get("RETRAIN_FAULT")
    if not spec:
        return
    name, _, action = spec.partition(":")
    if name != site:
        return
    if action in ("", "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"fault injected at {site}")
