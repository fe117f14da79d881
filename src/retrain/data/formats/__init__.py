"""Readers for the batch formats retrain accepts: COCO JSON, YOLO txt and Pascal VOC xml."""

from __future__ import annotations

from pathlib import Path

from retrain.data.formats.coco import find_annotation_file, read_coco
from retrain.data.formats.model import IMAGE_SUFFIXES, SourceBatch, SourceBox, SourceImage, ValidBatch
from retrain.data.formats.voc import read_voc
from retrain.data.formats.yolo import read_yolo

FORMATS = ("coco", "yolo", "voc")

__all__ = ["FORMATS", "IMAGE_SUFFIXES", "SourceBatch", "SourceBox", "SourceImage", "ValidBatch", "detect_format",
           "read_batch"]


def detect_format(root: Path) -> str | None:
    """Guess a batch's format from its layout.

    Args:
        root: The batch root.

    Returns:
        ``coco``, ``yolo``, ``voc``, or ``None`` when nothing fits.
    """
    if find_annotation_file(root):
        return "coco"
    if (root / "labels").is_dir() and (root / "images").is_dir():
        return "yolo"
    if any(root.rglob("*.xml")):
        return "voc"
    return None


def read_batch(root: Path, fmt: str = "auto") -> SourceBatch:
    """Read a batch in any supported format.

    Args:
        root: The batch root (resolved).
        fmt: ``auto``, ``coco``, ``yolo`` or ``voc``.

    Returns:
        The batch as the source states it; problems recorded, nothing checked against image files yet.
    """
    chosen = detect_format(root) if fmt == "auto" else fmt
    if chosen == "coco":
        return read_coco(root)
    if chosen == "yolo":
        return read_yolo(root)
    if chosen == "voc":
        return read_voc(root)
    batch = SourceBatch(root=root, format=fmt)
    batch.problem(root, "known-format", "no COCO JSON, YOLO images/+labels/ or VOC .xml found; use --format")
    return batch
