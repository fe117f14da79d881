"""The batch half of validation: paths stay inside the batch, images decode, boxes fit their image.

Every check records a ``Problem`` (file + rule + message) instead of raising, so one pass reports
everything that is wrong with a batch.  Images are decoded on a thread pool (PIL releases the GIL).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import stat
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from PIL import Image, UnidentifiedImageError

from retrain.data.formats import SourceBatch, SourceBox, SourceImage
from retrain.errors import Problem

#: Formats PIL may decode for us; anything else named .jpg is refused.
ALLOWED_FORMATS = frozenset({"JPEG", "PNG", "BMP", "WEBP", "TIFF", "MPO"})

# EXIF orientations 5..8 rotate by 90 degrees: the displayed size is the stored size transposed.
_TRANSPOSING = frozenset({5, 6, 7, 8})


@dataclass(frozen=True)
class ImageInfo:
    """What decoding an image file told us."""

    sha256: str
    width: int
    height: int
    format: str


@dataclass(frozen=True)
class CheckedImage:
    """An image that passed every check.

    Attributes:
        name: Canonical path relative to the batch's ``images/`` folder (POSIX).
        source: The file to copy (resolved, inside the batch).
        info: Hash and display size.
        boxes: ``(category index, x, y, w, h)`` in pixels of the displayed image, clipped to it.
    """

    name: str
    source: Path
    info: ImageInfo
    boxes: tuple[tuple[int, float, float, float, float], ...]


class UnsafePath(ValueError):
    """A file name from a batch that is empty, absolute, escapes the batch, is missing or is no regular file."""


def safe_member(root: Path, image_root: Path, name: str) -> Path:
    """Resolve a file name from a batch and make sure it stays inside the batch.

    Args:
        root: The batch root (resolved).
        image_root: The folder ``name`` is relative to.
        name: The name as written in the batch.

    Returns:
        The resolved path of a regular file inside the batch.

    Raises:
        UnsafePath: Why the name is refused.
    """
    if not name or "\x00" in name:
        raise UnsafePath("empty file name")
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        raise UnsafePath("absolute path: files must be named relative to the batch")
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise UnsafePath("'..' in path: files must stay inside the batch")
    try:
        resolved = (image_root / name).resolve(strict=True)
    except FileNotFoundError as e:
        raise UnsafePath("file not found") from e
    except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop
        raise UnsafePath(f"cannot be resolved ({e})") from e
    if not resolved.is_relative_to(root):
        raise UnsafePath(f"resolves outside the batch (to {resolved}); symlinks must stay inside the batch")
    if not stat.S_ISREG(resolved.stat().st_mode):
        raise UnsafePath("not a regular file (directory, FIFO or device)")
    return resolved


def inspect_image(path: Path) -> ImageInfo:
    """Hash and fully decode one image file.

    PIL's decompression-bomb limit stays on: an image claiming more pixels than
    ``Image.MAX_IMAGE_PIXELS`` is refused before its pixels are decoded.

    Args:
        path: A regular file.

    Returns:
        The file's sha256 and its size as displayed (after EXIF orientation).

    Raises:
        ValueError: The file is empty, not an allowed image format, truncated, or a decompression bomb.
    """
    data = path.read_bytes()
    if not data:
        raise ValueError("empty file (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as im:
                fmt = im.format or "?"
                if fmt not in ALLOWED_FORMATS:
                    raise ValueError(f"format {fmt} is not an accepted image format")
                width, height = im.size
                orientation = im.getexif().get(0x0112, 1)
                im.load()  # a full decode: truncated files fail here
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ValueError(f"decompression bomb refused ({e})") from e
        except UnidentifiedImageError as e:
            raise ValueError("not a decodable image") from e
        except (OSError, SyntaxError) as e:
            raise ValueError(f"image does not decode completely ({e})") from e
    if orientation in _TRANSPOSING:
        width, height = height, width
    return ImageInfo(hashlib.sha256(data).hexdigest(), width, height, fmt)


def to_pixels(box: SourceBox, width: int, height: int) -> tuple[float, float, float, float]:
    """Convert a source box to ``(x, y, w, h)`` pixels."""
    a, b, c, d = box.coords
    if box.fmt == "xywh":
        return a, b, c, d
    if box.fmt == "xyxy":
        return a, b, c - a, d - b
    return (a - c / 2) * width, (b - d / 2) * height, c * width, d * height


def check_box(
    box: SourceBox, width: int, height: int, tolerance: float
) -> tuple[tuple[float, float, float, float] | None, Problem | None]:
    """Check one box against its image; clip it when it sticks out by no more than ``tolerance`` pixels.

    Returns:
        ``(clipped xywh, None)`` or ``(None, problem)``.
    """
    x, y, w, h = to_pixels(box, width, height)
    if not all(math.isfinite(v) for v in (x, y, w, h)):
        return None, Problem(box.label_file, "box-finite", f"non-finite coordinate {(x, y, w, h)}")
    if w <= 0 or h <= 0:
        return None, Problem(box.label_file, "box-area", f"box has zero or negative size (w={w:g}, h={h:g})")
    if x < -tolerance or y < -tolerance or x + w > width + tolerance or y + h > height + tolerance:
        return None, Problem(
            box.label_file,
            "box-inside-image",
            f"box x={x:g} y={y:g} w={w:g} h={h:g} is outside the {width}x{height} image (tolerance {tolerance:g}px)",
        )
    x0, y0 = max(0.0, x), max(0.0, y)
    x1, y1 = min(float(width), x + w), min(float(height), y + h)
    if x1 - x0 <= 0 or y1 - y0 <= 0:
        return None, Problem(box.label_file, "box-area", "box has no area inside the image")
    return (round(x0, 4), round(y0, 4), round(x1 - x0, 4), round(y1 - y0, 4)), None


def _check_one(batch: SourceBatch, entry: SourceImage, tolerance: float) -> tuple[CheckedImage | None, list[Problem]]:
    try:
        path = safe_member(batch.root, entry.image_root, entry.name)
    except UnsafePath as e:
        reason = str(e)
        rule = "file-exists" if reason == "file not found" else "path-inside-batch"
        # Name the file by its place in the batch, unless the name itself is what escapes it.
        escapes = reason.startswith(("absolute", "'..'", "empty"))
        shown = entry.name if escapes else batch.rel(entry.image_root / entry.name)
        return None, [Problem(shown, rule, f"{reason} (listed in {entry.label_file})")]
    rel = batch.rel(path)
    try:
        info = inspect_image(path)
    except ValueError as e:
        return None, [Problem(rel, "image-decodes", str(e))]
    except OSError as e:
        return None, [Problem(rel, "readable", f"cannot be read ({e})")]
    if entry.claimed_size is not None and entry.claimed_size != (info.width, info.height):
        cw, ch = entry.claimed_size
        return None, [Problem(rel, "image-size", f"{entry.label_file} says {cw}x{ch}, the decoded image "
                              f"(after EXIF orientation) is {info.width}x{info.height}")]
    boxes, problems = [], []
    for box in entry.boxes:
        xywh, problem = check_box(box, info.width, info.height, tolerance)
        if problem:
            problems.append(problem)
        elif xywh:
            boxes.append((box.category, *xywh))
    if problems:
        return None, problems
    # The canonical name is the listed path under the image folder ('./' dropped); a symlink keeps its own name.
    return CheckedImage(Path(entry.name).as_posix(), path, info, tuple(boxes)), []


def check_batch(batch: SourceBatch, tolerance: float, workers: int = 0) -> tuple[list[CheckedImage], list[Problem]]:
    """Check every image of a batch: path, decode, claimed size, boxes.

    Args:
        batch: The batch as read.
        tolerance: Pixels a box may stick out before it is refused.
        workers: Decoding threads; 0 for one per core.

    Returns:
        The images that passed (in the batch's order) and every problem found (reader problems included).
    """
    problems = list(batch.problems)
    n = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(lambda e: _check_one(batch, e, tolerance), batch.images))
    checked = []
    seen: dict[str, str] = {}
    for img, probs in results:
        problems.extend(probs)
        if img is None:
            continue
        if img.name in seen:
            problems.append(Problem(img.name, "unique-file", "the same file is listed twice"))
            continue
        seen[img.name] = img.info.sha256
        checked.append(img)
    return checked, problems
