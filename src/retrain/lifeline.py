"""Processes that die with their parent: a killed flow must not leave its stage running on its own.

The flow runs each stage as ``dvc repro`` (a child), which runs ``retrain <stage>`` (a grandchild).  If the flow's
process is SIGKILLed, the kernel delivers nothing to them by default: the stage would go on writing the workspace
after the run lock is gone, under the next run's feet.  Linux's ``PR_SET_PDEATHSIG`` asks the kernel to SIGKILL a
process when its parent dies; each link of the chain sets it for itself (``RETRAIN_DIE_WITH_PARENT=1``).

``python -m retrain.lifeline PROGRAM-MODULE ARGS...`` runs a Python module's CLI (``dvc``) that way.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

ENV = "RETRAIN_DIE_WITH_PARENT"
#: The launcher's pid, set by whoever starts ``python -m retrain.lifeline``: a parent that died before the request
#: took effect is caught by comparing (the orphan's parent is then init or a subreaper).
PARENT_ENV = "RETRAIN_LIFELINE_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    Args:
        expected_parent: The launcher's pid; when given and the parent is already another process, exit now.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the stage still runs, only without this guard
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(137)  # the launcher died before the request took effect


def main() -> None:
    """Run ``python -m <module> ARGS`` in this process after ``die_with_parent()``."""
    expected = os.environ.pop(PARENT_ENV, "")  # for this link only: the module's own children have another parent
    die_with_parent(int(expected) if expected.isdigit() else None)
    module, *args = sys.argv[1:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
