"""``retrain merge``: all ingested batches -> one master dataset (``data/master``).

Pure part (``merge_batches``): classes reconciled by name (first-seen order over batches in ingest
order, so an existing class keeps its id forever); images deduplicated by sha256, the later batch's
labels winning, every such conflict listed; near-copies grouped (``data.groups``); each group split
train/val/test by a salted content hash of its first image, so an image's split never changes.  I/O part
(``merge``): reads each batch's ``annotations.json`` and ``batch.json`` and each image's pHash (cached),
refuses a changed split rule unless told to migrate, builds the master in ``data/.staging`` and swaps it
in atomically, then writes ``reports/merge.json``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import shutil
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from retrain.config import MergeParams
from retrain.data import canonical
from retrain.data.groups import Grouping, PhashCache, group_images, hashes_for
from retrain.errors import RetrainError
from retrain.faults import fault_point
from retrain.fsutil import dumps_canonical, replace_dir, write_atomic
from retrain.paths import Paths
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)

MANIFEST_COLUMNS = ("image_id", "file_name", "sha256", "width", "height", "split", "batch", "group")
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class MergeResult:
    """A merged master, not yet written.

    Attributes:
        coco: The master COCO document (images carry ``sha256``, ``split`` and ``batch``).
        report: Counts per batch, class and split, duplicates and conflicts (``reports/merge.json``).
    """

    coco: dict[str, Any]
    report: dict[str, Any]


def assign_split(sha256: str, val_fraction: float, salt: str, test_fraction: float = 0.0) -> str:
    """``test``, ``val`` or ``train`` from the image's content hash alone: stable across versions and batch order.

    One uniform draw ``u`` per image: ``test`` below ``test_fraction``, ``val`` below ``test_fraction +
    val_fraction``, else ``train``.  Adding a test split of at most the old val share to a train/val master (same
    salt) therefore moves only val images into test and train images into val, never a trained-on image into test.
    """
    h = hashlib.sha256(f"{salt}:{sha256}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    return "val" if u < test_fraction + val_fraction else "train"


def split_scheme(params: MergeParams) -> dict[str, Any]:
    """What decides every image's split; recorded in the master, so that a change to it is never silent."""
    return {"salt": params.split_salt, "val_fraction": params.val_fraction, "test_fraction": params.test_fraction,
            "near_duplicate_distance": params.near_duplicate_distance}


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
    entries: dict[str, tuple[Any, ...]] = {}  # sha256 -> (file_name, width, height, batch, boxes, sequence)
    conflicts: list[dict[str, Any]] = []
    per_batch: dict[str, dict[str, int]] = {}
    for name, doc in batches:
        cat_names = {c["id"]: c["name"] for c in doc["categories"]}
        boxes: dict[int, list[tuple[str, list[float], float]]] = {}
        for a in doc["annotations"]:
            boxes.setdefault(a["image_id"], []).append((cat_names[a["category_id"]], a["bbox"], a["area"]))
        prefix, dup = f"batches/{name}/{canonical.IMAGES}/", 0
        for im in doc["images"]:
            seq = im.get("sequence")
            entry = (prefix + im["file_name"], im["width"], im["height"], name, boxes.get(im["id"], []),
                     None if seq is None else f"{name}/{seq}")  # a sequence id names a video of its own batch
            old = entries.get(im["sha256"])
            if old is not None:
                dup += 1
                same = _same_labels([b[:2] for b in old[4]], [b[:2] for b in entry[4]], tol)
                conflicts.append({"sha256": im["sha256"], "kept": entry[0], "replaced": old[0],
                                  "labels_differ": not same})
            entries[im["sha256"]] = entry  # re-assigning a key keeps its first position, so its master id
        per_batch[name] = {"images": len(doc["images"]), "boxes": len(doc["annotations"]), "duplicates": dup}
    return entries, conflicts, per_batch


