from retrain.config import MergeParams
from retrain.fsutil import dumps_canonical
from retrain.merge import assign_split, manifest_csv, merge_batches, reconcile_classes


def _doc(cats, images):
    """images: list of (file, sha, [(cat_name, bbox)])"""
    cid = {n: i + 1 for i, n in enumerate(cats)}
    ims, anns = [], []
    for i, (f, sha, boxes) in enumerate(images, start=1):
        ims.append({"id": i, "file_name": f, "width": 100, "height": 100, "sha256": sha})
        for name, bbox in boxes:
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": cid[name], "bbox": bbox,
                         "area": bbox[2] * bbox[3]})
    return {"categories": [{"id": cid[n], "name": n} for n in cats], "images": ims, "annotations": anns}


def test_existing_class_keeps_its_id_and_new_class_gets_the_next():
    assert reconcile_classes([["a", "b"], ["c", "b", "a"]]) == {"a": 1, "b": 2, "c": 3}
    assert reconcile_classes([["a", "b"]]) == {"a": 1, "b": 2}


def test_split_is_a_function_of_content_alone():
    shas = [f"{i:064x}" for i in range(2000)]
    splits = [assign_split(s, 0.2, "salt") for s in shas]
    assert splits == [assign_split(s, 0.2, "salt") for s in shas]
    assert 0.16 < splits.count("val") / len(splits) < 0.24
    b1 = _doc(["a"], [("x.jpg", shas[0], []), ("y.jpg", shas[1], [])])
    b2 = _doc(["a"], [("z.jpg", shas[2], [])])
    m12 = merge_batches([("b1", b1), ("b2", b2)], MergeParams()).coco
    m21 = merge_batches([("b2", b2), ("b1", b1)], MergeParams()).coco
    assert {i["sha256"]: i["split"] for i in m12["images"]} == {i["sha256"]: i["split"] for i in m21["images"]}


def test_later_batch_wins_and_conflicts_are_listed():
    b1 = _doc(["a", "b"], [("x.jpg", "s1", [("a", [1, 1, 10, 10])]), ("y.jpg", "s2", [])])
    b2 = _doc(["b", "c"], [("x2.jpg", "s1", [("c", [2, 2, 5, 5])]), ("w.jpg", "s3", [("b", [0, 0, 3, 3])])])
    b3 = _doc(["a"], [("y.jpg", "s2", [])])
    r = merge_batches([("b1", b1), ("b2", b2), ("b3", b3)], MergeParams())
    ims = {i["sha256"]: i for i in r.coco["images"]}
    assert len(ims) == 3
    assert ims["s1"]["id"] == 1 and ims["s1"]["batch"] == "b2" and ims["s1"]["file_name"] == "batches/b2/images/x2.jpg"
    assert [a["category_id"] for a in r.coco["annotations"] if a["image_id"] == 1] == [3]
    assert r.coco["categories"] == [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}]
    conflicts = {c["sha256"]: c for c in r.report["conflicts"]}
    assert conflicts["s1"]["labels_differ"] is True and conflicts["s2"]["labels_differ"] is False
    assert r.report["totals"] == {"batches": 3, "images": 3, "boxes": 2, "classes": 3, "duplicates": 2,
                                  "conflicts": 1}


def test_output_is_deterministic():
    b1 = _doc(["a"], [(f"{i}.jpg", f"s{i}", [("a", [1, 1, 5, 5])]) for i in range(50)])
    one = merge_batches([("b1", b1)], MergeParams())
    two = merge_batches([("b1", b1)], MergeParams())
    assert dumps_canonical(one.coco) == dumps_canonical(two.coco)
    assert manifest_csv(one.coco) == manifest_csv(two.coco)
    assert manifest_csv(one.coco).splitlines()[0] == "image_id,file_name,sha256,width,height,split,batch"
