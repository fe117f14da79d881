"""What the paired bootstrap adds to an evaluation, against one ``COCOeval`` of one model.

Synthetic val set (numpy, seeded): ``--images`` 640x480 images, ``--classes`` classes, 1-8 ground-truth boxes
each, and detections of two models ("champion", "candidate"): jittered copies of the ground truth (some missed,
a few with the wrong class) plus false positives, 10-20 per image, scores correlated with the IoU to the truth.

1. One COCOeval: ``run_cocoeval`` + ``summarize`` of one model (the evaluation runs one per model anyway).
2. The whole bootstrap: ``matches`` of both evaluated models + ``paired_delta_interval`` (``--resamples``,
   95%), i.e. everything the bootstrap adds on top of the two COCOevals. Target: bootstrap < 3x one COCOeval.
It also checks that ``resampled_map`` with all weights 1 equals ``summarize``'s mAP50-95 (to 1e-9).
Usage: python bench/eval_speed.py [--images N] [--classes N] [--resamples B] [--seed S] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import time
from typing import Any

import numpy as np
from common import cpu_model

from retrain.metrics.bootstrap import matches, paired_delta_interval, resampled_map
from retrain.metrics.coco import ground_truth, run_cocoeval, summarize

W_IMG, H_IMG = 640.0, 480.0


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise IoU of ``[N, 4]`` xywh boxes."""
    x1, y1 = np.maximum(a[:, 0], b[:, 0]), np.maximum(a[:, 1], b[:, 1])
    x2 = np.minimum(a[:, 0] + a[:, 2], b[:, 0] + b[:, 2])
    y2 = np.minimum(a[:, 1] + a[:, 3], b[:, 1] + b[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    return inter / (a[:, 2] * a[:, 3] + b[:, 2] * b[:, 3] - inter)


def random_boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    """``[n, 4]`` xywh boxes of random sizes inside the image."""
    w, h = rng.uniform(10, 300, n), rng.uniform(10, 240, n)
    return np.stack([rng.uniform(0, W_IMG - w), rng.uniform(0, H_IMG - h), w, h], axis=1)


def synthetic(images: int, classes: int, seed: int) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """A COCO document and the COCO result dicts of two noisy models."""
    rng = np.random.default_rng(seed)
    doc: dict[str, Any] = {"images": [], "annotations": [],
                           "categories": [{"id": c, "name": f"class{c}"} for c in range(1, classes + 1)]}
    dets: dict[str, list[dict[str, Any]]] = {"champion": [], "candidate": []}
    noise = {"champion": (0.10, 0.80), "candidate": (0.08, 0.85)}  # box jitter (fraction of size), recall
    for img in range(1, images + 1):
        doc["images"].append({"id": img, "file_name": f"{img}.jpg", "width": int(W_IMG), "height": int(H_IMG)})
        n_gt = int(rng.integers(1, 9))
        gt, cls = random_boxes(rng, n_gt), rng.integers(1, classes + 1, n_gt)
        for box, c in zip(gt, cls, strict=True):
            doc["annotations"].append({"id": len(doc["annotations"]) + 1, "image_id": img, "category_id": int(c),
                                       "bbox": [float(v) for v in box], "iscrowd": 0})
        for model, (jitter, recall) in noise.items():
            hit = rng.random(n_gt) < recall
            box = gt[hit] + rng.normal(0, jitter, (int(hit.sum()), 4)) * gt[hit][:, [2, 3, 2, 3]]
            box[:, 2:] = np.clip(box[:, 2:], 2, None)
            score = np.clip(0.7 * iou(box, gt[hit]) + 0.3 * rng.random(len(box)), 0.01, 1)
            c = np.where(rng.random(len(box)) < 0.05, rng.integers(1, classes + 1, len(box)), cls[hit])
            n_fp = max(int(rng.integers(10, 21)) - len(box), 0)
            box = np.concatenate([box, random_boxes(rng, n_fp)])
            score = np.concatenate([score, 0.6 * rng.random(n_fp)])
            c = np.concatenate([c, rng.integers(1, classes + 1, n_fp)])
            dets[model] += [{"image_id": img, "category_id": int(k), "bbox": [float(v) for v in b], "score": float(s)}
                            for b, k, s in zip(box, c, score, strict=True)]
    return doc, dets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--classes", type=int, default=20)
    ap.add_argument("--resamples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also profile the bootstrap (cProfile, top 15)")
    args = ap.parse_args()

    doc, dets = synthetic(args.images, args.classes, args.seed)
    gt = ground_truth(doc, split=None)
    evs, maps, coco_s = {}, {}, {}
    for model, d in dets.items():
        t0 = time.perf_counter()
        ev = run_cocoeval(gt, d)
        assert ev is not None
        maps[model] = summarize(gt, ev).map
        coco_s[model], evs[model] = time.perf_counter() - t0, ev

    def bootstrap() -> tuple[float, float, Any]:
        t0 = time.perf_counter()
        m_a, m_b = matches(evs["champion"]), matches(evs["candidate"])
        t1 = time.perf_counter()
        ci = paired_delta_interval(m_a, m_b, n_images=args.images, resamples=args.resamples, confidence=0.95,
                                   seed=0)
        return t1 - t0, time.perf_counter() - t1, ci

    match_s, interval_s, ci = bootstrap()
    boot_s, one_coco = match_s + interval_s, coco_s["champion"]
    ratio = boot_s / one_coco

    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"Data: {args.images:,} images, {args.classes} classes, {len(doc['annotations']):,} GT boxes, "
          f"{len(dets['champion']):,} champion / {len(dets['candidate']):,} candidate detections, "
          f"{args.resamples} resamples\n")
    print("| what | seconds |\n|---|---:|")
    for model in dets:
        print(f"| one COCOeval ({model}): run_cocoeval + summarize | {coco_s[model]:.2f} |")
    print(f"| bootstrap: matches() of both models | {match_s:.2f} |")
    print(f"| bootstrap: paired_delta_interval ({args.resamples} resamples) | {interval_s:.2f} |")
    print(f"| the whole bootstrap | {boot_s:.2f} |\n")
    verdict = "met" if ratio < 3 else "NOT met"
    print(f"bootstrap / one COCOeval (champion) = {ratio:.2f}; target < 3x: {verdict}")
    print(f"delta mAP50-95 (candidate - champion) = {maps['candidate'] - maps['champion']:+.4f}, "
          f"95% interval [{ci.low:+.4f}, {ci.high:+.4f}]\n")

    for model, ev in evs.items():
        plain = float(resampled_map(matches(ev), np.ones((1, args.images)))[0])
        print(f"{model}: resampled_map(ones) = {plain:.12f}, summarize().map = {maps[model]:.12f}")
        assert abs(plain - maps[model]) < 1e-9, (model, plain, maps[model])
    print("correctness: resampled_map with all weights 1 equals COCOeval's mAP50-95 (1e-9) for both models")

    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(bootstrap)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)


if __name__ == "__main__":
    main()
