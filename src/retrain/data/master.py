"""The master dataset as the stages read it: ``data/master/annotations.json`` (written by ``retrain merge``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from retrain.errors import RetrainError, ValidationFailed


@dataclass(frozen=True)
class Master:
    """The master dataset as training reads it.

    Attributes:
        doc: The master COCO document.
        names: Class names, in class-index order (sorted by category id).
        category_ids: COCO category id of each class index.
        version: sha256 of ``annotations.json``: it names every image by content, so it fixes the data.
        data_root: The folder image file names are relative to.
    """

    doc: dict[str, Any]
    names: tuple[str, ...]
    category_ids: tuple[int, ...]
    version: str
    data_root: Path

    def images(self, split: str) -> list[dict[str, Any]]:
        """The images of one split."""
        return [im for im in self.doc["images"] if im.get("split") == split]


def load_master(master_dir: Path, data_root: Path) -> Master:
    """Read the master written by ``retrain merge``.

    Raises:
        RetrainError: There is no master, or it has no train or no val images.
    """
    ann = master_dir / "annotations.json"
    if not ann.is_file():
        raise RetrainError(f"{ann}: no master dataset; run 'retrain merge' (or 'dvc repro') first")
    raw = ann.read_bytes()
    doc = orjson.loads(raw)
    cats = sorted(doc["categories"], key=lambda c: c["id"])
    master = Master(doc, tuple(c["name"] for c in cats), tuple(c["id"] for c in cats),
                    hashlib.sha256(raw).hexdigest(), data_root.resolve())
    for split in ("train", "val"):
        if not master.images(split):
            raise RetrainError(f"{ann}: the master has no {split} images; ingest more data before training")
    return master


def verify_images(master: Master, max_shown: int = 5) -> int:
    """Re-hash every image of the master and compare it with the sha256 recorded when its batch was ingested.

    What training reads is then exactly what was ingested, validated and versioned: a flipped byte in a file (or
    in the DVC cache object a link type shares with it) stops the run instead of training on it.

    Returns:
        The number of images checked.

    Raises:
        RetrainError: One line per damaged or missing image (the first ``max_shown``), then what to do.
    """
    bad: list[str] = []
    for im in master.doc["images"]:
        path = master.data_root / im["file_name"]
        try:
            with path.open("rb") as f:
                got = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            bad.append(f"{im['file_name']}: [image-sha256] cannot be read ({e.strerror or e})")
            continue
        if got != im["sha256"]:
            bad.append(f"{im['file_name']}: [image-sha256] sha256 {got[:12]}..., ingested {im['sha256'][:12]}...: "
                       "the file (or the DVC cache object linked to it) is damaged")
    if bad:
        lines = bad[:max_shown]
        if len(bad) > max_shown:
            lines.append(f"... and {len(bad) - max_shown} more damaged image(s)")
        raise ValidationFailed([*lines, f"{len(bad)} of {len(master.doc['images'])} images differ from what was "
                                "ingested; nothing was trained. Restore them from the DVC remote (delete the "
                                "damaged files and their cache objects, then 'dvc pull --force')"])
    return len(master.doc["images"])
