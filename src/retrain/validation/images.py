"""Image checks (files, not tables, so not great-expectations).

A file named by a batch must stay inside its root (no absolute path, no ``..``, no symlink out, a
regular file: no FIFO or device), be an accepted image format, decode completely (truncation caught),
have at most ``max_pixels`` pixels (PIL's decompression-bomb limit stays on: a bomb is refused before
its pixels are decoded) and be left unchanged by the check.  Files are checked on a process pool;
results are cached by sha256, size and mtime, so an image is decoded once in its life.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from retrain.fsutil import write_atomic
from retrain.safety import UnsafePath, pil_open, safe_member

#: Formats PIL may decode for us; anything else named .jpg is refused.
ALLOWED_FORMATS = frozenset({"JPEG", "PNG", "BMP", "WEBP", "TIFF", "MPO"})


# EXIF orientations 5..8 rotate by 90 degrees: the displayed size is the stored size transposed.
_TRANSPOSING = frozenset({5, 6, 7, 8})


class BadImage(ValueError):
    """A file that is not an acceptable, completely decodable image."""


@dataclass(frozen=True)
class ImageInfo:
    """What decoding an image file told us: its sha256 and its size as displayed (after EXIF orientation)."""

    sha256: str
    width: int
    height: int
    format: str


@dataclass(frozen=True)
class ImageResult:
    """The outcome of checking one file: ``info`` when it passed, else the rule and message that failed."""

    name: str
    path: Path | None
    info: ImageInfo | None
    rule: str = ""
    message: str = ""


def inspect_image(path: Path, max_pixels: int | None = None) -> ImageInfo:
    """Hash and fully decode one image file, read-only.

    Args:
        path: A regular file.
        max_pixels: Refuse images with more pixels (checked from the header, before decoding).

    Returns:
        The file's sha256 and displayed size.

    Raises:
        BadImage: Empty, not an accepted format, too many pixels, truncated, or a decompression bomb.
    """
    with open(path, "rb") as f:  # read-only: validation never changes a file
        data = f.read()
    if not data:
        raise BadImage("empty file (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with pil_open(io.BytesIO(data)) as im:
                fmt = im.format or "?"
                if fmt not in ALLOWED_FORMATS:
                    raise BadImage(f"format {fmt} is not an accepted image format")
                width, height = im.size
                if max_pixels is not None and width * height > max_pixels:
                    raise BadImage(f"{width}x{height} is more than the {max_pixels} pixels allowed")
                orientation = im.getexif().get(0x0112, 1)
                im.load()  # a full decode: truncated files fail here
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise BadImage(f"decompression bomb refused ({e})") from e
        except UnidentifiedImageError as e:
            raise BadImage("not a decodable image") from e
        except (OSError, SyntaxError, ValueError) as e:
            if isinstance(e, BadImage):
                raise
            raise BadImage(f"image does not decode completely ({e})") from e
    if orientation in _TRANSPOSING:
        width, height = height, width
    return ImageInfo(hashlib.sha256(data).hexdigest(), width, height, fmt)


def check_file(root: Path, base: Path, name: str, max_pixels: int | None) -> ImageResult:
    """Every image check on one file, as a result (never raises for a bad file)."""
    try:
        path = safe_member(root, base, name)
    except UnsafePath as e:
        return ImageResult(name, None, None, "file-exists" if str(e) == "file not found" else "path-inside-root",
                           str(e))
    try:
        before = path.stat()
        info = inspect_image(path, max_pixels)
        after = path.stat()
    except BadImage as e:
        return ImageResult(name, path, None, "image-decodes", str(e))
    except OSError as e:
        return ImageResult(name, path, None, "readable", f"cannot be read ({e})")
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        return ImageResult(name, path, None, "unchanged", "the file changed while it was being checked")
    return ImageResult(name, path, info)


def _check_chunk(args: tuple[Path, Path, list[str], int | None]) -> list[ImageResult]:
    root, base, names, max_pixels = args
    return [check_file(root, base, n, max_pixels) for n in names]


class ImageCheckCache:
    """Images that passed, by (sha256, size, mtime): a JSON file under the workspace's ``.cache``."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, object]] = {}
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                self.entries = {}  # a damaged cache only costs a re-check

    @staticmethod
    def key(path: Path, sha256: str) -> str | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return f"{sha256}:{st.st_size}:{st.st_mtime_ns}"

    def get(self, path: Path, sha256: str) -> ImageInfo | None:
        k = self.key(path, sha256)
        hit = self.entries.get(k) if k else None
        return ImageInfo(**hit) if hit else None  # type: ignore[arg-type]

    def put(self, path: Path, info: ImageInfo) -> None:
        k = self.key(path, info.sha256)
        if k:
            self.entries[k] = asdict(info)

    def save(self) -> None:
        if self.path is not None:
            write_atomic(self.path, json.dumps(self.entries, sort_keys=True))


def check_files(root: Path, base: Path, names: Iterable[str], max_pixels: int | None, workers: int = 0,
                known: dict[str, str] | None = None, cache: ImageCheckCache | None = None) -> list[ImageResult]:
    """Check many files, in parallel processes, skipping those the cache has seen pass.

    Args:
        root: Nothing may escape it.
        base: Names are relative to it.
        names: The files.
        max_pixels: Pixel bound.
        workers: Processes; 0 for one per core, 1 to stay in this process.
        known: name -> sha256 the manifest states (enables the cache).
        cache: Results of earlier runs.

    Returns:
        One result per name, in order.
    """
    names = list(names)
    results: dict[str, ImageResult] = {}
    todo = []
    for n in names:
        hit = cache.get(base / n, known[n]) if cache and known and n in known else None
        if hit is not None and (base / n).resolve().is_relative_to(root):
            results[n] = ImageResult(n, base / n, hit)
        else:
            todo.append(n)
    n_workers = workers or os.cpu_count() or 1
    if n_workers == 1 or len(todo) < 64:
        checked = _check_chunk((root, base, todo, max_pixels))
    else:
        size = max(16, len(todo) // (n_workers * 4))
        chunks = [(root, base, todo[i:i + size], max_pixels) for i in range(0, len(todo), size)]
        with ProcessPoolExecutor(max_workers=n_workers) as pool:
            checked = [r for part in pool.map(_check_chunk, chunks) for r in part]
    for r in checked:
        results[r.name] = r
        if cache is not None and r.info is not None:
            cache.put(base / r.name, r.info)
    return [results[n] for n in names]
