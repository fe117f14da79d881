"""Check results and the validation report (``reports/validation.json``, a DVC metrics file)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from retrain.errors import Problem
from retrain.reports import Report


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one rule.

    Attributes:
        rule: Stable rule name.
        table: The table it ran on (``files`` for image checks).
        what: The rule in plain words.
        status: ``pass``, ``warn`` or ``fail``.
        unexpected: Offending rows (``None`` for aggregate checks).
        observed: The observed value of an aggregate check.
        examples: The first offending rows: ``file`` (and ``batch``) plus what was found.
    """

    rule: str
    table: str
    what: str
    status: str
    unexpected: int | None = None
    observed: Any = None
    examples: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def problems(self) -> list[Problem]:
        """One problem per example row (or one for an aggregate check), for the one-line-per-problem output."""
        if not self.examples:
            seen = f" (observed {self.observed:.4g})" if isinstance(self.observed, float) else ""
            return [Problem(self.table, self.rule, f"{self.what}{seen}")]
        out = [Problem(str(e.get("file", self.table)), self.rule, f"{self.what}: {e.get('found', '')}".rstrip(": "))
               for e in self.examples]
        more = (self.unexpected or 0) - len(self.examples)
        if more > 0:
            out.append(Problem(self.table, self.rule, f"... and {more} more (see reports/validation.json)"))
        return out


@dataclass(frozen=True)
class ValidationReport:
    """All check results of one validation run."""

    checks: tuple[CheckResult, ...]

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warned(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def passed(self) -> bool:
        return not self.failed

    def record(self) -> ValidationRecord:
        """The report as written to ``reports/validation.json``: counts (DVC metrics), then every check."""
        counts = {s: sum(1 for c in self.checks if c.status == s) for s in ("pass", "warn", "fail")}
        return ValidationRecord(
            passed=self.passed, counts=Counts(checks=len(self.checks), passed=counts["pass"],
                                              warnings=counts["warn"], failures=counts["fail"]),
            checks=[_jsonable(asdict(c)) for c in self.checks])


class Counts(BaseModel):
    """How many checks ran, passed, warned and failed."""

    model_config = ConfigDict(extra="forbid")

    checks: int
    passed: int
    warnings: int
    failures: int


class ValidationRecord(Report):
    """``reports/validation.json`` (DVC metrics): the verdict, the counts, and every check with its examples."""

    what: ClassVar[str] = "validation report"

    passed: bool
    counts: Counts
    checks: list[dict[str, Any]]


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_jsonable(v) for v in o]
    if hasattr(o, "item"):  # numpy scalar
        return o.item()
    if isinstance(o, float) and o != o:  # NaN
        return None
    return o
