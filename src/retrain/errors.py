"""Typed errors with actionable, one-line messages.

Every expected failure (bad input, bad configuration, a refused batch) is a ``RetrainError``;
the CLI prints its lines and exits non-zero without a traceback.  Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class RetrainError(Exception):
    """Base of all expected failures; ``lines()`` is what the user sees."""

    exit_code = 1

    def lines(self) -> list[str]:
        """Return the message as a list of one-line strings."""
        return [str(self)]


class ConfigError(RetrainError):
    """``params.yaml`` (or another config file) is missing, malformed or has bad values."""


class WorkspaceError(RetrainError):
    """The directory is not a retrain workspace, or its git/DVC state is not usable."""


class ExternalToolError(RetrainError):
    """A tool we drive (dvc, git) failed; the message carries its own last line."""


@dataclass(frozen=True)
class Problem:
    """One defect found in a batch.

    Attributes:
        file: The offending file, relative to the batch root (or the batch root itself).
        rule: Short, stable name of the rule that failed (e.g. ``box-inside-image``).
        message: What is wrong, in plain words.
    """

    file: str
    rule: str
    message: str

    def format(self, batch: str) -> str:
        """Render as ``batch NAME: FILE: [rule] message``."""
        return f"batch {batch}: {self.file}: [{self.rule}] {self.message}"


class BatchRejected(RetrainError):
    """A batch failed its checks; nothing was written."""

    def __init__(self, batch: str, problems: Sequence[Problem], max_lines: int = 50) -> None:
        self.batch = batch
        self.problems = tuple(problems)
        self.max_lines = max_lines
        super().__init__(f"batch {batch} refused: {len(self.problems)} problem(s)")

    def lines(self) -> list[str]:
        """One line per problem (capped), then a summary line."""
        shown = [p.format(self.batch) for p in self.problems[: self.max_lines]]
        hidden = len(self.problems) - len(shown)
        if hidden > 0:
            shown.append(f"batch {self.batch}: ... and {hidden} more problem(s)")
        shown.append(f"batch {self.batch} refused: {len(self.problems)} problem(s); nothing was changed")
        return shown


class Told(RetrainError):
    """An expected failure told in several lines: one per thing found, the last a summary (the exception's message)."""

    def __init__(self, lines: Sequence[str]) -> None:
        self._lines = list(lines) or [f"{type(self).__name__}"]
        super().__init__(self._lines[-1])

    def lines(self) -> list[str]:
        return list(self._lines)


class ValidationFailed(Told):
    """The master failed validation: one line per failed check, then a summary."""


class AuditFailed(Told):
    """The label audit found too many suspect labels in a batch (``audit.level: fail``): one line per batch, then a
    summary."""


class TransientError(RetrainError):
    """A service we depend on (the registry, a DVC remote, a lock held by another writer) failed for now.

    Exit code 75 (``EX_TEMPFAIL``): the orchestrator retries these, with backoff, and nothing else.
    """

    exit_code = 75


class DiskFull(RetrainError):
    """A write failed because its disk (or quota) is full; the message names the file and the disk."""

    @classmethod
    def of(cls, exc: OSError, fallback: str | None = None) -> DiskFull:
        """The one-line report of ``exc`` (an ``ENOSPC``/``EDQUOT``), with the disk's mount point and free space."""
        path = Path(exc.filename or fallback or Path.cwd()).absolute()
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        mount = probe
        while not os.path.ismount(mount) and mount != mount.parent:
            mount = mount.parent
        try:
            free = f"{shutil.disk_usage(probe).free / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "no space left on device"
        return cls(f"{what} writing {path} (the disk mounted at {mount}: {free}); free some space and run again")


def disk_full(exc: BaseException, fallback: str | None = None) -> DiskFull | None:
    """``exc`` as a ``DiskFull`` when an ``ENOSPC``/``EDQUOT`` is anywhere in its chain, else ``None``."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFull):
            return e
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFull.of(e, fallback)
        e = e.__cause__ or e.__context__
    return None


class WorkspaceBusy(RetrainError):
    """Another retrain run holds the workspace; this one waited as long as it was allowed to."""


#: Exception class names (anywhere in the chain) that mean "unreachable or busy right now", not "bad input".
_TRANSIENT_NAMES = {"ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "MaxRetryError",
                    "NewConnectionError", "ProtocolError", "RemoteDisconnected", "TimeoutError",
                    "ConnectionRefusedError", "ConnectionResetError"}
_TRANSIENT_TEXT = ("max retries exceeded", "connection refused", "database is locked", "temporarily unavailable",
                   "503 service unavailable", "502 bad gateway", "504 gateway timeout")


def transient_reason(exc: BaseException) -> str | None:
    """Why ``exc`` looks transient (a service unreachable or busy), or ``None`` when it does not.

    Walks the ``__cause__``/``__context__`` chain: MLflow, requests and sqlite wrap the network error.

    Args:
        exc: The exception raised by a stage.

    Returns:
        A one-line reason, or ``None``.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TransientError):
            return str(e)
        names = {c.__name__ for c in type(e).__mro__}
        text = str(e).lower()
        if names & _TRANSIENT_NAMES or any(t in text for t in _TRANSIENT_TEXT):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return first[:300]
        e = e.__cause__ or e.__context__
    return None
