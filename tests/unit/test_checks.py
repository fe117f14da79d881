import io
import os
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from retrain.data.checks import UnsafePath, check_box, inspect_image, safe_member
from retrain.data.formats import SourceBox


def _jpeg(path: Path, size=(64, 48), exif_orientation: int | None = None) -> Path:
    im = Image.new("RGB", size, (200, 30, 30))
    kw = {}
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kw["exif"] = exif
    im.save(path, format="JPEG", **kw)
    return path


def bomb_png(path: Path, width: int = 30000, height: int = 30000) -> Path:
    """A tiny PNG whose header claims width x height (its data is a few bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def test_inspect_reads_size_and_hash(tmp_path: Path):
    info = inspect_image(_jpeg(tmp_path / "a.jpg"))
    assert (info.width, info.height, info.format) == (64, 48, "JPEG")
    assert len(info.sha256) == 64


def test_exif_rotation_swaps_the_displayed_size(tmp_path: Path):
    info = inspect_image(_jpeg(tmp_path / "r.jpg", exif_orientation=6))
    assert (info.width, info.height) == (48, 64)


@pytest.mark.parametrize("make,match", [
    (lambda p: p.write_bytes(b""), "0 bytes"),
    (lambda p: p.write_bytes(os.urandom(2048)), "not a decodable image"),
    (lambda p: p.write_bytes(_jpeg(p, (256, 256)).read_bytes()[:600]), "does not decode completely"),
    (lambda p: bomb_png(p), "decompression bomb"),
])
def test_bad_images_are_refused(tmp_path: Path, make, match):
    p = tmp_path / "x.jpg"
    make(p)
    with pytest.raises(ValueError, match=match):
        inspect_image(p)


def test_gif_is_not_an_accepted_format(tmp_path: Path):
    p = tmp_path / "x.jpg"
    buf = io.BytesIO()
    Image.new("P", (8, 8)).save(buf, format="GIF")
    p.write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="GIF is not an accepted"):
        inspect_image(p)


def test_safe_member_refuses_escapes(tmp_path: Path):
    root = tmp_path / "batch"
    (root / "images").mkdir(parents=True)
    outside = _jpeg(tmp_path / "outside.jpg")
    (root / "images" / "link.jpg").symlink_to(outside)
    os.mkfifo(root / "images" / "fifo.jpg")
    _jpeg(root / "images" / "ok.jpg")
    (root / "images" / "inner.jpg").symlink_to(root / "images" / "ok.jpg")
    r = root.resolve()
    assert safe_member(r, r / "images", "ok.jpg") == r / "images" / "ok.jpg"
    assert safe_member(r, r / "images", "inner.jpg") == r / "images" / "ok.jpg"
    for name, reason in [("../../etc/passwd", "'..'"), ("/etc/passwd", "absolute"), ("link.jpg", "outside the batch"),
                         ("fifo.jpg", "not a regular file"), ("missing.jpg", "not found"), ("", "empty")]:
        with pytest.raises(UnsafePath, match=reason):
            safe_member(r, r / "images", name)


def _box(*coords, fmt="xywh"):
    return SourceBox(0, coords, fmt, "labels.txt:1")


def test_box_rules():
    assert check_box(_box(10, 10, 20, 20), 100, 100, 1.0) == ((10, 10, 20, 20), None)
    clipped, problem = check_box(_box(-0.5, 0, 100.9, 50), 100, 100, 1.0)
    assert problem is None and clipped == (0, 0, 100, 50)
    assert check_box(_box(90, 90, 20, 20), 100, 100, 1.0)[1].rule == "box-inside-image"
    assert check_box(_box(10, 10, 0, 20), 100, 100, 1.0)[1].rule == "box-area"
    assert check_box(_box(float("nan"), 10, 5, 5), 100, 100, 1.0)[1].rule == "box-finite"
    assert check_box(_box(0.5, 0.5, 0.2, 0.4, fmt="cxcywh-norm"), 200, 100, 1.0)[0] == (80, 30, 40, 40)
    assert check_box(_box(10, 20, 30, 60, fmt="xyxy"), 100, 100, 1.0)[0] == (10, 20, 20, 40)
