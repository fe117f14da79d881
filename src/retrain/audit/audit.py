"""``retrain audit``: the champion looks for label errors in the batches it has never trained on.

After ``validate`` and before ``train``: the registry's champion (a model file the command resolved) predicts on
every image of the batches newer than its own training data (the model file records the batches it trained on; a
champion without that record audits every batch, and the report says so), and cleanlab scores the labels against
those out-of-sample predictions (``issues.py``).  Writes ``reports/audit.json`` (DVC metrics) and
``reports/audit/index.html`` (the worst images drawn, offline).  A batch whose flagged share is above
``audit.max_flagged_fraction`` is named in ``failed``; with ``audit.level: fail`` the command stops the run on it
(``runner``).  No champion yet: nothing is audited, and the report says so.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import torch

from retrain.audit.issues import KINDS, ImageAudit, cleanlab_inputs, find_issues
from retrain.audit.render import page
from retrain.audit.report import AuditIssue, AuditPass, AuditReport, BatchAudit, FlaggedImage
from retrain.config import Params
from retrain.data.master import Master, load_master
from retrain.detector.files import load_model_file
from retrain.detector.predict import Nms, predict_split
from retrain.detector.registered import RegisteredModel
from retrain.device import cpu_threads
from retrain.fsutil import replace_dir
from retrain.paths import Paths
from retrain.validation.verdict import require_validated
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)

AUDIT_SPLIT = "audit"  # the images of the audited batches, as one split of a view of the master


def _audited(master: Master, trained_on: Any) -> tuple[list[str], list[str], list[str]]:
    """(audited batches, the champion's batches, notes): the batches the champion has not trained on."""
    batches = [str(b) for b in master.doc.get("info", {}).get("batches", [])]
    if not isinstance(trained_on, list):
        return batches, [], ["the champion's model file does not record the batches it trained on (it predates "
                             "retrain's audit): every batch is audited"]
    seen = set(map(str, trained_on))
    return [b for b in batches if b not in seen], [b for b in batches if b in seen], []


def _view(master: Master, batches: list[str]) -> Master:
    """The master's images of ``batches`` as one split, ``audit`` (the same boxes, classes and files)."""
    chosen = set(batches)
    images = [{**im, "split": AUDIT_SPLIT} for im in master.doc["images"] if im.get("batch") in chosen]
    return Master({**master.doc, "images": images}, master.names, master.category_ids, master.version,
                  master.data_root)


def _inputs(view: Master, dets: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """Per audited image: (class index, bbox) labels and (class index, bbox, confidence) predictions."""
    index = {c: i for i, c in enumerate(view.category_ids)}
    labels: dict[int, list[Any]] = {}
    preds: dict[int, list[Any]] = {}
    for a in view.doc["annotations"]:
        labels.setdefault(a["image_id"], []).append((index[a["category_id"]], a["bbox"]))
    for d in dets:
        preds.setdefault(d["image_id"], []).append((index[d["category_id"]], d["bbox"], d["score"]))
    ids = [im["id"] for im in view.images(AUDIT_SPLIT)]
    return [labels.get(i, []) for i in ids], [preds.get(i, []) for i in ids]


def _issues(found: ImageAudit) -> list[AuditIssue]:
    return [AuditIssue(kind=x.kind, bbox=x.bbox, label=x.label, predicted=x.predicted, confidence=x.confidence)
            for x in found.issues]


def audit_batches(paths: Paths, params: Params, champion: RegisteredModel | None) -> AuditReport:
    """Audit the labels of the batches the champion has not trained on.

    Args:
        paths: The workspace.
        params: All params (``audit``; ``evaluate`` for NMS and batch; ``train``/``runtime`` for the device).
        champion: The registry's champion as a local model file, or ``None`` (nothing is audited).

    Returns:
        The report (also written to ``reports/audit.json`` and ``reports/audit/index.html``).

    Raises:
        RetrainError: No master, a master validation did not pass, an unsafe model file.
    """
    require_workspace(paths)
    a = params.audit
    master = load_master(paths.master, paths.data)
    require_validated(paths, master.version)
    base: dict[str, Any] = {"data_version": master.version, "confident": a.confident, "level": a.level,
                            "max_flagged_fraction": a.max_flagged_fraction}
    if champion is None:
        report = AuditReport(**base, champion=None, batches={}, not_audited=[], flagged=[], kinds={}, failed=[],
                             notes=["no champion yet: nothing to audit against; the first model trains on every "
                                    "label as it is"])
        _write(paths, report, master, {}, [])
        return report
    torch.set_num_threads(cpu_threads(params.runtime))
    mf = load_model_file(champion.weights)
    audited, trained, notes = _audited(master, mf.meta.get("batches"))
    view = _view(master, audited)
    images = view.images(AUDIT_SPLIT)
    t0 = time.perf_counter()
    dets: list[dict[str, Any]] = []
    if images:
        e = params.evaluate  # each box with its best class only: one object is one prediction to compare labels with
        nms = Nms(e.conf, e.iou, e.max_det, multi_label=False)
        dets = predict_split(mf, view, AUDIT_SPLIT, nms, e.batch, params.train, params.runtime, paths.cache)
    labels, preds = _inputs(view, dets)
    found = find_issues(*cleanlab_inputs(labels, preds, len(master.names)), master.names, a.confident)
    per_batch: dict[str, BatchAudit] = {}
    for b in audited:
        mine = [f for im, f in zip(images, found, strict=True) if im["batch"] == b]
        kinds = Counter(x.kind for f in mine for x in f.issues)
        flagged = sum(f.flagged for f in mine)
        per_batch[b] = BatchAudit(images=len(mine), flagged=flagged,
                                  flagged_fraction=round(flagged / len(mine), 4) if mine else 0.0,
                                  issues={k: kinds.get(k, 0) for k in KINDS})
    split_of = {im["id"]: str(im["split"]) for im in master.doc["images"]}
    order = sorted((i for i, f in enumerate(found) if f.flagged), key=lambda i: (found[i].score, images[i]["id"]))
    flagged_images = [FlaggedImage(file_name=images[i]["file_name"], batch=images[i]["batch"],
                                   split=split_of[images[i]["id"]],
                                   score=found[i].score, issues=_issues(found[i])) for i in order]
    report = AuditReport(
        **base, champion=champion.version, batches=per_batch, not_audited=trained, flagged=flagged_images,
        kinds={k: sum(b.issues[k] for b in per_batch.values()) for k in KINDS},
        failed=[b for b, r in per_batch.items() if r.flagged_fraction > a.max_flagged_fraction], notes=notes)
    confident = [d for d in dets if d["score"] >= a.confident]
    _write(paths, report, master, {i: images[i] for i in order[:a.show]}, confident)
    log.info("audited %d images of %d batches in %.1f s: %d flagged", len(images), len(audited),
             time.perf_counter() - t0, len(flagged_images))
    return report


def _write(paths: Paths, report: AuditReport, master: Master, shown: dict[int, dict[str, Any]],
           dets: list[dict[str, Any]]) -> None:
    """The page into a fresh folder swapped in whole; the metrics; the pass record only when the gate lets it by."""
    staging = paths.staging / f"audit-{time.time_ns()}"
    staging.mkdir(parents=True)
    (staging / "index.html").write_text(page(report, master, list(shown.values()), dets), encoding="utf-8")
    replace_dir(staging, paths.audit_page)
    paths.audit_pass.unlink(missing_ok=True)
    report.write(paths.audit_report)
    if not report.stops():
        AuditPass(master=report.data_version).write(paths.audit_pass)
