"""Score detections with pycocotools' ``COCOeval``: mAP50-95, mAP50, mAP75, AR100 and AP per class.

Ground truth is a COCO document (the master's val split); detections are COCO result dicts
(``image_id``, ``category_id``, ``bbox`` in pixels ``[x, y, w, h]``, ``score``).  No detections at all
score 0 rather than crash (pycocotools cannot load an empty result list).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from pydantic import BaseModel, ConfigDict, Field

#: COCO's object sizes, in COCOeval's order of area ranges after "all".
SIZES = ("small", "medium", "large")


@dataclass(frozen=True)
class CocoMetrics:
    """COCO metrics of one model on one set of images.

    Attributes:
        map: mAP at IoU 0.50:0.95.
        map50: mAP at IoU 0.50.
        map75: mAP at IoU 0.75.
        ar100: Average recall with at most 100 detections per image.
        per_class: Category name -> AP at IoU 0.50:0.95 (-1 for a class with no ground truth here).
        images: Images evaluated.
        sizes: COCO object size (``small`` < 32x32 px, ``medium`` < 96x96, ``large``) -> mAP50-95 (-1: none here).
        per_class_size: Category name -> size -> AP50-95 (-1: no ground truth of that class and size).
    """

    map: float
    map50: float
    map75: float
    ar100: float
    per_class: dict[str, float] = field(default_factory=dict)
    images: int = 0
    sizes: dict[str, float] = field(default_factory=dict)
    per_class_size: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Plain numbers for reports and loggers."""
        return {"mAP50-95": self.map, "mAP50": self.map50, "mAP75": self.map75, "AR100": self.ar100,
                "images": self.images, "per_class": dict(self.per_class), "sizes": dict(self.sizes),
                "per_class_size": {k: dict(v) for k, v in self.per_class_size.items()}}


def ground_truth(doc: Mapping[str, Any], split: str | None = "val") -> COCO:
    """A pycocotools ``COCO`` index over the images of one split of a COCO document.

    Args:
        doc: A COCO document whose images may carry ``split``.
        split: Keep only images of this split; ``None`` keeps all.

    Returns:
        The index (built without printing).
    """
    images = [im for im in doc["images"] if split is None or im.get("split") == split]
    ids = {im["id"] for im in images}
    anns = [{**a, "area": a.get("area", a["bbox"][2] * a["bbox"][3]), "iscrowd": a.get("iscrowd", 0)}
            for a in doc["annotations"] if a["image_id"] in ids]
    gt = COCO()
    gt.dataset = {"images": images, "annotations": anns, "categories": list(doc["categories"])}
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt


def run_cocoeval(gt: COCO, detections: Iterable[Mapping[str, Any]]) -> COCOeval | None:
    """Match ``detections`` to ``gt`` image by image (``COCOeval.evaluate()``), ready to accumulate.

    Args:
        gt: The ground-truth index.
        detections: COCO result dicts; may be empty.

    Returns:
        The evaluated ``COCOeval``; ``None`` when there is nothing to match (no detections or no ground truth).
    """
    dets = [dict(d) for d in detections]
    if not dets or not gt.getAnnIds():
        return None
    with contextlib.redirect_stdout(io.StringIO()):
        ev = COCOeval(gt, gt.loadRes(dets), "bbox")
        ev.evaluate()
    return ev


def summarize(gt: COCO, ev: COCOeval | None, image_ids: Iterable[int] | None = None) -> CocoMetrics:
    """Accumulate and summarize an evaluated ``COCOeval`` over all its images or a subset (a slice).

    A subset reuses the per-image matches (``accumulate`` over ``params.imgIds``), as pycocotools intends.

    Args:
        gt: The ground truth ``ev`` was evaluated against.
        ev: From :func:`run_cocoeval`; ``None`` scores 0 for every class with ground truth.
        image_ids: The images to score (default: all).

    Returns:
        The metrics; -1 where nothing has ground truth.
    """
    names = {c["id"]: c["name"] for c in gt.dataset["categories"]}
    ids = sorted(gt.getImgIds() if image_ids is None else set(image_ids))
    if ev is None:
        anns = gt.loadAnns(gt.getAnnIds(imgIds=ids))
        present = {a["category_id"] for a in anns}
        sized = {(a["category_id"], size_of(a["area"])) for a in anns}
        zero = 0.0 if present else -1.0
        return CocoMetrics(zero, zero, zero, zero, {n: (0.0 if c in present else -1.0) for c, n in names.items()},
                           len(ids), {s: (0.0 if any(z == s for _, z in sized) else -1.0) for s in SIZES},
                           {n: {s: (0.0 if (c, s) in sized else -1.0) for s in SIZES} for c, n in names.items()})
    all_ids = ev.params.imgIds
    ev.params.imgIds = ids
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ev.accumulate()
            ev.summarize()
    finally:
        ev.params.imgIds = all_ids
    # stats 3-5: AP50-95 of small, medium and large objects (COCOeval's area ranges 1-3)
    return CocoMetrics(float(ev.stats[0]), float(ev.stats[1]), float(ev.stats[2]), float(ev.stats[8]),
                       _per_class(ev, names), len(ids), {s: float(ev.stats[3 + i]) for i, s in enumerate(SIZES)},
                       _per_class_size(ev, names))


