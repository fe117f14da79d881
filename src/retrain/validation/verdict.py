"""``reports/validated.json``: the pass record of a master, written only when ``retrain validate`` passed it.

DVC's audit and train stages depend on this file, and ``retrain audit`` and ``retrain train`` refuse a master it
does not name: nothing after validate reads unchecked data.  It changes only when the master does, so a changed
validation threshold reruns validate without retraining.
"""

from __future__ import annotations

from typing import ClassVar

from retrain.errors import RetrainError
from retrain.paths import Paths
from retrain.reports import Report


class Verdict(Report):
    """A master that passed validation.

    Attributes:
        master: sha256 of the master's ``annotations.json``.
        passed: Always true (no file is written for a master that failed).
    """

    what: ClassVar[str] = "validation pass record"

    master: str
    passed: bool


def require_validated(paths: Paths, version: str) -> None:
    """The stages after validate read only a master that ``retrain validate`` passed (``reports/validated.json``
    names it).

    Raises:
        RetrainError: It does not name this master.
    """
    verdict = Verdict.find(paths.validation_verdict)
    if verdict is None or verdict.master != version or not verdict.passed:
        raise RetrainError(f"{paths.master}: this master has not passed validation ({paths.validation_verdict} "
                           "does not name it); run 'retrain validate' (dvc repro runs it first)")
