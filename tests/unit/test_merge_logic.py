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
    assert manifest_csv(one.coco).splitlines()[0] == "image_id,file_name,sha256,width,height,split,batch,group"


def test_three_splits_by_hash_and_adding_test_moves_no_trained_image_into_test():
    shas = [f"{i:064x}" for i in range(4000)]
    old = [assign_split(s, 0.2, "salt") for s in shas]
    new = [assign_split(s, 0.2, "salt", 0.2) for s in shas]
    assert new == [assign_split(s, 0.2, "salt", 0.2) for s in shas]  # reruns
    for split, share in (("test", 0.2), ("val", 0.2), ("train", 0.6)):
        assert abs(new.count(split) / len(new) - share) < 0.03
    moves = {(a, b) for a, b in zip(old, new, strict=True) if a != b}
    assert moves == {("val", "test"), ("train", "val")}  # never train -> test


def test_split_is_stable_across_batch_order_and_new_batches_with_the_test_split():
    params = MergeParams(test_fraction=0.2)
    b1 = _doc(["a"], [(f"x{i}.jpg", f"{i:064x}", []) for i in range(40)])
    b2 = _doc(["a"], [(f"y{i}.jpg", f"{i + 100:064x}", []) for i in range(40)])
    b3 = _doc(["a"], [(f"z{i}.jpg", f"{i + 200:064x}", []) for i in range(40)])

    def splits(batches):
        return {i["sha256"]: i["split"] for i in merge_batches(batches, params).coco["images"]}

    first = splits([("b1", b1), ("b2", b2)])
    assert set(first.values()) == {"train", "val", "test"}
    assert splits([("b2", b2), ("b1", b1)]) == first
    grown = splits([("b1", b1), ("b2", b2), ("b3", b3)])
    assert {k: grown[k] for k in first} == first


def test_near_copies_and_sequences_share_their_first_images_split():
    params = MergeParams(test_fraction=0.2, near_duplicate_distance=4)  # tiny ints as hashes
    shas = [f"{i:064x}" for i in range(60)]
    hashes = {s: (i * 0x9E3779B97F4A7C15) % 2**64 for i, s in enumerate(shas)}  # far apart
    b1 = _doc(["a"], [(f"x{i}.jpg", shas[i], []) for i in range(30)])
    # batch 2: near-copies (3 bits off) of each of batch 1's images, and a 10-frame video
    copies = {f"c{i:063x}": hashes[shas[i]] ^ 0b10101 for i in range(30)}
    hashes |= copies
    b2 = _doc(["a"], [(f"c{i}.jpg", s, []) for i, s in enumerate(copies)] +
              [(f"v{i}.jpg", shas[30 + i], []) for i in range(10)])
    for im in b2["images"][30:]:
        im["sequence"] = "cam-7"
    r = merge_batches([("b1", b1), ("b2", b2)], params, hashes)
    ims = {i["sha256"]: i for i in r.coco["images"]}
    for i, copy in enumerate(copies):
        assert ims[copy]["split"] == ims[shas[i]]["split"] and ims[copy]["group"] == ims[shas[i]]["id"]
    video = {ims[shas[30 + i]]["split"] for i in range(10)}
    assert len(video) == 1
    g = r.report["groups"]
    assert g["count"] == 31 and g["images"] == 70 and g["largest"] == 10 and g["joined_by_sequence"] == 9
    assert g["moved_by_a_link"] == 0
    # off: the copies fall where their own hash puts them
    loose = merge_batches([("b1", b1), ("b2", b2)], MergeParams(test_fraction=0.2, near_duplicate_distance=-1),
                          hashes)
    assert loose.report["groups"]["count"] == 1  # the video only


def test_a_link_between_two_groups_moves_the_later_one_and_says_so():
    params = MergeParams(test_fraction=0.3, val_fraction=0.3, near_duplicate_distance=2)
    shas = [f"{i:064x}" for i in range(200)]
    split = {s: assign_split(s, 0.3, params.split_salt, 0.3) for s in shas}
    a = next(s for s in shas if split[s] == "train")
    b = next(s for s in shas if split[s] == "test")
    hashes = {a: 0, b: 0b1111, "bridge": 0b11}  # a-b: 4 bits; bridge is 2 from each
    b1 = _doc(["x"], [("a.jpg", a, []), ("b.jpg", b, [])])
    b2 = _doc(["x"], [("bridge.jpg", "bridge", [])])
    r = merge_batches([("b1", b1), ("b2", b2)], params, hashes)
    ims = {i["sha256"]: i for i in r.coco["images"]}
    assert ims[a]["split"] == ims[b]["split"] == ims["bridge"]["split"] == "train"
    assert r.report["groups"]["moved"] == [{"file_name": "batches/b1/images/b.jpg", "from": "test", "to": "train"}]
