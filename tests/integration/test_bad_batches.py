"""Bad batches are refused by the real CLI: exit 1, one line naming batch, file and rule; nothing changes."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from retrain.paths import Paths
from retrain.workspace import init_workspace
from tests.helpers import bomb_png, coco_to_yolo, copy_batch, run_cli, snapshot


@pytest.fixture(scope="module")
def ws_with_batch(tmp_path_factory: pytest.TempPathFactory, sample_root: Path) -> Paths:
    """A workspace that already holds batch-1, so 'nothing changed' is checked against real state."""
    tmp = tmp_path_factory.mktemp("badws")
    paths = init_workspace(tmp / "ws", remote=str(tmp / "remote"))
    run_cli("ingest", sample_root / "batch-1", cwd=paths.root, check=True)
    return paths


def _edit(batch: Path, fn: Callable[[dict], None]) -> None:
    p = batch / "annotations.json"
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def _first_image(batch: Path) -> Path:
    doc = json.loads((batch / "annotations.json").read_text())
    return batch / "images" / doc["images"][0]["file_name"]


def box_outside(b: Path) -> tuple[str, str]:
    def f(doc):
        im = doc["images"][0]
        a = next(a for a in doc["annotations"] if a["image_id"] == im["id"])
        a["bbox"] = [im["width"] - 5, 2, 50, 20]
    _edit(b, f)
    return "annotations.json", "box-inside-image"


def zero_area_box(b: Path) -> tuple[str, str]:
    _edit(b, lambda d: d["annotations"][0].update(bbox=[5, 5, 0, 10]))
    return "annotations.json annotation 1", "box-area"


def unknown_class(b: Path) -> tuple[str, str]:
    _edit(b, lambda d: d["annotations"][0].update(category_id=99))
    return "annotations.json", "known-class"


def missing_image(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    img.unlink()
    return f"images/{img.name}", "file-exists"


def truncated_jpeg(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    data = img.read_bytes()
    img.write_bytes(data[: len(data) // 2])
    return f"images/{img.name}", "image-decodes"


def dotdot_path(b: Path) -> tuple[str, str]:
    _edit(b, lambda d: d["images"][0].update(file_name="../../etc/passwd"))
    return "../../etc/passwd", "path-inside-batch"


def absolute_path(b: Path) -> tuple[str, str]:
    _edit(b, lambda d: d["images"][0].update(file_name="/etc/passwd"))
    return "/etc/passwd", "path-inside-batch"


def symlink_out(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    outside = b.parent / f"outside-{b.name}.jpg"
    shutil.copy(img, outside)
    img.unlink()
    img.symlink_to(outside)
    return f"images/{img.name}", "path-inside-batch"


def python_tag_yaml(b: Path) -> tuple[str, str]:
    yolo = coco_to_yolo(b, b.parent / f"{b.name}-yolo")
    shutil.rmtree(b)
    yolo.rename(b)
    (b / "data.yaml").write_text("names: !!python/object/apply:os.system ['touch /tmp/retrain-canary']\n")
    return "data.yaml", "safe-yaml"


def random_bytes(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    img.write_bytes(os.urandom(4096))
    return f"images/{img.name}", "image-decodes"


def zero_bytes(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    img.write_bytes(b"")
    return f"images/{img.name}", "image-decodes"


def nan_coordinate(b: Path) -> tuple[str, str]:
    p = b / "annotations.json"
    doc = json.loads(p.read_text())
    doc["annotations"][0]["bbox"][0] = float("nan")
    p.write_text(json.dumps(doc))  # json writes NaN, as some tools do
    return "annotations.json", "box-finite"


def duplicate_annotation_id(b: Path) -> tuple[str, str]:
    _edit(b, lambda d: d["annotations"][1].update(id=d["annotations"][0]["id"]))
    return "annotations.json", "unique-id"


def unlisted_file(b: Path) -> tuple[str, str]:
    shutil.copy(_first_image(b), b / "images" / "extra.jpg")
    return "images/extra.jpg", "listed-file"


def size_mismatch(b: Path) -> tuple[str, str]:
    _edit(b, lambda d: d["images"][0].update(width=d["images"][0]["width"] + 10))
    return f"images/{_first_image(b).name}", "image-size"


def exif_rotated(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    im = Image.open(img)
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated by 90 degrees; the labels are in the stored frame
    im.save(img, format="JPEG", exif=exif)
    return f"images/{img.name}", "image-size"


def decompression_bomb(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    bomb_png(img)
    return f"images/{img.name}", "image-decodes"


def empty_batch(b: Path) -> tuple[str, str]:
    _edit(b, lambda d: d.update(images=[], annotations=[]))
    shutil.rmtree(b / "images")
    return ".", "batch-not-empty"


def fifo(b: Path) -> tuple[str, str]:
    img = _first_image(b)
    img.unlink()
    os.mkfifo(img)
    return f"images/{img.name}", "path-inside-batch"


CASES = [box_outside, zero_area_box, unknown_class, missing_image, truncated_jpeg, dotdot_path, absolute_path,
         symlink_out, python_tag_yaml, random_bytes, zero_bytes, nan_coordinate, duplicate_annotation_id, unlisted_file,
         size_mismatch, exif_rotated, decompression_bomb, fifo, empty_batch]


@pytest.mark.parametrize("defect", CASES, ids=[c.__name__ for c in CASES])
def test_bad_batch_is_refused_and_nothing_changes(defect, ws_with_batch: Paths, sample_root: Path, tmp_path: Path):
    batch = copy_batch(sample_root / "batch-2", tmp_path / "incoming" / defect.__name__)
    file, rule = defect(batch)
    before = snapshot(ws_with_batch.root)
    proc = run_cli("ingest", batch, cwd=ws_with_batch.root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    expected = f"batch {defect.__name__}: {file}"
    lines = [ln for ln in proc.stderr.splitlines() if f"[{rule}]" in ln]
    assert any(expected in ln for ln in lines), f"no line with {expected!r} and [{rule}] in:\n{proc.stderr}"
    assert proc.stderr.rstrip().endswith("nothing was changed")
    assert snapshot(ws_with_batch.root) == before
    assert not Path("/tmp/retrain-canary").exists()


def test_bad_boxes_drop_admits_the_batch_without_its_broken_boxes_and_records_each(
        workspace: Paths, sample_root: Path, tmp_path: Path):
    """`--bad-boxes drop`: a zero-area box and a NaN coordinate are left out, listed (file, rule) on the command's
    output and in the batch's record; the batch is admitted. Another rule still refuses under drop, and the default
    (refuse) refuses the same batch (the cases above)."""
    batch = copy_batch(sample_root / "batch-2", tmp_path / "incoming" / "broken-boxes")
    n = len(json.loads((batch / "annotations.json").read_text())["annotations"])
    zero_area_box(batch)
    _edit(batch, lambda d: d["annotations"][1].update(bbox=[5, float("nan"), 10, 10]))  # json writes NaN
    refused = run_cli("ingest", batch, cwd=workspace.root)
    assert refused.returncode == 1 and "[box-area]" in refused.stderr, refused.stderr

    other = copy_batch(batch, tmp_path / "incoming" / "broken-and-outside")
    box_outside(other)
    before = snapshot(workspace.root)
    still = run_cli("ingest", other, "--bad-boxes", "drop", cwd=workspace.root)
    assert still.returncode == 1 and "[box-inside-image]" in still.stderr, still.stderr
    assert snapshot(workspace.root) == before

    proc = run_cli("ingest", batch, "--bad-boxes", "drop", cwd=workspace.root)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    dropped = [ln for ln in proc.stdout.splitlines() if ln.startswith("dropped: ")]
    assert len(dropped) == 2, proc.stdout
    assert "batch broken-boxes: annotations.json annotation 1: [box-area]" in dropped[0], dropped
    assert "annotations.json annotation 2: [box-finite]" in dropped[1], dropped
    meta = json.loads((workspace.batch("broken-boxes") / "batch.json").read_text())
    assert [(d["file"], d["rule"]) for d in meta["dropped"]] == [
        ("annotations.json annotation 1", "box-area"), ("annotations.json annotation 2", "box-finite")]
    assert meta["counts"]["boxes"] == n - 2
    admitted = json.loads((workspace.batch("broken-boxes") / "annotations.json").read_text())
    assert len(admitted["annotations"]) == n - 2


def test_the_bad_boxes_policy_comes_from_params(workspace: Paths, sample_root: Path, tmp_path: Path):
    from retrain.workspace import set_params

    batch = copy_batch(sample_root / "batch-2", tmp_path / "incoming" / "zero-area")
    zero_area_box(batch)
    set_params(workspace, {"ingest.bad_boxes": "drop"})
    proc = run_cli("ingest", batch, cwd=workspace.root)
    assert proc.returncode == 0 and "[box-area]" in proc.stdout, proc.stdout + proc.stderr
    assert run_cli("ingest", batch, "--name", "again", "--bad-boxes", "refuse", cwd=workspace.root).returncode == 1