def merge_batches(batches: list[tuple[str, dict[str, Any]]], params: MergeParams,
                  phashes: Mapping[str, int] | None = None) -> MergeResult:
    """Merge canonical batch documents, given in ingest order.

    Args:
        batches: ``(batch name, canonical annotations.json)`` pairs, oldest first.
        params: The ``merge`` section of params.
        phashes: sha256 -> the image's pHash (``data.groups``); ``None``: images are grouped by sequence id only.

    Returns:
        The master document and the merge report.
    """
    class_ids = reconcile_classes([[c["name"] for c in doc["categories"]] for _, doc in batches])
    entries, conflicts, per_batch = _collect(batches, params.box_conflict_tolerance_px)
    shas = list(entries)
    grouping = group_images([None if phashes is None else phashes.get(sha) for sha in shas],
                            [entries[sha][5] for sha in shas], params.near_duplicate_distance)

    def split_of(anchor: int) -> str:
        return assign_split(shas[anchor], params.val_fraction, params.split_salt, params.test_fraction)

    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    box_keys: list[tuple[str, str]] = []  # (class, split) of every box, counted once at the end
    for index, sha in enumerate(shas):
        file_name, width, height, batch, boxes, _seq = entries[sha]
        image_id = index + 1
        split = split_of(grouping.anchor[index])
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height, "sha256": sha,
                       "split": split, "batch": batch, "group": grouping.anchor[index] + 1})
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
        "info": {"description": "retrain master dataset", "batches": [n for n, _ in batches],
                 "split": split_scheme(params)},
        "categories": [{"id": i, "name": n} for n, i in class_ids.items()],
        "images": images,
        "annotations": anns,
    }
    report = {
        "totals": {"batches": len(batches), "images": len(images), "boxes": len(anns), "classes": len(class_ids),
                   "duplicates": len(conflicts), "conflicts": sum(c["labels_differ"] for c in conflicts)},
        "splits": {s: {"images": per_split_images[s], "boxes": per_split_boxes[s]} for s in SPLITS},
        "batches": per_batch,
        "classes": {n: {"id": i, **{s: per_class[n, s] for s in SPLITS}} for n, i in class_ids.items()},
        "groups": _groups_report(images, grouping, split_of, params),
        "conflicts": conflicts,
    }
    return MergeResult(coco, report)


def _groups_report(images: list[dict[str, Any]], grouping: Grouping, split_of: Any,
                   params: MergeParams) -> dict[str, Any]:
    """The near-copy groups (two images or more), and the images a linking arrival moved to its group's split."""
    members: dict[int, list[str]] = {}
    for index, im in enumerate(images):
        members.setdefault(grouping.anchor[index], []).append(im["file_name"])
    groups = [{"anchor": images[a]["file_name"], "split": images[a]["split"], "images": names}
              for a, names in members.items() if len(names) > 1]
    moved = [{"file_name": im["file_name"], "from": split_of(grouping.arrival_anchor[i]), "to": im["split"]}
             for i, im in enumerate(images) if split_of(grouping.arrival_anchor[i]) != im["split"]]
    return {"near_duplicate_distance": params.near_duplicate_distance, "count": len(groups),
            "images": sum(len(g["images"]) for g in groups), "largest": max((len(g["images"]) for g in groups),
                                                                             default=1),
            "joined_by_sequence": grouping.by_sequence, "moved_by_a_link": len(moved), "moved": moved[:100],
            "groups": groups}


def split_changes(before: dict[str, Any] | None, after: dict[str, Any]) -> Counter[str]:
    """``"from->to"`` -> how many images present in both masters changed split."""
    if not before:
        return Counter()
    old = {im["sha256"]: im.get("split") for im in before.get("images", [])}
    return Counter(f"{old[im['sha256']]}->{im['split']}" for im in after["images"]
                   if im["sha256"] in old and old[im["sha256"]] != im["split"])


