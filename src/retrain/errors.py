"""Typed errors with actionable, one-line messages.

Every expected failure (bad input, bad configuration, a refused batch) is a ``RetrainError``;
the CLI prints its lines and exits non-zero without a traceback.  Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


class ValidationFailed(RetrainError):
    """The master failed validation: one line per failed check, then a summary."""

    def __init__(self, lines: Sequence[str]) -> None:
        self._lines = list(lines)
        super().__init__(self._lines[-1] if self._lines else "validation failed")

    def lines(self) -> list[str]:
        return list(self._lines)
