"""``reports/eval.json``: champion and candidate on the same val images, as promote and the flow read it."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from retrain.metrics.coco import MetricsRecord
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


class EvalReport(Report):
    """A finished evaluation (DVC metrics).

    Attributes:
        data_version: sha256 of the master's ``annotations.json`` (``Master.version``), as the candidate's.
        images: Val images scored.
        instances: Class name -> val boxes.
        candidate: The candidate.
        champion: The champion, or ``None`` when the registry has none.
        delta: Candidate minus champion, or ``None`` without a champion.
        seconds: Wall time of prediction and scoring.
    """

    what: ClassVar[str] = "evaluate report"

    data_version: str
    images: int
    instances: dict[str, int]
    candidate: Candidate
    champion: Champion | None
    delta: Delta | None
    seconds: float
