"""``reports/validated.json``: the pass record of a master, written only when ``retrain validate`` passed it.

DVC's train stage depends on this file, and ``retrain train`` refuses a master it does not name: training never
reads unchecked data.  It changes only when the master does, so a changed validation threshold reruns validate
without retraining.
"""

from __future__ import annotations

from typing import ClassVar

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
