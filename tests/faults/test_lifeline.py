"""Fault: the parent of a stage process SIGKILLed while the stage is silent.

A pipe only kills an orphan at its next write; `python -m retrain.lifeline MODULE` (how the flow starts `dvc`, and
`RETRAIN_DIE_WITH_PARENT=1` for the `retrain` stage command) has the kernel kill it at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.faults

PARENT = """
import os, subprocess, sys, time
env = {**os.environ, "RETRAIN_LIFELINE_PARENT": str(os.getpid())}
child = subprocess.Popen([sys.executable, *sys.argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
print(child.pid, flush=True)
time.sleep(2)  # the child is up and quiet
print("ready", flush=True)
time.sleep(120)
"""


def _orphan_lives(*child: str) -> bool:
    """Start PARENT -> child, SIGKILL the parent, and say whether the child is still alive 5 s later."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *child], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert parent.stdout.readline() == "ready\n"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    try:
        psutil.Process(pid).wait(timeout=5)
        return False
    except psutil.TimeoutExpired:
        psutil.Process(pid).kill()
        return True


def test_a_silent_stage_dies_with_its_parent_through_the_lifeline_and_not_without_it() -> None:
    assert _orphan_lives("-m", "tests.faults.quiet")  # without: the orphan sleeps on
    assert not _orphan_lives("-m", "retrain.lifeline", "tests.faults.quiet")


def test_the_lifeline_exits_at_once_when_its_launcher_is_already_gone() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RETRAIN_LIFELINE_PARENT": "1"}  # not our parent: "already gone"
    proc = subprocess.run([sys.executable, "-m", "retrain.lifeline", "tests.faults.quiet"], env=env, timeout=30)
    assert proc.returncode == 137
