"""The great-expectations suites on small tables with one planted defect per rule (real GX, in process)."""

from __future__ import annotations

import pytest

from retrain.config import ValidateParams
from retrain.validation.gx import run_rules
from retrain.validation.suite import batch_rules, master_rules
from retrain.validation.tables import box_table, class_table, image_table


def _coco():
    images = [{"id": i, "file_name": f"batches/b{1 + i % 2}/images/{i}.jpg", "width": 100, "height": 80,
               "sha256": f"{i:064x}", "split": "val" if i % 4 == 0 else "train", "batch": f"b{1 + i % 2}"}
              for i in range(1, 21)]
    anns = [{"id": k, "image_id": 1 + k % 20, "category_id": 1 + k % 3, "bbox": [10.0, 10.0, 20.0, 20.0]}
            for k in range(1, 61)]
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}]
    return {"info": {"batches": ["b1", "b2"]}, "categories": cats, "images": images, "annotations": anns}


def _statuses(coco, params=None, decoded=None):
    params = params or ValidateParams(min_train_instances=5, min_val_instances=1)
    decoded = decoded or {im["sha256"]: (im["width"], im["height"]) for im in coco["images"]}
    boxes = box_table(coco)
    tables = {"boxes": boxes, "images": image_table(coco, decoded), "classes": class_table(coco, boxes)}
    results = run_rules(master_rules(params, [c["id"] for c in coco["categories"]], None), tables)
    out = {}
    for r in results:
        out.setdefault(r.rule, set()).add(r.status)
    return out, results


def test_clean_tables_pass_every_rule():
    statuses, results = _statuses(_coco())
    assert all(s == {"pass"} for s in statuses.values()), statuses
    assert {"schema", "box-inside-image", "box-area", "known-class", "image-size", "split", "val-fraction",
            "min-train-instances", "unique-content", "group-split"} <= statuses.keys()


@pytest.mark.parametrize("plant,rule", [
    (lambda c: c["annotations"][0].update(bbox=[95.0, 10.0, 20.0, 5.0]), "box-inside-image"),
    (lambda c: c["annotations"][0].update(bbox=[5.0, 10.0, 0.0, 5.0]), "box-area"),
    (lambda c: c["annotations"][0].update(bbox=[float("nan"), 10.0, 3.0, 5.0]), "box-finite"),
    (lambda c: c["annotations"][0].update(category_id=9), "known-class"),
    (lambda c: c["annotations"][1].update(id=c["annotations"][0]["id"]), "unique-id"),
    (lambda c: c["images"][1].update(sha256=c["images"][0]["sha256"]), "unique-content"),
    (lambda c: c["images"][0].update(split="holdout"), "split"),
    # two near-copies (one group) in different splits: merge never writes this; the suite would catch it
    (lambda c: (c["images"][0].update(group=1, split="train"), c["images"][1].update(group=1, split="test")),
     "group-split"),
    (lambda c: c["images"][0].update(width=101), "image-size"),
])
def test_each_planted_defect_fails_its_rule_and_names_the_file(plant, rule):
    coco = _coco()
    decoded = {im["sha256"]: (im["width"], im["height"]) for im in coco["images"]}
    plant(coco)
    statuses, results = _statuses(coco, decoded=decoded)
    assert "fail" in statuses[rule], statuses[rule]
    failed = [r for r in results if r.rule == rule and r.status == "fail"]
    assert any(e["file"].startswith("batches/b") for r in failed for e in r.examples), failed
    assert all(s == {"pass"} for k, s in statuses.items() if k not in (rule, "schema", "box-finite")), statuses


def test_levels_and_batch_rules():
    coco = _coco()
    statuses, _ = _statuses(coco, ValidateParams(min_train_instances=1000, instances_level="warn"))
    assert statuses["min-train-instances"] == {"warn"}
    statuses, _ = _statuses(coco, ValidateParams(min_train_instances=1000, instances_level="fail"))
    assert statuses["min-train-instances"] == {"fail"}
    names = {r.name for r in batch_rules(ValidateParams(), [1, 2, 3])}
    assert "split" not in names and "min-train-instances" not in names and "box-inside-image" in names