@dataclass(frozen=True)
class Score:
    """Detections scored against a ground truth: overall, per slice (a subset of images), and the matches.

    Attributes:
        overall: The metrics over every image.
        slices: Slice name -> the metrics over its images (the same per-image matches, re-accumulated).
        detections: How many detections were scored.
        ev: The evaluated ``COCOeval`` (its matches feed the bootstrap, its curves the plots); ``None`` when
            nothing could be matched.
    """

    overall: CocoMetrics
    slices: dict[str, CocoMetrics]
    detections: int
    ev: COCOeval | None

    def record(self) -> MetricsRecord:
        """The report form: the overall numbers, each slice's, and the count of detections."""
        return MetricsRecord.model_validate({**self.overall.to_json(), "detections": self.detections, "slices": {
            name: m.to_json() for name, m in self.slices.items()}})


class SliceMetrics(BaseModel):
    """COCO metrics as reports hold them, keys as written (``mAP50-95``...); -1 where nothing has ground truth.

    Attributes:
        map: mAP at IoU 0.50:0.95 (``mAP50-95``); ``map50``, ``map75``, ``ar100`` likewise.
        images: Images scored.
        per_class: Class name -> AP50-95 (-1: no ground truth of that class here).
        sizes: Object size (small, medium, large) -> mAP50-95 (-1: no object of that size here).
        per_class_size: Class name -> size -> AP50-95.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    map: float = Field(alias="mAP50-95")
    map50: float = Field(alias="mAP50")
    map75: float = Field(alias="mAP75")
    ar100: float = Field(alias="AR100")
    images: int
    per_class: dict[str, float]
    sizes: dict[str, float] = {}
    per_class_size: dict[str, dict[str, float]] = {}


class MetricsRecord(SliceMetrics):
    """A model's metrics in a report (``reports/train.json``, ``reports/eval.json``): overall, per slice.

    Attributes:
        slices: Slice name (origin batch) -> its metrics; empty where none were asked for.
        detections: Detections scored.
    """

    slices: dict[str, SliceMetrics] = {}
    detections: int = 0


def score(gt: COCO, detections: Iterable[Mapping[str, Any]],
          slices: Mapping[str, Iterable[int]] | None = None) -> Score:
    """The one scoring path: ``COCOeval`` (bbox) of ``detections`` against ``gt``, overall and per slice.

    Training's validation, training's final scoring of the EMA and raw weights, and the evaluate stage all call it.

    Args:
        gt: The ground-truth index.
        detections: COCO result dicts; may be empty (every class with ground truth then scores 0).
        slices: Named subsets of the images (origin batches), each scored from the same matches.

    Returns:
        The score.
    """
    dets = [dict(d) for d in detections]
    ev = run_cocoeval(gt, dets)
    parts = {name: summarize(gt, ev, ids) for name, ids in (slices or {}).items()}
    overall = summarize(gt, ev)  # last: ev.eval then holds all images' curves (for the plots)
    return Score(overall, parts, len(dets), ev)


def _per_class(ev: COCOeval, names: Mapping[int, str], area: int = 0) -> dict[str, float]:
    """AP@[.50:.95] per category from the accumulated precision array (area range ``area``: 0 = all; maxDets 100)."""
    precision = ev.eval["precision"]  # [T, R, K, A, M]
    out = {}
    for k, cat_id in enumerate(ev.params.catIds):
        p = precision[:, :, k, area, -1]
        valid = p[p > -1]
        out[names[cat_id]] = float(np.mean(valid)) if valid.size else -1.0
    return out


def _per_class_size(ev: COCOeval, names: Mapping[int, str]) -> dict[str, dict[str, float]]:
    """Category name -> size -> AP@[.50:.95] (COCOeval's area ranges small, medium, large)."""
    by_size = {s: _per_class(ev, names, 1 + i) for i, s in enumerate(SIZES)}
    return {n: {s: by_size[s][n] for s in SIZES} for n in names.values()}


def size_of(area: float) -> str:
    """COCO's size of an object of ``area`` square pixels: ``small`` below 32², ``medium`` below 96², else ``large``."""
    return "small" if area < 32**2 else "medium" if area < 96**2 else "large"
