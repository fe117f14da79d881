"""Paired bootstrap of mAP50-95 over val images, from one ``COCOeval`` run per model.

``COCOeval.evaluate()`` already matched every detection to ground truth, image by image (``evalImgs``).
A bootstrap resample of the images only changes how many times each image counts, so a resample's
mAP50-95 is ``COCOeval.accumulate()`` over the same matches with each detection (and each image's
ground-truth count) weighted by its image's count.  That is what :func:`resampled_map` computes, for all
resamples at once, without matching again: with all weights 1 it equals ``COCOeval``'s own mAP50-95.

The champion and the candidate are resampled with the same image counts (a paired bootstrap), so the
interval is of the per-resample difference, not of two independent scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pycocotools.cocoeval import COCOeval


@dataclass(frozen=True)
class CategoryMatches:
    """One category's detections over all images, sorted by score as ``COCOeval.accumulate`` sorts them.

    Attributes:
        det_image: Image index (into ``Matches.image_ids``) of each detection.
        tp: ``[T, N]`` true positive at each IoU threshold (not ignored, matched).
        fp: ``[T, N]`` false positive at each IoU threshold (not ignored, unmatched).
        gt: ``[I]`` ground-truth boxes (not ignored) per image.
    """

    det_image: np.ndarray
    tp: np.ndarray
    fp: np.ndarray
    gt: np.ndarray


@dataclass(frozen=True)
class Matches:
    """Every category's matches of one evaluated model.

    Attributes:
        image_ids: The evaluated image ids, in ``COCOeval``'s order.
        categories: One entry per category id of ``COCOeval.params.catIds``.
        rec_thrs: The recall thresholds precision is sampled at (101 points).
    """

    image_ids: tuple[int, ...]
    categories: tuple[CategoryMatches, ...]
    rec_thrs: np.ndarray


def matches(ev: COCOeval) -> Matches:
    """Collect the per-image matches of an evaluated (``evaluate()`` done) ``COCOeval``, area range "all".

    Args:
        ev: The evaluated ``COCOeval``.

    Returns:
        Its matches, per category, sorted as ``accumulate()`` sorts them.
    """
    p = ev.params
    n_img, n_area, max_det = len(p.imgIds), len(p.areaRng), p.maxDets[-1]
    n_thr = len(p.iouThrs)
    cats = []
    for k in range(len(p.catIds)):
        base = k * n_area * n_img  # evalImgs is ordered [category][area range][image]; area "all" is index 0
        scores, images, dtm, dtig = [], [], [], []
        gt = np.zeros(n_img, dtype=np.float64)
        for i in range(n_img):
            e = ev.evalImgs[base + i]
            if e is None:
                continue
            s = np.asarray(e["dtScores"][:max_det], dtype=np.float64)
            scores.append(s)
            images.append(np.full(len(s), i, dtype=np.int64))
            dtm.append(np.asarray(e["dtMatches"])[:, :max_det].reshape(n_thr, -1))
            dtig.append(np.asarray(e["dtIgnore"])[:, :max_det].reshape(n_thr, -1))
            gt[i] = np.count_nonzero(np.asarray(e["gtIgnore"]) == 0)
        if scores:
            order = np.argsort(-np.concatenate(scores), kind="mergesort")  # as accumulate(): ties keep image order
            matched = np.concatenate(dtm, axis=1)[:, order] != 0
            ignored = np.concatenate(dtig, axis=1)[:, order] != 0
            cats.append(CategoryMatches(np.concatenate(images)[order], matched & ~ignored, ~matched & ~ignored, gt))
        else:
            empty = np.zeros((n_thr, 0), dtype=bool)
            cats.append(CategoryMatches(np.zeros(0, dtype=np.int64), empty, empty, gt))
    return Matches(tuple(int(i) for i in p.imgIds), tuple(cats), np.asarray(p.recThrs, dtype=np.float64))


def resample_weights(n_images: int, resamples: int, seed: int) -> np.ndarray:
    """``[B, I]`` counts: how many times each image is drawn in each of ``resamples`` bootstrap samples."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_images, size=(resamples, n_images))
    return np.stack([np.bincount(row, minlength=n_images) for row in draws]).astype(np.float64)


def resampled_map(m: Matches, weights: np.ndarray) -> np.ndarray:
    """mAP50-95 of each weighting of the images, as ``COCOeval.accumulate`` + ``summarize`` would give it.

    Args:
        m: The model's matches.
        weights: ``[B, I]`` image counts (rows of ones give the plain mAP50-95).

    Returns:
        ``[B]`` mAP50-95; ``-1`` for a row in which no category has ground truth (as ``summarize``).
    """
    weights = np.atleast_2d(weights)
    n_rows, n_rec = weights.shape[0], len(m.rec_thrs)
    total = np.zeros(n_rows)
    counted = np.zeros(n_rows)
    eps = np.spacing(1)
    for cat in m.categories:
        npig = weights @ cat.gt  # [B] ground truth in each resample
        has_gt = npig > 0
        counted += has_gt * cat.tp.shape[0]  # T threshold rows of R points each count, zeros included
        if not cat.det_image.size:
            continue
        w = weights[:, cat.det_image]  # [B, N]
        safe_npig = np.where(has_gt, npig, 1.0)[:, None]
        for tp_t, fp_t in zip(cat.tp, cat.fp, strict=True):
            tp = np.cumsum(w * tp_t, axis=1)
            fp = np.cumsum(w * fp_t, axis=1)
            rc = tp / safe_npig
            pr = tp / (fp + tp + eps)
            pr = np.maximum.accumulate(pr[:, ::-1], axis=1)[:, ::-1]  # precision envelope
            for b in np.flatnonzero(has_gt):
                idx = np.searchsorted(rc[b], m.rec_thrs, side="left")
                hit = idx < pr.shape[1]
                total[b] += pr[b, idx[hit]].sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counted > 0, total / (counted * n_rec), -1.0)


@dataclass(frozen=True)
class DeltaInterval:
    """Bootstrap interval of candidate-minus-champion mAP50-95.

    Attributes:
        low: Lower bound.
        high: Upper bound.
        confidence: Its confidence level.
        resamples: Bootstrap resamples drawn.
    """

    low: float
    high: float
    confidence: float
    resamples: int


def paired_delta_interval(champion: Matches | None, candidate: Matches | None, n_images: int, resamples: int,
                          confidence: float, seed: int) -> DeltaInterval:
    """Percentile interval of the candidate-minus-champion mAP50-95 over paired image resamples.

    Args:
        champion: The champion's matches; ``None`` when it detected nothing (it scores 0 in every resample).
        candidate: The candidate's matches on the same images; ``None`` likewise.
        n_images: The val images (both were evaluated on all of them).
        resamples: B.
        confidence: e.g. 0.95.
        seed: Seeds the image draws.

    Returns:
        The interval.

    Raises:
        ValueError: The two were not evaluated on the same images.
    """
    ids = {m.image_ids for m in (champion, candidate) if m is not None}
    if len(ids) > 1 or any(len(i) != n_images for i in ids):
        raise ValueError("champion and candidate were evaluated on different images")
    w = resample_weights(n_images, resamples, seed)
    zero = np.zeros(resamples)
    a = zero if champion is None else np.maximum(resampled_map(champion, w), 0)
    b = zero if candidate is None else np.maximum(resampled_map(candidate, w), 0)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(b - a, [tail, 100 - tail])
    return DeltaInterval(float(low), float(high), confidence, resamples)
