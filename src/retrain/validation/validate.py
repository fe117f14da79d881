"""``retrain validate``: the gate between the merged master and training.

Image checks on every master image (in parallel, cached), then the great-expectations master suite on
the box, image and class tables, then ``reports/validation.json`` and the Data Docs site in
``reports/validation/``.  A failed check makes the stage exit 1, so ``dvc repro`` stops before training.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import uuid
from collections import Counter, defaultdict
from typing import Any

import orjson

from retrain.config import ValidateParams
from retrain.errors import RetrainError
from retrain.fsutil import replace_dir
from retrain.paths import Paths
from retrain.validation.gx import run_rules
from retrain.validation.images import ImageCheckCache, ImageResult, check_files
from retrain.validation.report import CheckResult, ValidationReport
from retrain.validation.suite import master_rules
from retrain.validation.tables import box_table, class_table, image_table
from retrain.validation.verdict import Verdict
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)

_FILE_RULES = {"path-inside-root": "image files stay inside the data root and are regular files",
               "file-exists": "every image file exists", "image-decodes": "images decode completely",
               "readable": "image files are readable", "unchanged": "checking leaves files unchanged",
               "content-hash": "image files have the sha256 their batch recorded"}


def file_checks(results: list[ImageResult], coco: dict[str, Any], examples: int) -> list[CheckResult]:
    """Fold per-file image results into one check result per rule (pass when nothing failed)."""
    batch_of = {im["file_name"]: im.get("batch", "") for im in coco["images"]}
    sha_of = {im["file_name"]: im["sha256"] for im in coco["images"]}
    failures: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r.info is None:
            failures[r.rule].append({"file": r.name, "batch": batch_of.get(r.name, ""), "found": r.message})
        elif r.info.sha256 != sha_of.get(r.name):
            failures["content-hash"].append({"file": r.name, "batch": batch_of.get(r.name, ""),
                                             "found": f"sha256 {r.info.sha256[:12]}..., recorded "
                                                      f"{str(sha_of.get(r.name))[:12]}..."})
    return [CheckResult(rule, "files", what, "fail" if failures[rule] else "pass", len(failures[rule]), None,
                        tuple(failures[rule][:examples])) for rule, what in _FILE_RULES.items()]


def _drift_tables(coco: dict[str, Any], boxes: Any) -> tuple[Any, dict[int, float] | None]:
    """Boxes of the newest batch, and the class distribution of the batches before it."""
    batches = coco.get("info", {}).get("batches", [])
    if len(batches) < 2:
        return None, None
    newest = batches[-1]
    new, old = boxes[boxes["batch"] == newest], boxes[boxes["batch"] != newest]
    if new.empty or old.empty:
        return None, None
    counts = Counter(old["category_id"].tolist())
    total = sum(counts.values())
    return new.reset_index(drop=True), {int(c): n / total for c, n in counts.items()}


def validate_master(paths: Paths, params: ValidateParams, workers: int = 0) -> ValidationReport:
    """Validate ``data/master`` and write the report and the Data Docs.

    Args:
        paths: The workspace.
        params: The ``validate`` section of params.
        workers: Processes checking images (``runtime.check_workers``; 0 = one per CPU core).

    Returns:
        The report (also written to ``reports/validation.json``).

    Raises:
        RetrainError: There is no master to validate.
    """
    require_workspace(paths)
    ann_file = paths.master / "annotations.json"
    if not ann_file.is_file():
        raise RetrainError(f"{ann_file}: no master dataset; run 'retrain merge' (or 'dvc repro') first")
    raw = ann_file.read_bytes()
    paths.validation_verdict.unlink(missing_ok=True)  # no verdict until this master has passed
    coco = orjson.loads(raw)
    if not coco["images"]:
        raise RetrainError(f"{ann_file}: the master has no images; ingest a batch, then merge")
    cache = ImageCheckCache(paths.cache / "image-checks.json")
    names = [im["file_name"] for im in coco["images"]]
    results = check_files(paths.data.resolve(), paths.data, names, params.max_image_pixels, workers,
                          known={im["file_name"]: im["sha256"] for im in coco["images"]}, cache=cache)
    cache.save()
    decoded = {r.info.sha256: (r.info.width, r.info.height) for r in results if r.info is not None}
    boxes = box_table(coco)
    tables = {"boxes": boxes, "images": image_table(coco, decoded), "classes": class_table(coco, boxes)}
    new_boxes, old_distribution = _drift_tables(coco, boxes)
    if new_boxes is not None:
        tables["new_boxes"] = new_boxes
    rules = master_rules(params, [c["id"] for c in coco["categories"]], old_distribution)
    paths.staging.mkdir(parents=True, exist_ok=True)
    docs = paths.staging / f"validation-docs-{uuid.uuid4().hex[:8]}"
    try:
        checks = run_rules(rules, tables, params.examples, docs_dir=docs)
        replace_dir(docs, paths.validation_docs)
    finally:
        shutil.rmtree(docs, ignore_errors=True)
    report = ValidationReport(tuple(file_checks(results, coco, params.examples) + checks))
    report.record().write(paths.validation_report)
    if report.passed:
        Verdict(master=hashlib.sha256(raw).hexdigest(), passed=True).write(paths.validation_verdict)
    log.debug("validation: %d checks, %d warnings, %d failures", len(report.checks), len(report.warned),
             len(report.failed))
    return report
