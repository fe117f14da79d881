import hashlib
import json
from pathlib import Path

from retrain.data.sample import generate


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def test_deterministic_for_a_seed_and_different_for_another(tmp_path: Path):
    generate(tmp_path / "a", 2, 5, seed=7)
    generate(tmp_path / "b", 2, 5, seed=7)
    generate(tmp_path / "c", 2, 5, seed=8)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")


def test_later_batch_adds_a_class_and_boxes_fit(sample_root: Path):
    names = []
    for k in (1, 2, 3):
        doc = json.loads((sample_root / f"batch-{k}" / "annotations.json").read_text())
        names.append([c["name"] for c in doc["categories"]])
        sizes = {i["id"]: (i["width"], i["height"]) for i in doc["images"]}
        assert len(doc["images"]) == 12 and doc["annotations"]
        for a in doc["annotations"]:
            x, y, w, h = a["bbox"]
            W, H = sizes[a["image_id"]]
            assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= W and y + h <= H
    assert names[0] == ["circle", "square", "triangle"]
    assert names[1] == names[2] == ["circle", "square", "triangle", "star"]
