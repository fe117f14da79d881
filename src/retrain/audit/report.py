"""``reports/audit.json``: what ``retrain audit`` found, as the flow and the next stages read it."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from retrain.reports import Report


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AuditIssue(_Part):
    """One suspect box. ``bbox`` is COCO x, y, w, h in the image's pixels; ``label`` is the labelled class (``None``
    for a missing box), ``predicted`` the champion's class there (``None`` where it has no box over it)."""

    kind: str
    bbox: tuple[float, float, float, float]
    label: str | None
    predicted: str | None
    confidence: float | None


class FlaggedImage(_Part):
    """An image with at least one suspect box; ``score`` is cleanlab's label quality score (0..1, low = suspect)."""

    file_name: str
    batch: str
    split: str
    score: float
    issues: list[AuditIssue]


class BatchAudit(_Part):
    """One audited batch: its images, how many are flagged, their share, and the issues by kind."""

    images: int
    flagged: int
    flagged_fraction: float
    issues: dict[str, int]


class AuditReport(Report):
    """The label audit (DVC metrics).

    Attributes:
        data_version: The master it audited (``Master.version``).
        champion: The champion's registry version, or ``None`` when there was none (then nothing was audited).
        batches: The batches audited (those newer than the champion's training data) and what was found per batch.
        not_audited: The batches the champion trained on (audited when they were new).
        flagged: The flagged images, worst (lowest score) first.
        kinds: Issues per kind over all audited batches.
        confident: The confidence that counted as a confident prediction (``audit.confident``).
        level: ``audit.level``; ``max_flagged_fraction`` its bound.
        failed: The batches over the bound (only with ``level: fail`` do they stop the run).
        notes: What the reader should know (no champion; a champion with no record of its data).
    """

    what: ClassVar[str] = "audit report"

    data_version: str
    champion: str | None
    batches: dict[str, BatchAudit]
    not_audited: list[str]
    flagged: list[FlaggedImage]
    kinds: dict[str, int]
    confident: float
    level: str
    max_flagged_fraction: float
    failed: list[str]
    notes: list[str]

    def stops(self) -> bool:
        """True when the audit stops the run: ``level: fail`` and a batch over ``max_flagged_fraction``."""
        return self.level == "fail" and bool(self.failed)


class AuditPass(Report):
    """``reports/audited.json``: the master the audit let through (``train`` depends on it, so DVC runs the audit
    first; it changes only with the master, so a new audit threshold reruns the audit, never the training)."""

    what: ClassVar[str] = "audit pass record"

    master: str
