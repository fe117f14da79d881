"""The canonical form of an ingested batch, whatever format it came in.

``data/batches/<name>/`` holds:

- ``images/...``: the image files, byte for byte as received;
- ``annotations.json``: COCO (``file_name`` relative to ``images/``; each image also carries its
  ``sha256``; boxes in pixels of the displayed image; category ids 1..K in the batch's own order);
- ``batch.json``: name, ingest sequence number, source format, content hash, counts, notes.

The merge reads ``annotations.json`` and ``batch.json``, and decodes an admitted image once in its life for its
perceptual hash (``data.groups``, cached by sha256).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from retrain.data.formats import ValidBatch
from retrain.errors import RetrainError
from retrain.fsutil import dumps_canonical

ANNOTATIONS = "annotations.json"
META = "batch.json"
IMAGES = "images"
SCHEMA = "retrain-batch/1"


@dataclass(frozen=True)
class CanonicalBatch:
    """A batch ready to be written: its COCO document and the files it names."""

    coco: dict[str, Any]
    text: str  # ``coco`` as written to annotations.json; ``content_sha256`` is its hash
    files: tuple[tuple[str, Path, str], ...]  # (name under images/, source file, sha256)
    content_sha256: str


@dataclass(frozen=True)
class BatchMeta:
    """``batch.json`` of an ingested batch."""

    name: str
    seq: int
    source_format: str
    content_sha256: str
    images: int
    boxes: int
    notes: tuple[str, ...]
    dropped: tuple[dict[str, str], ...] = ()  # boxes left out under ingest.bad_boxes: drop ({file, rule, message})

    def to_json(self) -> dict[str, Any]:
        return ({"dropped": [dict(d) for d in self.dropped]} if self.dropped else {}) | {
            "schema": SCHEMA,
            "name": self.name,
            "seq": self.seq,
            "source_format": self.source_format,
            "content_sha256": self.content_sha256,
            "counts": {"images": self.images, "boxes": self.boxes},
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BatchMeta:
        return cls(d["name"], int(d["seq"]), d["source_format"], d["content_sha256"],
                   int(d["counts"]["images"]), int(d["counts"]["boxes"]), tuple(d.get("notes", ())),
                   tuple(d.get("dropped", ())))


def _clip(bbox: list[float], width: int, height: int) -> list[float]:
    """Clip a box (already within the tolerance) to its image, rounded to 1e-4 px."""
    x0, y0 = max(0.0, bbox[0]), max(0.0, bbox[1])
    x1, y1 = min(float(width), bbox[0] + bbox[2]), min(float(height), bbox[1] + bbox[3])
    return [round(x0, 4), round(y0, 4), round(x1 - x0, 4), round(y1 - y0, 4)]


def build(valid: ValidBatch) -> CanonicalBatch:
    """Build the canonical COCO document of a validated batch (sorted by file name, ids from 1, boxes clipped).

    Args:
        valid: The batch as ``validate_batch`` accepted it.

    Returns:
        The document, the files to copy and a content hash that ignores the batch's name.
    """
    src = valid.coco
    boxes: dict[int, list[dict[str, Any]]] = {}
    for a in src["annotations"]:
        boxes.setdefault(a["image_id"], []).append(a)
    coco_images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    files: list[tuple[str, Path, str]] = []
    for image_id, im in enumerate(sorted(src["images"], key=lambda i: i["file_name"]), start=1):
        coco_images.append({"id": image_id, "file_name": im["file_name"], "width": im["width"],
                            "height": im["height"], "sha256": im["sha256"],
                            **({"sequence": im["sequence"]} if "sequence" in im else {})})  # absent: as before
        files.append((im["file_name"], valid.sources[im["id"]], im["sha256"]))
        for a in boxes.get(im["id"], []):
            x, y, w, h = _clip(a["bbox"], im["width"], im["height"])
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": a["category_id"],
                         "bbox": [x, y, w, h], "area": round(w * h, 4), "iscrowd": 0})
    coco = {"categories": src["categories"], "images": coco_images, "annotations": anns}
    text = dumps_canonical(coco)
    return CanonicalBatch(coco, text, tuple(files), hashlib.sha256(text.encode()).hexdigest())


def read_meta(batch_dir: Path) -> BatchMeta:
    """Read ``batch.json`` of an ingested batch."""
    return BatchMeta.from_json(json.loads((batch_dir / META).read_text(encoding="utf-8")))


def read_annotations(batch_dir: Path) -> dict[str, Any]:
    """Read ``annotations.json`` of an ingested batch."""
    doc: dict[str, Any] = orjson.loads((batch_dir / ANNOTATIONS).read_bytes())
    return doc


def ingested_batches(batches_dir: Path) -> list[tuple[Path, BatchMeta]]:
    """The admitted batches (a ``<name>.dvc`` file and a ``batch.json``), in ingest order.

    Args:
        batches_dir: ``data/batches``.

    Returns:
        ``(directory, meta)`` pairs sorted by sequence number.
    """
    if not batches_dir.is_dir():
        return []
    out = []
    for d in batches_dir.iterdir():
        if d.is_dir() and not d.name.startswith(".") and (batches_dir / f"{d.name}.dvc").is_file() \
                and (d / META).is_file():
            try:
                out.append((d, read_meta(d)))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise RetrainError(f"batch {d.name}: {META} cannot be read ({e}); run 'dvc checkout' to "
                                   "restore it") from e
    return sorted(out, key=lambda t: (t[1].seq, t[1].name))