def manifest_csv(coco: dict[str, Any]) -> str:
    """The master's manifest: one row per image, in id order."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(MANIFEST_COLUMNS)
    for im in coco["images"]:
        w.writerow([im["id"], im["file_name"], im["sha256"], im["width"], im["height"], im["split"], im["batch"],
                    im.get("group", im["id"])])
    return buf.getvalue()


def merge(paths: Paths, params: MergeParams, migrate_splits: bool = False) -> MergeResult:
    """Build ``data/master`` from every ingested batch and write ``reports/merge.json``.

    Images are grouped by perceptual hash (decoded once in their life: cached by sha256 under ``.cache``) and by
    sequence id.  The split rule (``split_scheme``) is recorded in the master; when it changed and images of the
    previous master would change split, nothing is written unless ``migrate_splits``: then the move is recorded in
    the master (``info.split.migrations``) and in the report.

    Args:
        paths: The workspace.
        params: The ``merge`` section of params.
        migrate_splits: Accept a changed split rule once (``retrain merge --migrate-splits``).

    Returns:
        The merged master.

    Raises:
        RetrainError: A batch's canonical files or an image cannot be read; the split rule changed without
            ``migrate_splits``.
    """
    require_workspace(paths)
    docs = []
    for d, meta in canonical.ingested_batches(paths.batches):
        try:
            docs.append((meta.name, canonical.read_annotations(d)))
        except (OSError, ValueError, KeyError) as e:
            raise RetrainError(f"batch {meta.name}: {canonical.ANNOTATIONS} cannot be read ({e}); "
                               "run 'dvc checkout' to restore it") from e
    phashes = None
    if params.near_duplicate_distance >= 0:
        images = {im["sha256"]: (f"batches/{name}/{canonical.IMAGES}/{im['file_name']}")
                  for name, doc in docs for im in doc["images"]}
        shas = list(images)
        phashes = dict(zip(shas, hashes_for(shas, [paths.data / images[s] for s in shas], list(images.values()),
                                            PhashCache(paths.cache / "phash.json")), strict=True))
    result = merge_batches(docs, params, phashes)
    _check_split_rule(paths, result, migrate_splits)
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


def _previous_master(paths: Paths) -> tuple[dict[str, Any], str] | None:
    ann = paths.master / "annotations.json"
    if not ann.is_file():
        return None
    raw = ann.read_bytes()
    try:
        return orjson.loads(raw), hashlib.sha256(raw).hexdigest()
    except orjson.JSONDecodeError:
        return None  # a damaged master is rebuilt from the batches; it holds no split worth keeping


def _check_split_rule(paths: Paths, result: MergeResult, migrate: bool) -> None:
    """Carry the recorded migrations over; refuse a changed split rule that moves images, unless migrating."""
    info = result.coco["info"]
    scheme = dict(info["split"])
    found = _previous_master(paths)
    before, before_sha = found if found else ({}, "")
    old = dict(before.get("info", {}).get("split") or {})
    migrations = list(old.pop("migrations", []))
    moved = split_changes(before, result.coco)
    if moved and old != scheme:
        was = (", ".join(f"{k} {old.get(k)} -> {v}" for k, v in scheme.items() if old.get(k) != v) if old
               else "the master predates the test split and near-copy groups")
        counts = ", ".join(f"{n} {k}" for k, n in sorted(moved.items()))
        if not migrate:
            raise RetrainError(
                f"{paths.master}: the split rule changed ({was}): {sum(moved.values())} of {len(before['images'])} "
                f"images would change split ({counts}); nothing was changed. An image's split never changes "
                "silently: to move them once, run 'retrain merge --migrate-splits' (recorded in data/master and "
                "reports/merge.json), then 'dvc repro' (or 'retrain run')")
        migrations.append({"from": old or "train/val by content hash (no test split, no groups)", "to": scheme,
                           "master_before": before_sha, "moved": dict(sorted(moved.items())),
                           "images": sum(moved.values())})
        log.warning("split rule migrated (%s): %d images changed split (%s)", was, sum(moved.values()), counts)
    info["split"] = {**scheme, "migrations": migrations}
    result.report["split"] = {**scheme, "migrations": migrations,
                              "changed_since_previous": dict(sorted(moved.items()))}

