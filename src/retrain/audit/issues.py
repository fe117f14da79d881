"""cleanlab's object-detection label-issue finder, fed the champion's predictions and a batch's labels.

cleanlab (``cleanlab.object_detection``, AGPL-3.0 like this project) scores every box: an *overlooked* score per
confident predicted box with no label over it (a missing label), a *swap* score per label (a confident prediction of
another class over it: the wrong class), a *bad-location* score per label (its best same-class prediction overlaps
it poorly).  ``filter.find_label_issues`` marks a box as an issue when its score is at most its class's threshold
(the detector's own per-class AP on these images, scaled) and flags an image with any issue box; ``rank`` scores
each image.  This module runs those same steps through cleanlab's functions, only keeping each issue box (which
the public ``find_label_issues`` pools away) so that the report names its kind, and taking the confidence that
counts as "confident" as a parameter (cleanlab's 0.95 is a level a small detector seldom reaches).  With
``confident=0.95`` it flags exactly the images ``find_label_issues`` flags and scores them as
``get_label_quality_scores`` does (``tests/unit/test_audit_units.py`` holds cleanlab to that).  A class the champion
never predicts (a new class) has AP 0 on these images, so its threshold is 0 and its labels are never issues.

Nothing here is written by hand: the scores, the per-class thresholds and the pooling are cleanlab's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cleanlab.internal import constants as C
from cleanlab.object_detection import filter as cl_filter
from cleanlab.object_detection import rank

KINDS = ("missing", "wrong_class", "bad_location")


@dataclass(frozen=True)
class Issue:
    """One suspect box: ``bbox`` is COCO x, y, w, h in the image's pixels; ``label``/``predicted`` are class names."""

    kind: str
    bbox: tuple[float, float, float, float]
    label: str | None
    predicted: str | None
    confidence: float | None
    score: float


@dataclass(frozen=True)
class ImageAudit:
    """One image: cleanlab's label quality score (0..1, low = suspect), its issue boxes, and whether it is flagged."""

    score: float
    issues: list[Issue] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        return bool(self.issues)


def _xyxy(b: Sequence[float]) -> list[float]:
    return [float(b[0]), float(b[1]), float(b[0]) + float(b[2]), float(b[1]) + float(b[3])]


def _xywh(b: Sequence[float]) -> tuple[float, float, float, float]:
    return (round(float(b[0]), 2), round(float(b[1]), 2), round(float(b[2] - b[0]), 2), round(float(b[3] - b[1]), 2))


def cleanlab_inputs(labels: Sequence[Sequence[tuple[int, Sequence[float]]]],
                    predictions: Sequence[Sequence[tuple[int, Sequence[float], float]]], classes: int
                    ) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Per image: labels as ``{"bboxes": (L, 4) x1y1x2y2, "labels": (L,)}``, predictions as one (M, 5) array per class.

    Args:
        labels: Per image, ``(class index, COCO x, y, w, h)`` of each label box.
        predictions: Per image, ``(class index, COCO x, y, w, h, confidence)`` of each predicted box.
        classes: The number of classes K.
    """
    cl_labels = [{"bboxes": np.array([_xyxy(b) for _, b in im], dtype=np.float64).reshape(-1, 4),
                  "labels": np.array([k for k, _ in im], dtype=np.int64)} for im in labels]
    cl_preds = []
    for im in predictions:
        per_class = np.empty(classes, dtype=object)
        for k in range(classes):
            rows = [[*_xyxy(b), p] for c, b, p in im if c == k]
            per_class[k] = np.array(rows, dtype=np.float64).reshape(-1, 5)
        cl_preds.append(per_class)
    return cl_labels, cl_preds


def _best_overlap(iou: np.ndarray, row: int, mask: np.ndarray) -> int | None:
    """The prediction (column) of ``mask`` that overlaps label ``row`` most, if any overlaps it at all."""
    cols = np.flatnonzero(mask)
    if not len(cols) or iou.shape[1] == 0:
        return None
    best = cols[int(np.argmax(iou[row, cols]))]
    return int(best) if iou[row, best] > 0 else None


def find_issues(cl_labels: list[dict[str, Any]], cl_preds: list[np.ndarray], names: Sequence[str], confident: float
                ) -> list[ImageAudit]:
    """Score every image and name its issue boxes, through cleanlab's object-detection functions.

    Args:
        cl_labels: Labels in cleanlab's format (``cleanlab_inputs``).
        cl_preds: Predictions in cleanlab's format.
        names: Class names, by index.
        confident: The predicted-box confidence that counts as confident (cleanlab's ``high_probability_threshold``;
            its ``find_label_issues`` uses 0.95).

    Returns:
        One ``ImageAudit`` per image, in input order.
    """
    if not cl_labels:
        return []
    aux = rank._get_valid_inputs_for_compute_scores(C.ALPHA, cl_labels, cl_preds)
    overlooked = rank.compute_overlooked_box_scores(alpha=C.ALPHA, high_probability_threshold=confident,
                                                    auxiliary_inputs=aux)
    badloc = rank.compute_badloc_box_scores(alpha=C.ALPHA, low_probability_threshold=C.LOW_PROBABILITY_THRESHOLD,
                                            auxiliary_inputs=aux)
    swap = rank.compute_swap_box_scores(alpha=C.ALPHA, high_probability_threshold=confident, auxiliary_inputs=aux,
                                        overlapping_label_check=True)
    per_class_ap = cl_filter._get_per_class_ap(cl_labels, cl_preds)  # what find_label_issues thresholds against
    # get_label_quality_scores' own steps, with the same "confident" level as the issue boxes.
    image_scores = rank._get_subtype_label_quality_scores(
        cl_labels, cl_preds, alpha=C.ALPHA, low_probability_threshold=C.LOW_PROBABILITY_THRESHOLD,
        high_probability_threshold=confident, temperature=C.TEMPERATURE, overlapping_label_check=True)
    out = []
    for i, a in enumerate(aux):
        issues: list[Issue] = []
        pl, pp, pb = a["pred_labels"], a["pred_label_probs"], a["pred_bboxes"]
        ll, lb, iou = a["lab_labels"], a["lab_bboxes"], a["iou_matrix"]
        for j, s in enumerate(overlooked[i]):
            k = int(pl[j])
            if not np.isnan(s) and s <= per_class_ap[k] * C.OVERLOOKED_THRESHOLD_FACTOR:
                issues.append(Issue("missing", _xywh(pb[j]), None, names[k], round(float(pp[j]), 4), float(s)))
        for j, k in enumerate(int(x) for x in ll):
            s_swap, s_bad = swap[i][j], badloc[i][j]
            if not np.isnan(s_swap) and s_swap <= per_class_ap[k] * C.SWAP_THRESHOLD_FACTOR:
                other = _best_overlap(iou, j, pl != k)
                issues.append(Issue("wrong_class", _xywh(lb[j]), names[k], None if other is None else names[pl[other]],
                                    None if other is None else round(float(pp[other]), 4), float(s_swap)))
            elif not np.isnan(s_bad) and s_bad <= per_class_ap[k] * C.BADLOC_THRESHOLD_FACTOR:
                same = _best_overlap(iou, j, pl == k)
                issues.append(Issue("bad_location", _xywh(lb[j]), names[k], names[k] if same is not None else None,
                                    None if same is None else round(float(pp[same]), 4), float(s_bad)))
        out.append(ImageAudit(round(float(image_scores[i]), 6), issues))
    return out
