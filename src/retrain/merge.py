"""``retrain merge``: all ingested batches -> one master dataset (``data/master``).

Pure part (``merge_batches``): classes reconciled by name (first-seen order over batches in ingest
order, so an existing class keeps its id forever); images deduplicated by sha256, the later batch's
labels winning, every such conflict listed; split by a salted content hash, so an image's split never
changes.  I/O part (``merge``): reads only each batch's ``annotations.json`` and ``batch.json``, builds
the master in ``data/.staging`` and swaps it in atomically, then writes ``reports/merge.json``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from retrain.config import MergeParams
from retrain.data import canonical
from retrain.errors import RetrainError
from retrain.faults import fault_point
from retrain.fsutil import dumps_canonical, replace_dir, write_atomic
from retrain.paths import Paths
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)

MANIFEST_COLUMNS = ("image_id", "file_name", "sha256", "width", "height", "split", "batch")


@dataclass(frozen=True)
class MergeResult:
    """A merged master, not yet written.

    Attributes:
        coco: The master COCO document (images carry ``sha256``, ``split`` and ``batch``).
        report: Counts per batch, class and split, duplicates and conflicts (``reports/merge.json``).
    """

    coco: dict[str, Any]
    report: dict[str, Any]


def assign_split(sha256: str, val_fraction: float, salt: str) -> str:
    """``val`` or ``train`` from the image's content hash alone: stable across versions and batch order."""
    h = hashlib.sha256(f"{salt}:{sha256}".encode()).digest()
    return "val" if int.from_bytes(h[:8], "big") / 2**64 < val_fraction else "train"


def reconcile_classes(batches: list[list[str]]) -> dict[str, int]:
    """Class name -> master id (1..K) in first-seen order; ids of known names never change."""
    ids: dict[str, int] = {}
    for names in batches:
        for n in names:
            ids.setdefault(n, len(ids) + 1)
    return ids


def _labels(boxes: list[tuple[str, list[float]]]) -> list[tuple[str, list[float]]]:
    return sorted(boxes, key=lambda b: (b[0], b[1]))


def _same_labels(a: list[tuple[str, list[float]]], b: list[tuple[str, list[float]]], tol: float) -> bool:
    la, lb = _labels(a), _labels(b)
    return len(la) == len(lb) and all(
        ca == cb and all(abs(x - y) <= tol for x, y in zip(ba, bb, strict=True))
        for (ca, ba), (cb, bb) in zip(la, lb, strict=True)
    )


def _collect(batches: list[tuple[str, dict[str, Any]]], tol: float
             ) -> tuple[dict[str, tuple[Any, ...]], list[dict[str, Any]], dict[str, dict[str, int]]]:
    """Images by sha256 (the later batch wins, the first position is kept), the duplicates, per-batch counts."""
    entries: dict[str, tuple[Any, ...]] = {}  # sha256 -> (file_name, width, height, batch, boxes)
    conflicts: list[dict[str, Any]] = []
    per_batch: dict[str, dict[str, int]] = {}
    for name, doc in batches:
        cat_names = {c["id"]: c["name"] for c in doc["categories"]}
        boxes: dict[int, list[tuple[str, list[float], float]]] = {}
        for a in doc["annotations"]:
            boxes.setdefault(a["image_id"], []).append((cat_names[a["category_id"]], a["bbox"], a["area"]))
        prefix, dup = f"batches/{name}/{canonical.IMAGES}/", 0
        for im in doc["images"]:
            entry = (prefix + im["file_name"], im["width"], im["height"], name, boxes.get(im["id"], []))
            old = entries.get(im["sha256"])
            if old is not None:
                dup += 1
                same = _same_labels([b[:2] for b in old[4]], [b[:2] for b in entry[4]], tol)
                conflicts.append({"sha256": im["sha256"], "kept": entry[0], "replaced": old[0],
                                  "labels_differ": not same})
            entries[im["sha256"]] = entry  # re-assigning a key keeps its first position, so its master id
        per_batch[name] = {"images": len(doc["images"]), "boxes": len(doc["annotations"]), "duplicates": dup}
    return entries, conflicts, per_batch


