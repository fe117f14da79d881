"""What a flow run did, and its one renderer: the commit message and last log line, the terminal lines, the
Prefect artifact, the demo's decision column.

The flow returns the summary as a plain dict (``RunSummary.model_dump()``: what ``retrain run --json`` prints);
every reader turns it back into a ``RunSummary``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from retrain.nodata import HOW


class RunSummary(BaseModel):
    """One flow run.

    Attributes:
        ingested: Batches this run added.
        stages: Stage -> whether DVC ran it (False: up to date).
        seconds: Ingest and stage -> its own time.
        nothing_to_retrain: Nothing was ingested and no stage ran.
        no_batch_yet: The workspace has no batch at all.
        duplicate_of: The run that already has this run's schedule slot (this one did nothing).
        model: The registered model's name.
        version: The model version promote registered, if promote ran.
        promoted: Whether ``champion`` moved to it.
        reasons: Why not, rule by rule.
        commit: The git commit of the run's files.
        data_dvc_md5: DVC's md5 of ``data/master`` in ``dvc.lock`` (the reports' ``data_version`` is the master's
            ``annotations.json`` sha256: another name for another hash).
        candidate_map: The candidate's mAP50-95 on the judged split (test), if evaluate ran.
        champion_map: The champion's, on the same images (``None`` without a champion).
        batches: The batch folders asked for (``None``: everything waiting in ``data/incoming/``).
        held: When the run held the workspace lock (wall-clock start, end).
    """

    model_config = ConfigDict(extra="forbid")

    ingested: list[str] = Field(default_factory=list)
    stages: dict[str, bool] = Field(default_factory=dict)
    seconds: dict[str, float] = Field(default_factory=dict)
    nothing_to_retrain: bool = False
    no_batch_yet: bool = False
    duplicate_of: str | None = None
    model: str = ""
    version: str | None = None
    promoted: bool = False
    reasons: list[str] = Field(default_factory=list)
    commit: str | None = None
    data_dvc_md5: str | None = None
    candidate_map: float | None = None
    champion_map: float | None = None
    batches: list[str] | None = None
    held: list[float | None] | None = None

    @classmethod
    def of(cls, doc: dict[str, Any]) -> RunSummary:
        """The summary a flow run returned."""
        return cls.model_validate(doc)

    def decision(self) -> str:
        """The registry's decision in a few words."""
        if self.nothing_to_retrain:
            return "nothing to retrain"
        if not self.version:
            return "no new model"
        if self.promoted:
            return "promoted: champion"
        return "refused: " + "; ".join(self.reasons)

    def headline(self) -> str:
        """One line: the commit message and the run's last log line."""
        if self.nothing_to_retrain:
            if self.duplicate_of:
                return f"nothing to do: a duplicate run for the slot that {self.duplicate_of} has"
            if self.no_batch_yet:
                return f"nothing to retrain: no batch yet; {HOW}"
            return "nothing to retrain: no new batch, and DVC says every stage is up to date"
        data = (self.data_dvc_md5 or "?")[:12]
        decision = (f"{self.model} v{self.version} " + ("promoted to champion" if self.promoted else "not promoted")
                    if self.version else "no new model")
        batches = f" (batches: {', '.join(self.ingested)})" if self.ingested else ""
        return f"retrain: data {data}, {decision}{batches}"

    def lines(self) -> list[str]:
        """What the run did, for the terminal."""
        if self.nothing_to_retrain:
            return [self.headline()]
        ran = [k for k, v in self.stages.items() if v]
        lines = [f"batches ingested: {', '.join(self.ingested) or 'none'}; stages run: {', '.join(ran) or 'none'}",
                 f"data (DVC md5 of data/master): {self.data_dvc_md5 or '-'}"]
        if self.version:
            lines.append(f"{self.model} version {self.version}: " + (
                "promoted, it is the champion" if self.promoted else "registered as challenger, not promoted"))
            lines += [f"  - {r}" for r in self.reasons]
        if self.commit:
            lines.append(f"git commit {self.commit}")
        return lines

    def markdown(self) -> str:
        """The run's artifact in the Prefect UI."""
        lines = ["# retrain run", "", f"- batches ingested: {', '.join(self.ingested) or 'none'}",
                 f"- stages run: {', '.join(s for s, ran in self.stages.items() if ran) or 'none (all up to date)'}",
                 f"- data (DVC md5 of data/master): `{self.data_dvc_md5 or '-'}`"]
        if self.version:
            lines.append(f"- model version {self.version}: "
                         + ("promoted to champion" if self.promoted else "challenger, not promoted"))
            lines += [f"  - {r}" for r in self.reasons]
        if self.commit:
            lines.append(f"- git commit `{self.commit}`")
        return "\n".join(lines)
