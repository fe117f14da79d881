"""All three formats on real data: coco128 as YOLO and as COCO give the same dataset; VOC round-trips."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from retrain.paths import Paths
from tests.helpers import coco_to_voc, coco_to_yolo, load_json, run_cli, shared_data


@pytest.fixture(scope="module")
def coco128() -> Path:
    data = shared_data()
    if data is None:
        if os.environ.get("CI"):
            pytest.fail("../shared/data is missing in CI")
        pytest.skip("../shared/data not present")
    return data


def _per_image(master: dict, batch: str) -> dict[str, list[tuple[str, list[float]]]]:
    cats = {c["id"]: c["name"] for c in master["categories"]}
    out: dict[str, list] = {Path(i["file_name"]).name: [] for i in master["images"] if i["batch"] == batch}
    names = {i["id"]: Path(i["file_name"]).name for i in master["images"] if i["batch"] == batch}
    for a in master["annotations"]:
        if a["image_id"] in names:
            out[names[a["image_id"]]].append((cats[a["category_id"]], a["bbox"]))
    return out


def test_coco128_as_yolo_and_as_coco_give_the_same_dataset(coco128: Path, workspace: Paths, tmp_path: Path):
    yolo = shutil.copytree(coco128 / "coco128-yolo", tmp_path / "coco128-yolo")
    shutil.copy(yolo / "coco128.yaml.from_repo", yolo / "data.yaml")  # the dataset's own YAML, as users have it
    coco = shutil.copytree(coco128 / "coco128-coco", tmp_path / "coco128-coco")
    ws = workspace.root

    y = run_cli("ingest", yolo, cwd=ws, check=True)
    assert "labels/train2017/000000000656.txt: label file with no image" in y.stdout
    assert "labels/train2017/000000000659.txt: label file with no image" in y.stdout
    assert "2 image(s) without boxes kept as background images" in y.stdout
    c = run_cli("ingest", coco, cwd=ws, check=True)
    assert "10 crowd region(s) (iscrowd=1) left out" in c.stdout
    run_cli("merge", cwd=ws, check=True)

    master = load_json(workspace.master / "annotations.json")
    from_yolo, from_coco = _per_image(master, "coco128-yolo"), _per_image(master, "coco128-coco")
    for per_image in (from_yolo, from_coco):
        assert len(per_image) == 128  # background images kept
        assert sum(1 for b in per_image.values() if b) == 126
        assert sum(len(b) for b in per_image.values()) == 929
    assert from_yolo.keys() == from_coco.keys()
    for name in from_yolo:  # the same boxes, to YOLO's 6-decimal rounding
        ya, ca = sorted(from_yolo[name]), sorted(from_coco[name])
        assert [n for n, _ in ya] == [n for n, _ in ca], name
    assert Counter(n for b in from_yolo.values() for n, _ in b) == Counter(n for b in from_coco.values() for n, _ in b)
    assert len(master["categories"]) == 80  # reconciled by name: the same 80 classes, not 160


@pytest.mark.parametrize("convert", [coco_to_voc, coco_to_yolo], ids=["voc", "yolo"])
def test_other_formats_round_trip_to_the_same_batch(convert, workspace: Paths, sample_root: Path, tmp_path: Path):
    ws = workspace.root
    run_cli("ingest", sample_root / "batch-2", cwd=ws, check=True)
    other = convert(sample_root / "batch-2", tmp_path / f"batch-2-{convert.__name__}")
    run_cli("ingest", other, cwd=ws, check=True)
    a = load_json(workspace.batches / "batch-2" / "annotations.json")
    b = load_json(workspace.batches / other.name / "annotations.json")
    assert [i["sha256"] for i in a["images"]] == [i["sha256"] for i in b["images"]]
    assert {c["name"] for c in a["categories"]} == {c["name"] for c in b["categories"]}

    def boxes(doc):
        cats = {c["id"]: c["name"] for c in doc["categories"]}
        return sorted((x["image_id"], cats[x["category_id"]], x["bbox"]) for x in doc["annotations"])

    for (ia, na, ba), (ib, nb, bb) in zip(boxes(a), boxes(b), strict=True):
        assert (ia, na) == (ib, nb)
        assert all(abs(p - q) < 0.01 for p, q in zip(ba, bb, strict=True))
    # The same images in two batches: merged once, the later batch wins, labels agree.
    run_cli("merge", cwd=ws, check=True)
    report = load_json(workspace.merge_report)
    assert report["totals"]["images"] == 12 and report["totals"]["duplicates"] == 12
    assert report["totals"]["conflicts"] == 0
    assert {i["batch"] for i in load_json(workspace.master / "annotations.json")["images"]} == {other.name}
