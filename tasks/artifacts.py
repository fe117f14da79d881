"""What the Prefect UI shows of a run: validation, evaluation, per-class AP, registry links, training progress.

Artifacts are keyed, so each run adds a new version of the same artifact and the UI keeps their history.
They are read from the stages' own reports; nothing here computes a result.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from tqdm import tqdm

from retrain.audit.report import AuditReport
from retrain.config import WARM_PLAN
from retrain.evaluation.report import EvalReport
from retrain.paths import Paths
from retrain.promotion.report import PromotionReport
from retrain.registry.history import status, ui_links
from retrain.registry.history_plot import history, save
from retrain.registry.tracking import tracking_uri
from retrain.validation.report import ValidationRecord


class TrainingProgress:
    """A progress artifact, and on a terminal a progress bar, that follow the epochs in the training's metrics CSV.

    They appear once the CSV changes (training started; an up-to-date stage makes none).
    """

    def __init__(self, root: Path, epochs: int) -> None:
        self.csv = Paths.at(root).train_metrics
        self.epochs = max(1, epochs)
        self.start_mtime = self._mtime()
        self.artifact: Any = None
        self.shown = -1.0
        self.bar: Any = None

    def read_plan(self, line: str) -> None:
        """A run warm-started from the champion says its own epoch count (``train.warm``) as it starts: follow it."""
        found = WARM_PLAN.search(line)
        if found and self.artifact is None:
            self.epochs = max(1, int(found.group(1)))

    def _epochs_seen(self) -> int:
        try:
            with self.csv.open(encoding="utf-8", newline="") as f:
                epochs = [int(r["epoch"]) for r in csv.DictReader(f) if (r.get("epoch") or "").isdigit()]
        except (OSError, ValueError, KeyError):
            return 0
        return max(epochs) if epochs else 0

    def _show(self, percent: float) -> None:
        if percent == self.shown:
            return
        if sys.stderr.isatty():  # the stage's own bar cannot draw through the log pipe: this one does
            if self.bar is None:
                self.bar = tqdm(total=self.epochs, desc="training", unit="epoch", file=sys.stderr, leave=True)
            self.bar.update(round(percent * self.epochs / 100) - self.bar.n)
        if self.artifact is None:
            self.artifact = create_progress_artifact(percent, key="retrain-training",
                                                     description=f"training epochs ({self.epochs} planned)")
        else:
            update_progress_artifact(self.artifact, percent)
        self.shown = percent

    def _mtime(self) -> int | None:
        try:
            return self.csv.stat().st_mtime_ns
        except OSError:  # not there (yet, or for a moment: Lightning's logger rewrites it each epoch)
            return None

    def update(self) -> None:
        """Look at the CSV; move the artifact when an epoch began."""
        mtime = self._mtime()
        if mtime is None or mtime == self.start_mtime:
            return
        self._show(round(100.0 * min(self._epochs_seen(), self.epochs) / self.epochs, 1))

    def finish(self, ok: bool) -> None:
        """At 100% when training finished (early stopping included); left where it was when it failed."""
        if ok and self.artifact is not None:
            self._show(100.0)
        if self.bar is not None:
            self.bar.close()


def publish_validation(paths: Paths, failed: bool) -> None:
    """The validation summary: counts and every check that did not pass, with where the Data Docs are."""
    report = ValidationRecord.find(paths.validation_report)
    if report is None:
        return
    c = report.counts
    lines = [f"# Validation of data/master: {'FAILED' if failed or not report.passed else 'passed'}", "",
             f"{c.checks} checks: {c.passed} passed, {c.warnings} warnings, {c.failures} failures.", "",
             f"Report: `{paths.validation_report}`; great-expectations Data Docs: "
             f"`{paths.validation_docs / 'index.html'}`", ""]
    bad = [ch for ch in report.checks if ch.get("status") != "pass"]
    if bad:
        lines += ["| status | table | rule | unexpected | what |", "|---|---|---|---:|---|"]
        lines += [f"| {ch.get('status')} | {ch.get('table')} | {ch.get('rule')} | {ch.get('unexpected')} | "
                  f"{ch.get('what')} |" for ch in bad]
    create_markdown_artifact("\n".join(lines), key="retrain-validation", description="validation of the master")


def publish_audit(paths: Paths) -> None:
    """The label audit: per batch what was flagged (markdown, with where the page is), the flagged images (table),
    and a link to the page of the worst images drawn."""
    report = AuditReport.find(paths.audit_report)
    if report is None:
        return
    page = paths.audit_page / "index.html"
    stopped = " FAILED: the run stopped before training" if report.stops() else ""
    lines = [f"# Label audit{stopped}", "", *[f"{n}" for n in report.notes], ""]
    if report.champion is not None:
        lines += [f"Champion version {report.champion} on the batches it has not trained on; confident at "
                  f"{report.confident:g}; level {report.level}, bound {report.max_flagged_fraction:.0%} of a batch's "
                  f"images. Report `{paths.audit_report}`; the worst images drawn: `{page}`.", "",
                  "| batch | images | flagged | share | missing | wrong class | bad location |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {b}{' (over the bound)' if b in report.failed else ''} | {r.images} | {r.flagged} | "
                  f"{r.flagged_fraction:.1%} | {r.issues['missing']} | {r.issues['wrong_class']} | "
                  f"{r.issues['bad_location']} |" for b, r in report.batches.items()]
    create_markdown_artifact("\n".join(lines), key="retrain-audit", description="label audit of the new batches")
    if report.flagged:
        create_table_artifact([{"batch": f.batch, "file": f.file_name, "score": round(f.score, 4),
                                "issues": "; ".join(f"{x.kind} {x.label or '-'}->{x.predicted or '-'}"
                                                    for x in f.issues)} for f in report.flagged],
                              key="retrain-audit-flagged", description="images with suspect labels, worst first")
        create_link_artifact(page.resolve().as_uri(), link_text="the worst audited images, drawn",
                             key="retrain-audit-page", description="reports/audit/index.html (opens offline)")


def publish_evaluation(paths: Paths, ui_base: str) -> PromotionReport | None:
    """The evaluation with the decision (markdown), per-class AP (table) and links to MLflow.

    Returns:
        The promotion record (``None`` when there is none).
    """
    promotion = PromotionReport.find(paths.promotion_report)
    report = EvalReport.find(paths.eval_report)
    text = paths.eval_markdown.read_text(encoding="utf-8") if paths.eval_markdown.exists() else ""
    if promotion is not None:
        verdict = "promoted: it is the champion" if promotion.promoted else "not promoted"
        text += (f"\n\n## Decision\n\n{promotion.model} version {promotion.version}: {verdict}.\n\n"
                 + "".join(f"- {r}\n" for r in promotion.reasons or ["every rule of the gate holds"]))
    if text:
        create_markdown_artifact(text, key="retrain-evaluation", description="champion vs candidate, and decision")
    if report is not None:
        champ = report.champion.metrics.per_class if report.champion else {}
        rows = [{"class": k, f"{report.split}_boxes": report.instances.get(k, 0),
                 "champion": round(champ[k], 4) if k in champ else None, "candidate": round(v, 4),
                 "delta": round(v - champ[k], 4) if k in champ else None}
                for k, v in report.candidate.metrics.per_class.items()]
        if rows:
            create_table_artifact(rows, key="retrain-per-class-ap",
                                  description=f"AP50-95 per class on the {report.split} images (the gate's judge)")
    if promotion is not None:
        links = ui_links(tracking_uri(paths.root), promotion.model, promotion.version, ui_base)
        create_link_artifact(links["version"], link_text=f"{promotion.model} version {promotion.version}",
                             key="retrain-model-version", description="the registered candidate in MLflow")
        if "run" in links:
            create_link_artifact(links["run"], link_text="MLflow run", key="retrain-mlflow-run",
                                 description="the training run (metrics, the logged model, the reports)")
    return promotion


def publish_history(paths: Paths, name: str, ui_base: str) -> Path:
    """The model's quality history: mAP50-95 per version, overall and per class, champion moves marked (a markdown
    table, the PNG in ``reports/history.png`` and in the newest version's MLflow run, ``history/history.png``: both
    drawn by the promote stage that just ran, drawn here only where it could not).

    Returns:
        The PNG.
    """
    rows = status(tracking_uri(paths.root), name)
    h = history(rows)
    png = paths.reports / "history.png"
    if not png.is_file():
        save(rows, name, png)
    classes = list(h.per_class)
    head = ["version", "mAP50-95", *classes, "decision"]
    run = ui_links(tracking_uri(paths.root), name, str(h.versions[-1]), ui_base).get("run") if h.versions else None
    lines = [f"# {name}: quality per version", "",
             f"Each version's candidate on its evaluation's test images; the champion is now version "
             f"{h.champion or 'none'}. Drawn: `{png}`"
             + (f", and in the newest version's [MLflow run]({run}) as history/history.png" if run else "") + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: int(r["version"])):
        mark = " (champion)" if "champion" in r["aliases"] else ""
        cells = [r["version"] + mark, r["mAP50-95"][:6] or "-",
                 *(f"{r['per_class'][c]:.4f}" if c in r["per_class"] else "-" for c in classes), r["decision"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    create_markdown_artifact("\n".join(lines), key="retrain-history", description="mAP50-95 per registered version")
    return png


def publish_summary(markdown: str) -> None:
    """The run's own artifact (``RunSummary.markdown()``): batches, stages, data, model version, decision."""
    create_markdown_artifact(markdown, key="retrain-run", description="what this run did")
