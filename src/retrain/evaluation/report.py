"""``reports/eval.json``: champion and candidate on the same test images (val beside), as promote reads it."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from retrain.metrics.coco import MetricsRecord, SliceMetrics
from retrain.reports import Report


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Candidate(_Part):
    """The candidate evaluated: its classes, image size, metrics and the sha256 of its model file."""

    classes: list[str]
    imgsz: int
    metrics: MetricsRecord
    sha256: str


class Champion(_Part):
    """The registry's champion evaluated on the same images: its version, classes, image size and metrics."""

    version: str
    classes: list[str]
    imgsz: int
    metrics: MetricsRecord


class Delta(_Part):
    """Candidate minus champion, and the paired bootstrap interval of the mAP50-95 difference."""

    map: float = Field(alias="mAP50-95")
    map50: float = Field(alias="mAP50")
    map75: float = Field(alias="mAP75")
    ar100: float = Field(alias="AR100")
    ci: tuple[float, float]
    confidence: float
    resamples: int


class ValSide(_Part):
    """The same two models on the val split, reported beside the judged split (val chose the candidate's
    checkpoint, so its numbers flatter the candidate; the gate never reads them).

    Attributes:
        images: Val images scored.
        candidate: The candidate's metrics on val.
        champion: The champion's, or ``None``.
    """

    images: int
    candidate: SliceMetrics
    champion: SliceMetrics | None


class EvalReport(Report):
    """A finished evaluation (DVC metrics).  Byte for byte a function of its inputs (no timings): a promotion is
    keyed by it.

    Attributes:
        data_version: sha256 of the master's ``annotations.json`` (``Master.version``), as the candidate's.
        split: The judged split: ``test``; ``val`` only when the master has no test images (then said in a note).
        images: Images of that split scored.
        instances: Class name -> boxes in that split.
        size_instances: Class name -> object size (small, medium, large) -> boxes in that split.
        candidate: The candidate.
        champion: The champion, or ``None`` when the registry has none.
        delta: Candidate minus champion, or ``None`` without a champion.
        val: Both models on val, beside (``None`` when val is the judged split).
        notes: What the reader must know (e.g. no test split).
    """

    what: ClassVar[str] = "evaluate report"

    data_version: str
    split: str = "val"
    images: int
    instances: dict[str, int]
    size_instances: dict[str, dict[str, int]] = {}
    candidate: Candidate
    champion: Champion | None
    delta: Delta | None
    val: ValSide | None = None
    notes: list[str] = []
