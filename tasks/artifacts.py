"""What the Prefect UI shows of a run: validation, evaluation, per-class AP, registry links, training progress.

Artifacts are keyed, so each run adds a new version of the same artifact and the UI keeps their history.
They are read from the stages' own reports; nothing here computes a result.
"""

from __future__ import annotations

import csv
import json
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

from retrain.paths import Paths


def _json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


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
                from tqdm import tqdm

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
    report = _json(paths.validation_report)
    if report is None:
        return
    c = report.get("counts", {})
    lines = [f"# Validation of data/master: {'FAILED' if failed or not report.get('passed') else 'passed'}", "",
             f"{c.get('checks', 0)} checks: {c.get('passed', 0)} passed, {c.get('warnings', 0)} warnings, "
             f"{c.get('failures', 0)} failures.", "",
             f"Report: `{paths.validation_report}`; great-expectations Data Docs: "
             f"`{paths.validation_docs / 'index.html'}`", ""]
    bad = [ch for ch in report.get("checks", []) if ch.get("status") != "pass"]
    if bad:
        lines += ["| status | table | rule | unexpected | what |", "|---|---|---|---:|---|"]
        lines += [f"| {ch.get('status')} | {ch.get('table')} | {ch.get('rule')} | {ch.get('unexpected')} | "
                  f"{ch.get('what')} |" for ch in bad]
    create_markdown_artifact("\n".join(lines), key="retrain-validation", description="validation of the master")


def publish_evaluation(paths: Paths, ui_base: str) -> dict[str, Any]:
    """The evaluation with the decision (markdown), per-class AP (table) and links to MLflow.

    Returns:
        The promotion record (``{}`` when there is none).
    """
    promotion = _json(paths.promotion_report) or {}
    report = _json(paths.eval_report) or {}
    text = paths.eval_markdown.read_text(encoding="utf-8") if paths.eval_markdown.exists() else ""
    if promotion:
        verdict = "promoted: it is the champion" if promotion.get("promoted") else "not promoted"
        text += (f"\n\n## Decision\n\n{promotion.get('model')} version {promotion.get('version')}: {verdict}.\n\n"
                 + "".join(f"- {r}\n" for r in promotion.get("reasons") or ["every rule of the gate holds"]))
    if text:
        create_markdown_artifact(text, key="retrain-evaluation", description="champion vs candidate, and decision")
    cand = (report.get("candidate") or {}).get("metrics", {}).get("per_class", {})
    champ = ((report.get("champion") or {}).get("metrics") or {}).get("per_class", {})
    rows = [{"class": k, "val_boxes": (report.get("instances") or {}).get(k, 0),
             "champion": round(champ[k], 4) if k in champ else None, "candidate": round(v, 4),
             "delta": round(v - champ[k], 4) if k in champ else None} for k, v in cand.items()]
    if rows:
        create_table_artifact(rows, key="retrain-per-class-ap", description="AP50-95 per class on the val images")
    if promotion.get("version"):
        from retrain.registry.history import ui_links
        from retrain.registry.tracking import tracking_uri

        links = ui_links(tracking_uri(paths.root), str(promotion["model"]), str(promotion["version"]), ui_base)
        create_link_artifact(links["version"], link_text=f"{promotion['model']} version {promotion['version']}",
                             key="retrain-model-version", description="the registered candidate in MLflow")
        if "run" in links:
            create_link_artifact(links["run"], link_text="MLflow run", key="retrain-mlflow-run",
                                 description="the training run (metrics, the logged model, the reports)")
    return promotion


def eval_scores(paths: Paths) -> dict[str, float | None]:
    """``candidate_map`` and ``champion_map`` (mAP50-95 on the same val images; None without a champion)."""
    report = _json(paths.eval_report) or {}
    cand = (report.get("candidate") or {}).get("metrics", {}).get("mAP50-95")
    champ = ((report.get("champion") or {}).get("metrics") or {}).get("mAP50-95")
    return {"candidate_map": cand, "champion_map": champ}


def publish_summary(summary: dict[str, Any]) -> None:
    """One markdown artifact for the run: batches, stages, data version, model version, decision."""
    stages = summary.get("stages", {})
    lines = ["# retrain run", "", f"- batches ingested: {', '.join(summary.get('ingested', [])) or 'none'}",
             f"- stages run: {', '.join(s for s, ran in stages.items() if ran) or 'none (all up to date)'}",
             f"- data version (DVC md5 of data/master): `{summary.get('data_version') or '-'}`"]
    if summary.get("version"):
        lines.append(f"- model version {summary['version']}: "
                     + ("promoted to champion" if summary.get("promoted") else "challenger, not promoted"))
        lines += [f"  - {r}" for r in summary.get("reasons", [])]
    if summary.get("commit"):
        lines.append(f"- git commit `{summary['commit']}`")
    create_markdown_artifact("\n".join(lines), key="retrain-run", description="what this run did")
