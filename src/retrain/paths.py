"""Every artifact path of a workspace, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    """Paths of one retrain workspace (a git + DVC project holding ``dvc.yaml``).

    Attributes:
        root: The workspace root.
    """

    root: Path

    @classmethod
    def at(cls, root: str | Path) -> Paths:
        """Build the paths for the workspace at ``root`` (made absolute, not required to exist)."""
        return cls(Path(root).resolve())

    @property
    def params(self) -> Path:
        return self.root / "params.yaml"

    @property
    def dvc_yaml(self) -> Path:
        return self.root / "dvc.yaml"

    @property
    def data(self) -> Path:
        """The data root: every image path in the master is relative to it."""
        return self.root / "data"

    @property
    def incoming(self) -> Path:
        return self.data / "incoming"

    @property
    def batches(self) -> Path:
        return self.data / "batches"

    @property
    def master(self) -> Path:
        return self.data / "master"

    @property
    def staging(self) -> Path:
        """Scratch space on the same filesystem as ``data/`` (git- and DVC-ignored), for atomic renames."""
        return self.data / ".staging"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def merge_report(self) -> Path:
        return self.reports / "merge.json"

    @property
    def validation_report(self) -> Path:
        return self.reports / "validation.json"

    @property
    def validation_verdict(self) -> Path:
        """Written only when the master passed: which master (sha256 of its annotations.json). Train's DVC dep."""
        return self.reports / "validated.json"

    @property
    def validation_docs(self) -> Path:
        """The great-expectations Data Docs site (open ``index.html``)."""
        return self.reports / "validation"

    @property
    def audit_report(self) -> Path:
        """``retrain audit``'s metrics (DVC metrics): the suspect labels of the batches the champion has not seen."""
        return self.reports / "audit.json"

    @property
    def audit_pass(self) -> Path:
        """Written only when the audit let the master through: names it (train's DVC dependency, for the order)."""
        return self.reports / "audited.json"

    @property
    def audit_page(self) -> Path:
        """The worst audited images drawn with their labels and the champion's boxes (open ``index.html``)."""
        return self.reports / "audit"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def candidate(self) -> Path:
        """The trained candidate (``model.pt``): the ``train`` stage's output."""
        return self.models / "candidate"

    @property
    def checkpoints(self) -> Path:
        """Lightning checkpoints of the run in progress; outside any DVC output so that a rerun can resume."""
        return self.models / "checkpoints"

    @property
    def train_report(self) -> Path:
        return self.reports / "train.json"

    @property
    def train_metrics(self) -> Path:
        """Per-epoch metrics (Lightning's CSVLogger) for ``dvc plots``."""
        return self.reports / "train" / "metrics.csv"

    @property
    def eval_report(self) -> Path:
        """``retrain evaluate``'s metrics (DVC metrics): champion, candidate, delta, per class, per slice."""
        return self.reports / "eval.json"

    @property
    def eval_markdown(self) -> Path:
        """The same as a table a person reads."""
        return self.reports / "eval.md"

    @property
    def eval_plots(self) -> Path:
        """Per-class AP and PR-curve PNGs."""
        return self.reports / "plots"

    @property
    def promotion_report(self) -> Path:
        """``retrain promote``'s record: the version registered, the decision and its reasons."""
        return self.reports / "promotion.json"

    @property
    def cache(self) -> Path:
        """Per-workspace caches that are neither versioned nor tracked (image-check results)."""
        return self.root / ".cache"

    def batch(self, name: str) -> Path:
        """Directory of the ingested batch ``name``."""
        return self.batches / name

    def batch_dvc_file(self, name: str) -> Path:
        """The ``.dvc`` file that tracks batch ``name``."""
        return self.batches / f"{name}.dvc"
