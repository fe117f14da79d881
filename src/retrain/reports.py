"""Typed reports: what a stage writes to ``reports/``, and how the other stages and the flow read it.

Each stage defines its report as a ``Report`` model beside its code (``training/report.py``...) and writes it with
``write``; the others read it with ``read`` (or ``find``), never by string key paths into a JSON document.  A stage
that ran before any batch was ingested writes ``NoData`` in its report's place (``nodata.py``): ``read`` refuses it
with one line, ``find`` gives ``None``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from retrain.errors import RetrainError
from retrain.fsutil import dumps_canonical, write_atomic


class Report(BaseModel):
    """A report file: a pydantic model written as canonical JSON (sorted keys), keys as written (aliases)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    #: What the report is called in messages ("train report").
    what: ClassVar[str] = "report"

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict (by alias)."""
        return self.model_dump(mode="json", by_alias=True)

    def write(self, path: Path) -> None:
        """Write it atomically."""
        write_atomic(path, dumps_canonical(self.to_json()))

    @classmethod
    def read(cls, path: Path) -> Self:
        """Read and check the report at ``path``.

        Raises:
            RetrainError: It is missing, unreadable, a "no data yet" record, or not this report (one line).
        """
        name = cls.what
        try:
            doc = orjson.loads(path.read_bytes())
        except FileNotFoundError as e:
            raise RetrainError(f"{path}: no {name}; run its stage first (dvc repro does)") from e
        except (OSError, ValueError) as e:
            raise RetrainError(f"{path}: cannot read the {name} ({e})") from e
        if isinstance(doc, dict) and doc.get("no_data") is True:
            raise RetrainError(f"{path}: the {name} records that there was no data yet ({doc.get('reason')})")
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise RetrainError(f"{path}: not a complete {name} ({where}: {first['msg']}); run its stage again") from e

    @classmethod
    def find(cls, path: Path) -> Self | None:
        """The report at ``path``, or ``None`` when there is none (missing, "no data yet", unreadable)."""
        try:
            return cls.read(path)
        except RetrainError:
            return None


class NoData(Report):
    """What a stage writes in its report's place when no batch has been ingested yet."""

    what: ClassVar[str] = "no-data record"

    no_data: Literal[True] = True
    reason: str
