"""The batch half of validation, run by ``retrain ingest`` before anything is written.

Image checks on every listed file, then the great-expectations batch rules on the batch's box and
image tables.  Returns the batch as a provisional COCO document (boxes in pixels, not yet clipped)
or the problems that refuse it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

from retrain.config import ValidateParams
from retrain.data.formats import SourceBatch, ValidBatch
from retrain.errors import Problem
from retrain.validation.images import ImageResult, check_files
from retrain.validation.tables import box_table, image_table


def _image_problems(batch: SourceBatch, res: ImageResult, base: Path, label_file: str) -> Problem:
    if res.rule in ("path-inside-root", "file-exists"):
        escapes = res.message.startswith(("absolute", "'..'", "empty"))
        shown = res.name if escapes else batch.rel(base / res.name)
        rule = "path-inside-batch" if res.rule == "path-inside-root" else res.rule
        return Problem(shown, rule, f"{res.message} (listed in {label_file})")
    return Problem(batch.rel(res.path) if res.path else res.name, res.rule, res.message)


#: The rules whose boxes ``ingest.bad_boxes: drop`` leaves out instead of refusing the batch (as the suite names them).
DROPPABLE = ("box-finite", "box-area")


def _broken(bbox: tuple[float, float, float, float]) -> tuple[str, str] | None:
    """(rule, message) when a box is broken beyond repair: a non-finite number, or zero or negative size."""
    if not all(math.isfinite(v) for v in bbox):
        return "box-finite", f"box {list(bbox)} has a missing or non-finite number"
    if bbox[2] <= 0 or bbox[3] <= 0:
        return "box-area", f"box {[round(v, 2) for v in bbox]} has zero or negative size"
    return None


def validate_batch(batch: SourceBatch, params: ValidateParams, workers: int = 0, bad_boxes: str = "refuse"
                   ) -> tuple[ValidBatch | None, list[Problem]]:
    """Check a batch as read: its files, then its tables.

    Args:
        batch: The batch from a format reader (its reader problems are included in the answer).
        params: The ``validate`` section.
        workers: Processes checking images (``runtime.check_workers``; 0 = one per CPU core).
        bad_boxes: ``refuse``, or ``drop``: boxes that break ``DROPPABLE`` rules are left out (listed in the answer's
            ``dropped``) and the rules run on the rest; every other rule still refuses.

    Returns:
        ``(ValidBatch, [])`` when it passes, else ``(None, problems)``.
    """
    problems = list(batch.problems)
    if not batch.images and not problems:
        problems.append(Problem(batch.rel(batch.root) or ".", "batch-not-empty", "the batch lists no images"))
    by_root: dict[Path, list[int]] = defaultdict(list)
    for k, entry in enumerate(batch.images):
        by_root[entry.image_root].append(k)
    results: dict[int, ImageResult] = {}
    for base, ks in by_root.items():
        for k, res in zip(ks, check_files(batch.root, base, [batch.images[k].name for k in ks],
                                          params.max_image_pixels, workers), strict=True):
            results[k] = res
            if res.info is None:
                problems.append(_image_problems(batch, res, base, batch.images[k].label_file))

    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    label_files: dict[int, str] = {}
    sources: dict[int, Path] = {}
    dropped: list[Problem] = []
    for k, entry in enumerate(batch.images):
        info = results[k].info
        if info is None:
            continue
        image_id = len(images) + 1
        w, h = entry.claimed_size or (info.width, info.height)
        images.append({"id": image_id, "file_name": Path(entry.name).as_posix(), "width": w, "height": h,
                       "sha256": info.sha256, "label_file": entry.label_file,
                       **({"sequence": entry.sequence} if entry.sequence is not None else {})})
        sources[image_id] = results[k].path  # type: ignore[assignment]
        for box in entry.boxes:
            broken = _broken(box.pixels(info.width, info.height))
            if broken is not None:  # refused, or under ingest.bad_boxes: drop, left out and listed
                if bad_boxes == "drop":
                    dropped.append(Problem(box.label_file, broken[0], f"{broken[1]} (image "
                                           f"{Path(entry.name).as_posix()}); dropped (ingest.bad_boxes: drop)"))
                else:
                    problems.append(Problem(box.label_file, broken[0], f"{broken[1]} (image "
                                            f"{Path(entry.name).as_posix()}); a broken box can be dropped with "
                                            "'retrain ingest --bad-boxes drop'"))
                continue
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": box.category + 1,
                         "bbox": list(box.pixels(info.width, info.height))})
            label_files[len(anns)] = box.label_file
    coco = {"categories": [{"id": i + 1, "name": n} for i, n in enumerate(batch.categories)],
            "images": images, "annotations": anns}
    decoded = {results[k].info.sha256: (results[k].info.width, results[k].info.height)  # type: ignore[union-attr]
               for k in results if results[k].info is not None}
    if images:
        # great-expectations takes seconds to import (these modules import it): only a batch with images gets here.
        from retrain.validation.gx import run_rules
        from retrain.validation.suite import batch_rules

        tables = {"boxes": box_table(coco, label_files), "images": image_table(coco, decoded)}
        # Messages name an image by its place in the batch (e.g. images/x.jpg), not its listed name.
        tables["images"]["file_name"] = pd.Series([batch.rel(sources[i["id"]]) for i in images], dtype="category")
        for check in run_rules(batch_rules(params, list(range(1, len(batch.categories) + 1))), tables,
                               examples=20):
            if check.status == "fail":
                problems.extend(check.problems())
    if problems:
        return None, problems
    return ValidBatch(coco, sources, tuple(dropped)), []
