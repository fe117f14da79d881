"""COCO JSON batches: ``annotations.json`` (or ``annotations/*.json``) plus an image folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retrain.data.formats.model import SourceBatch, SourceBox, SourceImage, list_image_files


def find_annotation_file(root: Path) -> list[Path]:
    """Candidate COCO annotation files of a batch, most specific first."""
    if (root / "annotations.json").is_file():
        return [root / "annotations.json"]
    top = sorted(p for p in root.glob("*.json") if p.is_file())
    if top:
        return top
    return sorted(p for p in (root / "annotations").glob("*.json") if p.is_file())


#: Image fields naming the video or sequence an image is a frame of (COCO-VID/TAO write ``video_id``).
SEQUENCE_FIELDS = ("video_id", "sequence_id")


def _sequence(entry: dict[str, Any]) -> str | None:
    """The image's video or sequence id as a string, where the labels carry one."""
    for key in SEQUENCE_FIELDS:
        value = entry.get(key)
        if isinstance(value, (int, str)) and not isinstance(value, bool) and str(value).strip():
            return str(value).strip()[:200]
    return None


def _image_root(root: Path, names: list[str]) -> Path:
    """The folder the ``file_name`` entries are relative to: the candidate holding most of them."""
    candidates = [root / "images", root] + sorted(
        p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "images"
    )
    sample = names[:200]
    best, best_hits = candidates[0] if candidates[0].is_dir() else root, -1
    for c in candidates:
        if not c.is_dir():
            continue
        hits = sum(1 for n in sample if (c / n).exists())
        if hits > best_hits:
            best, best_hits = c, hits
    return best


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def read_coco(root: Path) -> SourceBatch:  # noqa: C901 - one pass over a documented structure
    """Read a COCO-format batch.

    Args:
        root: The batch root (resolved).

    Returns:
        The batch; structural defects are in ``problems``. Crowd regions are left out and counted in ``notes``.
    """
    batch = SourceBatch(root=root, format="coco")
    files = find_annotation_file(root)
    if not files:
        batch.problem(root, "annotations-present", "no COCO annotation file (annotations.json or annotations/*.json)")
        return batch
    if len(files) > 1:
        batch.problem(root, "annotations-present", f"several annotation files, expected one: {[p.name for p in files]}")
        return batch
    ann_file = files[0]
    label_file = batch.rel(ann_file)
    try:
        doc = json.loads(ann_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        batch.problem(ann_file, "json-valid", f"cannot be parsed as JSON ({e})")
        return batch
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), list) for k in ("images", "categories")):
        batch.problem(ann_file, "coco-structure", "expected an object with 'images' and 'categories' lists")
        return batch
    anns = doc.get("annotations", [])
    if not isinstance(anns, list):
        batch.problem(ann_file, "coco-structure", "'annotations' must be a list")
        return batch

    cat_index: dict[int, int] = {}
    for c in doc["categories"]:
        if not isinstance(c, dict) or not _is_int(c.get("id")) or not isinstance(c.get("name"), str) or not c["name"]:
            batch.problem(ann_file, "coco-structure", f"category needs an integer id and a name: {c!r:.80}")
            continue
        if c["id"] in cat_index or c["name"] in batch.categories:
            batch.problem(ann_file, "unique-class", f"category id {c['id']} / name {c['name']!r} defined twice")
            continue
        cat_index[c["id"]] = len(batch.categories)
        batch.categories.append(c["name"])

    images: dict[int, dict[str, Any]] = {}
    seen_names: set[str] = set()
    for im in doc["images"]:
        if not isinstance(im, dict) or not _is_int(im.get("id")) or not isinstance(im.get("file_name"), str):
            batch.problem(ann_file, "coco-structure", f"image needs an integer id and a file_name: {im!r:.80}")
            continue
        if im["id"] in images:
            batch.problem(ann_file, "unique-id", f"image id {im['id']} appears twice")
            continue
        if im["file_name"] in seen_names:
            batch.problem(im["file_name"], "unique-file", f"listed twice in {label_file}")
            continue
        seen_names.add(im["file_name"])
        images[im["id"]] = {"entry": im, "boxes": []}

    ann_ids: set[int] = set()
    crowd = 0
    for a in anns:
        if not isinstance(a, dict) or not _is_int(a.get("id")) or not _is_int(a.get("image_id")):
            batch.problem(ann_file, "coco-structure", f"annotation needs integer id and image_id: {a!r:.80}")
            continue
        where = f"{label_file} annotation {a['id']}"
        if a["id"] in ann_ids:
            batch.problem(ann_file, "unique-id", f"annotation id {a['id']} appears twice")
            continue
        ann_ids.add(a["id"])
        if a["image_id"] not in images:
            batch.problem(ann_file, "known-image", f"annotation {a['id']}: image id {a['image_id']} is not listed")
            continue
        if a.get("iscrowd", 0):
            crowd += 1
            continue
        bbox = a.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(_is_number(v) for v in bbox)):
            batch.problem(ann_file, "box-valid", f"annotation {a['id']}: bbox must be 4 numbers, got {bbox!r:.60}")
            continue
        cid = a.get("category_id")
        if not _is_int(cid) or cid not in cat_index:
            batch.problem(ann_file, "known-class", f"annotation {a['id']}: category_id {cid!r} is not defined")
            continue
        coords = (float(bbox[0]), float(bbox[1]), float(bbox[2]), float(bbox[3]))
        images[a["image_id"]]["boxes"].append(SourceBox(cat_index[cid], coords, "xywh", where))
    if crowd:
        batch.notes.append(f"{crowd} crowd region(s) (iscrowd=1) left out: they mark ignore areas, not objects")

    image_root = _image_root(root, [v["entry"]["file_name"] for v in images.values()])
    for v in images.values():
        entry = v["entry"]
        w, h = entry.get("width"), entry.get("height")
        claimed = (w, h) if _is_int(w) and _is_int(h) else None
        if claimed is None and (w is not None or h is not None):
            batch.problem(ann_file, "coco-structure", f"image {entry['id']}: width/height must be integers")
            continue
        batch.images.append(SourceImage(entry["file_name"], image_root, claimed, tuple(v["boxes"]), label_file,
                                        _sequence(entry)))

    listed = {(image_root / n).resolve() for n in seen_names if ".." not in Path(n).parts}
    for f in list_image_files(image_root):
        if f.resolve() not in listed and f.absolute() not in listed:
            batch.problem(f, "listed-file", f"image file is not listed in {label_file}")
    return batch
