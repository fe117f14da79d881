"""The promotion gate (pure) and the bootstrap's reuse of COCOeval's matches, on generated detections."""

from __future__ import annotations

import numpy as np
import pytest

from retrain.config import PromoteParams
from retrain.metrics.bootstrap import matches, paired_delta_interval, resample_weights, resampled_map
from retrain.metrics.coco import ground_truth, run_cocoeval, summarize
from retrain.promotion.gate import ModelMetrics, decide

GATE = PromoteParams(min_map=0.3, min_delta=0.01, max_class_drop=0.05, min_class_instances=5, max_slice_drop=0.05)
CLASSES = {"cat": 20, "dog": 20, "rare": 2}


def _m(map_: float, per_class: dict[str, float], slices: dict[str, float] | None = None,
       ci: tuple[float, float] | None = None) -> ModelMetrics:
    return ModelMetrics(map_, per_class, slices or {"old": map_, "new": map_}, CLASSES, ci)


def test_first_model_needs_min_map():
    assert decide(None, _m(0.31, {}), GATE).promote
    d = decide(None, _m(0.29, {}), GATE)
    assert not d.promote and "below min_map 0.3000" in d.reasons[0]


def test_a_better_candidate_is_promoted_and_a_worse_one_is_refused_with_the_delta():
    champ = _m(0.50, {"cat": 0.5, "dog": 0.5, "rare": 0.5})
    assert decide(champ, _m(0.52, {"cat": 0.52, "dog": 0.52, "rare": 0.5}), GATE).promote
    worse = decide(champ, _m(0.505, {"cat": 0.5, "dog": 0.51, "rare": 0.5}), GATE)
    assert not worse.promote and worse.reasons == (
        "mAP50-95 0.5050 vs champion 0.5000: delta +0.0050 is below min_delta +0.0100",)


def test_the_forgetting_guard_refuses_a_collapsed_class_but_only_reports_a_rare_one():
    champ = _m(0.50, {"cat": 0.6, "dog": 0.4, "rare": 0.5})
    collapsed = decide(champ, _m(0.60, {"cat": 0.9, "dog": 0.1, "rare": 0.5}), GATE)
    assert not collapsed.promote
    assert collapsed.reasons == ("forgetting: class dog AP50-95 fell 0.4000 -> 0.1000 (-0.3000; max_class_drop "
                                 "0.0500)",)
    rare = decide(champ, _m(0.60, {"cat": 0.9, "dog": 0.45, "rare": 0.0}), GATE)
    assert rare.promote and "class rare" in rare.notes[0] and "2 boxes" in rare.notes[0]


def test_a_slice_that_regresses_and_an_insignificant_delta_are_reasons():
    champ = _m(0.50, {"cat": 0.5, "dog": 0.5}, {"old": 0.5, "new": 0.5})
    d = decide(champ, _m(0.53, {"cat": 0.53, "dog": 0.53}, {"old": 0.40, "new": 0.66}, ci=(-0.01, 0.07)),
               GATE.model_copy(update={"require_significant": True}))
    assert not d.promote and len(d.reasons) == 2
    assert d.reasons[0].startswith("slice old: mAP50-95 fell 0.5000 -> 0.4000")
    assert "does not lie above 0" in d.reasons[1]
    assert decide(champ, _m(0.53, {"cat": 0.53, "dog": 0.53}, ci=(0.01, 0.05)),
                  GATE.model_copy(update={"require_significant": True})).promote


def _scene(seed: int, n_images: int = 60, noise: float = 6.0) -> tuple[dict, list[dict]]:
    """A COCO document and jittered, partly wrong detections of it."""
    rng = np.random.default_rng(seed)
    images, anns, dets = [], [], []
    for i in range(1, n_images + 1):
        images.append({"id": i, "file_name": f"{i}.jpg", "width": 200, "height": 200})
        for _ in range(rng.integers(0, 4)):
            x, y, w, h = (float(v) for v in (*rng.uniform(0, 120, 2), *rng.uniform(10, 70, 2)))
            c = int(rng.integers(1, 4))
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": c, "bbox": [x, y, w, h]})
            if rng.random() < 0.8:
                j = rng.normal(0, noise, 4)
                dets.append({"image_id": i, "category_id": c if rng.random() < 0.9 else 1 + c % 3,
                             "bbox": [x + j[0], y + j[1], max(1.0, w + j[2]), max(1.0, h + j[3])],
                             "score": float(rng.uniform(0.05, 1))})
        for _ in range(rng.integers(0, 3)):  # false positives
            dets.append({"image_id": i, "category_id": int(rng.integers(1, 4)),
                         "bbox": [*rng.uniform(0, 150, 2).tolist(), 20.0, 20.0], "score": float(rng.uniform(0, 0.6))})
    cats = [{"id": c, "name": n} for c, n in ((1, "a"), (2, "b"), (3, "c"))]
    return {"images": images, "annotations": anns, "categories": cats}, dets


def test_resampled_map_with_unit_weights_is_cocoevals_own_map():
    doc, dets = _scene(1)
    gt = ground_truth(doc, split=None)
    ev = run_cocoeval(gt, dets)
    assert resampled_map(matches(ev), np.ones((1, 60)))[0] == pytest.approx(summarize(gt, ev).map, abs=1e-12)


