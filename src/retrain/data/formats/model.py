"""What a format reader returns: boxes and images as the source states them, not yet checked."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from retrain.errors import Problem

#: File suffixes treated as images when a reader lists a directory.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})

BoxFormat = Literal["xywh", "xyxy", "cxcywh-norm"]


@dataclass(frozen=True)
class SourceBox:
    """One box as written in the source.

    Attributes:
        category: Index into ``SourceBatch.categories``.
        coords: Four numbers in ``fmt``.
        fmt: ``xywh`` (COCO, pixels), ``xyxy`` (VOC, pixels) or ``cxcywh-norm`` (YOLO, 0..1).
        label_file: The file that states the box, relative to the batch root, for messages.
    """

    category: int
    coords: tuple[float, float, float, float]
    fmt: BoxFormat
    label_file: str

    def pixels(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The box as ``(x, y, w, h)`` in pixels of a ``width`` x ``height`` image."""
        a, b, c, d = self.coords
        if self.fmt == "xywh":
            return a, b, c, d
        if self.fmt == "xyxy":
            return a, b, c - a, d - b
        return (a - c / 2) * width, (b - d / 2) * height, c * width, d * height


@dataclass(frozen=True)
class SourceImage:
    """One image entry as the source names it.

    Attributes:
        name: The image's path as written in the source (relative, unchecked).
        image_root: The directory ``name`` is relative to.
        claimed_size: ``(width, height)`` the labels claim, if they say.
        boxes: The image's boxes.
        label_file: The label file naming this image, relative to the batch root.
        sequence: The video or sequence the image is a frame of, where the labels say (COCO ``video_id`` or
            ``sequence_id``): its frames share one split.
    """

    name: str
    image_root: Path
    claimed_size: tuple[int, int] | None
    boxes: tuple[SourceBox, ...]
    label_file: str
    sequence: str | None = None


@dataclass
class SourceBatch:
    """A batch as read from disk, before any image is opened.

    Attributes:
        root: The batch's root directory (resolved).
        format: ``coco``, ``yolo`` or ``voc``.
        categories: Class names; a box's ``category`` indexes this list.
        images: The image entries.
        problems: Structural defects found while reading (the batch is refused if any).
        notes: Things worth telling the user that do not refuse the batch.
    """

    root: Path
    format: str
    categories: list[str] = field(default_factory=list)
    images: list[SourceImage] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def rel(self, path: Path) -> str:
        """``path`` relative to the batch root, for messages (the path itself if outside)."""
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def problem(self, path: Path | str, rule: str, message: str) -> None:
        """Record a defect against ``path``."""
        self.problems.append(Problem(self.rel(path) if isinstance(path, Path) else path, rule, message))


def list_image_files(directory: Path) -> list[Path]:
    """Image files under ``directory``, recursively, sorted; hidden entries skipped; links not followed into."""
    out = []
    for p in sorted(directory.rglob("*")):
        if any(part.startswith(".") for part in p.relative_to(directory).parts):
            continue
        if p.suffix.lower() in IMAGE_SUFFIXES and not p.is_dir():
            out.append(p)
    return out


@dataclass(frozen=True)
class ValidBatch:
    """A batch that passed the batch checks: its COCO document, per image id the file to copy, and the boxes left
    out under ``ingest.bad_boxes: drop`` (each as the problem that would have refused the batch)."""

    coco: dict[str, Any]
    sources: dict[int, Path]
    dropped: tuple[Problem, ...] = ()
