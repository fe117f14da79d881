"""The DVC stages as Prefect tasks: DVC's own order, each stage run through ``dvc repro --single-item``.

DVC decides whether a stage is stale and records what ran in ``dvc.lock``; this module only starts it, streams
its output into the task's log (and a live progress bar to a terminal), and says whether it ran.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dvc.repo import Repo
from dvc.repo.reproduce import plan_repro
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from retrain.errors import RetrainError, TransientError
from retrain.lifeline import ENV as LIFELINE_ENV
from retrain.lifeline import PARENT_ENV as LIFELINE_PARENT
from tasks.artifacts import TrainingProgress

#: DVC's own error line when the stage exited 75 (``TransientError``: registry or remote unreachable) or when
#: another DVC process held the repository's lock: worth a retry.  Anything else (bad data, a bug) is not.
_TRANSIENT = re.compile(r"exited with 75\b|Unable to acquire lock")


@dataclass(frozen=True)
class StageRun:
    """What one stage task did.

    Attributes:
        name: The stage.
        ran: True when DVC ran it; False when it was up to date.
        seconds: Wall time of ``dvc repro`` for it (the stage's own time).
    """

    name: str
    ran: bool
    seconds: float


class StageFailed(RetrainError):
    """A stage exited non-zero; ``lines()`` has its own error lines."""

    def __init__(self, stage: str, lines: list[str]) -> None:
        self.stage = stage
        errors = [ln.removeprefix("error:").strip() for ln in lines if ln.startswith("error:")]
        self._lines = errors or lines[-3:] or ["(no output)"]  # the CLI adds its own "error: " to each line
        super().__init__(f"stage {stage} failed: {self._lines[-1]}")

    def lines(self) -> list[str]:
        return [*self._lines, f"stage {self.stage} failed; the stages after it did not run"]


class StageUnavailable(TransientError):
    """A stage failed for a transient reason; the task retries it."""


def dvc_env() -> dict[str, str]:
    """Environment for DVC and the ``retrain`` commands it runs: this interpreter's bin first, no analytics, and
    every process of the stage dies with the flow's process (``retrain.lifeline``)."""
    bindir = os.path.dirname(sys.executable)
    return {**os.environ, "DVC_NO_ANALYTICS": "1", "PYTHONUNBUFFERED": "1", LIFELINE_ENV: "1",
            LIFELINE_PARENT: str(os.getpid()),
            "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}


def stage_order(root: Path) -> list[str]:
    """The stages of ``root/dvc.yaml`` in the order ``dvc repro`` runs them (DVC's own planner, not a copy)."""
    with warnings.catch_warnings(), Repo(str(root)) as repo:
        warnings.simplefilter("ignore", DeprecationWarning)  # DVC's own use of a deprecated funcy API
        stages = repo.stage.collect(str(root / "dvc.yaml"))
        # The plan also holds the batches' .dvc files: data, not stages to run.
        return [s.name for s in plan_repro(repo.index.graph, stages) if s in stages]


def stream(args: list[str], cwd: Path, on_line: Callable[[str], None],
           on_idle: Callable[[], None] | None = None) -> int:
    """Run ``args``, calling ``on_line`` for each complete output line (and ``on_idle`` every ~2 s); the exit code.

    A carriage-return frame (a progress bar redrawing) is not a line: only a line's last frame is passed on.
    """
    proc = subprocess.Popen(args, cwd=cwd, env=dvc_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 2.0)
        if on_idle is not None:
            on_idle()
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for raw in lines:
            text = raw.decode("utf-8", "replace").split("\r")[-1].rstrip()
            if text:
                on_line(text)
    if pending.strip():
        on_line(pending.decode("utf-8", "replace").split("\r")[-1].rstrip())
    return proc.wait()


def _transient_only(task: Any, task_run: Any, state: Any) -> bool:
    return isinstance(state.data, TransientError)


@task(name="stage", task_run_name="{stage}", retry_condition_fn=_transient_only, cache_policy=NO_CACHE)
def run_stage(root: str, stage: str, progress_epochs: int | None = None) -> StageRun:
    """Run one DVC stage (``dvc repro --single-item --no-run-cache STAGE``) and stream its output into this task's
    log.

    Args:
        root: The workspace.
        stage: The stage's name in ``dvc.yaml``.
        progress_epochs: For training: the epochs it will run; a progress artifact then follows its metrics CSV.

    Returns:
        Whether it ran and how long it took.

    Raises:
        StageUnavailable: A transient failure (retried by the task's policy).
        StageFailed: Anything else (bad data, a failed check): not retried.
    """
    logger = get_run_logger()
    tail: deque[str] = deque(maxlen=200)  # for the error lines; a long stage logs more than it keeps
    started = f"Running stage '{stage}'"
    ran = False

    def line(text: str) -> None:
        nonlocal ran
        ran = ran or started in text
        tail.append(text)
        logger.info(text)
        if progress is not None:
            progress.read_plan(text)

    progress: TrainingProgress | None = None
    if progress_epochs:
        progress = TrainingProgress(Path(root), progress_epochs)
    t0 = time.perf_counter()
    # --no-run-cache: a stale stage runs; DVC never restores its outputs from an earlier run with the same inputs
    # (evaluate and promote read the registry, which DVC does not see; dvc.yaml keeps `dvc repro` from it too).
    rc = stream([sys.executable, "-m", "retrain.lifeline", "dvc", "repro", "--single-item", "--no-run-cache", stage],
                Path(root), line, progress.update if progress is not None else None)
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress.finish(rc == 0)
    lines = list(tail)
    if rc != 0:
        why = [ln for ln in lines if ln.startswith("ERROR") and _TRANSIENT.search(ln)]
        if why:
            said = [ln for ln in lines if ln.startswith("error: unavailable")]  # the stage's own reason, if it gave one
            raise StageUnavailable(f"stage {stage}: {(said or why)[-1]}")
        raise StageFailed(stage, lines)
    logger.info("stage %s %s in %.1f s", stage, "ran" if ran else "was up to date", seconds)
    return StageRun(stage, ran, seconds)