def test_a_resample_scores_as_cocoeval_on_the_resampled_images():
    """Weights = counts: the same as COCOeval on a dataset where each drawn image appears that many times."""
    doc, dets = _scene(2)
    gt = ground_truth(doc, split=None)
    m = matches(run_cocoeval(gt, dets))
    for row in resample_weights(60, 3, seed=5):
        images, anns, rdets = [], [], []
        for i, count in enumerate(row.astype(int), start=1):
            for copy in range(count):
                new_id = len(images) + 1
                images.append({**doc["images"][i - 1], "id": new_id})
                anns += [{**a, "id": len(anns) + k + 1, "image_id": new_id}
                         for k, a in enumerate(a for a in doc["annotations"] if a["image_id"] == i)]
                # scores nudged per copy so that ties between copies cannot reorder differently
                rdets += [{**d, "image_id": new_id, "score": d["score"] - copy * 1e-9} for d in dets
                          if d["image_id"] == i]
        rgt = ground_truth({"images": images, "annotations": anns, "categories": doc["categories"]}, split=None)
        expected = summarize(rgt, run_cocoeval(rgt, rdets)).map
        assert resampled_map(m, row[None])[0] == pytest.approx(expected, abs=1e-6)


def test_the_paired_interval_covers_a_real_difference_and_handles_a_model_with_no_detections():
    doc, good = _scene(3, n_images=120, noise=2.0)
    _, poor = _scene(3, n_images=120, noise=12.0)
    gt = ground_truth(doc, split=None)
    a, b = matches(run_cocoeval(gt, poor)), matches(run_cocoeval(gt, good))
    delta = summarize(gt, run_cocoeval(gt, good)).map - summarize(gt, run_cocoeval(gt, poor)).map
    ci = paired_delta_interval(a, b, 120, resamples=200, confidence=0.95, seed=0)
    assert 0 < ci.low < delta < ci.high
    assert paired_delta_interval(a, b, 120, 200, 0.95, 0) == ci  # seeded
    empty = paired_delta_interval(None, b, 120, 200, 0.95, 0)
    assert 0 < empty.low <= empty.high
    assert summarize(gt, run_cocoeval(gt, [])).map == 0.0  # no detections: 0, not a crash


def test_size_slices_come_from_cocoeval_overall_and_per_class():
    doc = {"categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}],
           "images": [{"id": i, "file_name": f"{i}.jpg", "width": 400, "height": 400, "split": "test"}
                      for i in (1, 2)],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 20], "area": 400},
                           {"id": 2, "image_id": 1, "category_id": 1, "bbox": [100, 100, 150, 150], "area": 22500},
                           {"id": 3, "image_id": 2, "category_id": 2, "bbox": [50, 50, 60, 60], "area": 3600}]}
    gt = ground_truth(doc, "test")
    # a finds its large box only; b its medium box
    dets = [{"image_id": 1, "category_id": 1, "bbox": [100, 100, 150, 150], "score": 0.9},
            {"image_id": 2, "category_id": 2, "bbox": [50, 50, 60, 60], "score": 0.8}]
    m = summarize(gt, run_cocoeval(gt, dets))
    assert m.sizes == pytest.approx({"small": 0.0, "medium": 1.0, "large": 1.0})
    assert {k: pytest.approx(v) for k, v in m.per_class_size.items()} == {
        "a": {"small": 0.0, "medium": -1.0, "large": 1.0}, "b": {"small": -1.0, "medium": 1.0, "large": -1.0}}
    empty = summarize(gt, None)  # no detections: 0 where there is ground truth, -1 where none
    assert empty.sizes == {"small": 0.0, "medium": 0.0, "large": 0.0}
    assert empty.per_class_size["b"] == {"small": -1.0, "medium": 0.0, "large": -1.0}


def test_the_size_guard_is_off_by_default_and_gates_like_the_forgetting_guard():
    boxes = {"cat": {"small": 30, "medium": 10, "large": 3}, "dog": {"small": 2, "medium": 20, "large": 20}}

    def sized(small: float, cat_large: float, dog_small: float) -> ModelMetrics:
        return ModelMetrics(0.5, {"cat": 0.5, "dog": 0.5}, {}, CLASSES, None, {"small": small, "medium": 0.5,
                            "large": 0.5}, {"cat": {"small": small, "medium": 0.5, "large": cat_large},
                                           "dog": {"small": dog_small, "medium": 0.5, "large": 0.5}}, boxes)

    champ = sized(0.4, 0.6, 0.6)
    worse = ModelMetrics(**{**sized(0.2, 0.1, 0.1).__dict__, "map": 0.6})
    assert decide(champ, worse, GATE).promote  # max_size_drop: null
    d = decide(champ, worse, GATE.model_copy(update={"max_size_drop": 0.05}))
    assert not d.promote
    assert d.reasons == ("size small: mAP50-95 fell 0.4000 -> 0.2000 (-0.2000; max_size_drop 0.0500)",
                         "size: class cat, small objects: AP50-95 fell 0.4000 -> 0.2000 (-0.2000; max_size_drop "
                         "0.0500)")
    # cat's 3 large boxes and dog's 2 small ones are too few to gate: reported
    assert any("class cat, large objects" in n and "3 boxes" in n for n in d.notes)
    assert any("class dog, small objects" in n and "2 boxes" in n for n in d.notes)