def merge_batches(batches: list[tuple[str, dict[str, Any]]], params: MergeParams) -> MergeResult:
    """Merge canonical batch documents, given in ingest order.

    Args:
        batches: ``(batch name, canonical annotations.json)`` pairs, oldest first.
        params: The ``merge`` section of params.

    Returns:
        The master document and the merge report.
    """
    class_ids = reconcile_classes([[c["name"] for c in doc["categories"]] for _, doc in batches])
    entries, conflicts, per_batch = _collect(batches, params.box_conflict_tolerance_px)
    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    box_keys: list[tuple[str, str]] = []  # (class, split) of every box, counted once at the end
    for image_id, (sha, (file_name, width, height, batch, boxes)) in enumerate(entries.items(), start=1):
        split = assign_split(sha, params.val_fraction, params.split_salt)
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height, "sha256": sha,
                       "split": split, "batch": batch})
        for cat, bbox, area in boxes:
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": class_ids[cat], "bbox": bbox,
                         "area": area, "iscrowd": 0})
            box_keys.append((cat, split))
    per_class = Counter(box_keys)
    per_split_images = Counter(im["split"] for im in images)
    per_split_boxes = Counter(split for _, split in box_keys)
    origin = Counter(im["batch"] for im in images)
    for name in per_batch:
        per_batch[name]["images_in_master"] = origin[name]
    coco = {
        "info": {"description": "retrain master dataset", "batches": [n for n, _ in batches]},
        "categories": [{"id": i, "name": n} for n, i in class_ids.items()],
        "images": images,
        "annotations": anns,
    }
    report = {
        "totals": {"batches": len(batches), "images": len(images), "boxes": len(anns), "classes": len(class_ids),
                   "duplicates": len(conflicts), "conflicts": sum(c["labels_differ"] for c in conflicts)},
        "splits": {s: {"images": per_split_images[s], "boxes": per_split_boxes[s]} for s in ("train", "val")},
        "batches": per_batch,
        "classes": {n: {"id": i, "train": per_class[n, "train"], "val": per_class[n, "val"]}
                    for n, i in class_ids.items()},
        "conflicts": conflicts,
    }
    return MergeResult(coco, report)


def manifest_csv(coco: dict[str, Any]) -> str:
    """The master's manifest: one row per image, in id order."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(MANIFEST_COLUMNS)
    for im in coco["images"]:
        w.writerow([im["id"], im["file_name"], im["sha256"], im["width"], im["height"], im["split"], im["batch"]])
    return buf.getvalue()


def merge(paths: Paths, params: MergeParams) -> MergeResult:
    """Build ``data/master`` from every ingested batch and write ``reports/merge.json``.

    Args:
        paths: The workspace.
        params: The ``merge`` section of params.

    Returns:
        The merged master.

    Raises:
        RetrainError: A batch's canonical files cannot be read.
    """
    require_workspace(paths)
    docs = []
    for d, meta in canonical.ingested_batches(paths.batches):
        try:
            docs.append((meta.name, canonical.read_annotations(d)))
        except (OSError, ValueError, KeyError) as e:
            raise RetrainError(f"batch {meta.name}: {canonical.ANNOTATIONS} cannot be read ({e}); "
                               "run 'dvc checkout' to restore it") from e
    result = merge_batches(docs, params)
    paths.staging.mkdir(parents=True, exist_ok=True)
    stage = paths.staging / f"master-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        (stage / "annotations.json").write_text(dumps_canonical(result.coco), encoding="utf-8")
        fault_point("merge.half-written", stage / "manifest.csv")
        (stage / "manifest.csv").write_text(manifest_csv(result.coco), encoding="utf-8")
        fault_point("merge.before-swap")
        replace_dir(stage, paths.master)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    write_atomic(paths.merge_report, dumps_canonical(result.report))
    t = result.report["totals"]
    log.debug("master: %d images, %d boxes, %d classes from %d batches (%d duplicate images, %d label conflicts)",
             t["images"], t["boxes"], t["classes"], t["batches"], t["duplicates"], t["conflicts"])
    return result

