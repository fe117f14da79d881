import io
import os
from pathlib import Path

import pytest
from PIL import Image

from retrain.data.formats import SourceBox
from retrain.validation.images import BadImage, UnsafePath, check_files, inspect_image, safe_member
from tests.helpers import bomb_png


def _jpeg(path: Path, size=(64, 48), exif_orientation: int | None = None) -> Path:
    im = Image.new("RGB", size, (200, 30, 30))
    kw = {}
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kw["exif"] = exif
    im.save(path, format="JPEG", **kw)
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
    with pytest.raises(BadImage, match=match):
        inspect_image(p)


def test_gif_is_not_an_accepted_format(tmp_path: Path):
    p = tmp_path / "x.jpg"
    buf = io.BytesIO()
    Image.new("P", (8, 8)).save(buf, format="GIF")
    p.write_bytes(buf.getvalue())
    with pytest.raises(BadImage, match="GIF is not an accepted"):
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


def test_pixel_bound_is_checked_before_decoding(tmp_path: Path):
    p = _jpeg(tmp_path / "big.jpg", size=(200, 100))
    assert inspect_image(p, max_pixels=20_000).width == 200
    with pytest.raises(BadImage, match="more than the 19999 pixels"):
        inspect_image(p, max_pixels=19_999)


def test_check_files_in_processes_and_cache(tmp_path: Path):
    from retrain.validation.images import ImageCheckCache

    root = tmp_path.resolve()
    names = [f"{i}.jpg" for i in range(70)]
    for i, n in enumerate(names):
        _jpeg(root / n, size=(16 + i, 16))
    (root / "bad.jpg").write_bytes(b"nope")
    res = check_files(root, root, [*names, "bad.jpg"], None, workers=2)
    assert [r.info.width for r in res[:-1]] == [16 + i for i in range(70)]
    assert res[-1].info is None and res[-1].rule == "image-decodes"
    cache = ImageCheckCache(tmp_path / "cache.json")
    known = {r.name: r.info.sha256 for r in res[:-1]}
    check_files(root, root, names, None, workers=1, known=known, cache=cache)
    cache.save()
    (root / "0.jpg").write_bytes(b"changed")  # a changed file is not served from the cache
    again = check_files(root, root, names, None, workers=1, known=known, cache=ImageCheckCache(tmp_path / "cache.json"))
    assert again[0].info is None and all(r.info is not None for r in again[1:])


@pytest.mark.parametrize("fmt,coords,expected", [
    ("xywh", (10, 20, 30, 40), (10, 20, 30, 40)),
    ("xyxy", (10, 20, 30, 60), (10, 20, 20, 40)),
    ("cxcywh-norm", (0.5, 0.5, 0.2, 0.4), (80, 30, 40, 40)),
])
def test_box_pixels(fmt, coords, expected):
    assert SourceBox(0, coords, fmt, "f").pixels(200, 100) == pytest.approx(expected)


def test_decompression_bomb_is_refused_with_little_memory(tmp_path: Path):
    """A small PNG claiming 30000x30000 is refused from its header: the checking process stays under 500 MB."""
    import subprocess
    import sys

    bomb = bomb_png(tmp_path / "bomb.png")
    code = (
        "from retrain.validation.images import BadImage, inspect_image\n"
        f"try:\n    inspect_image(__import__('pathlib').Path({str(bomb)!r}))\n"
        "except BadImage as e:\n    print('refused:', e)\n"
        # VmHWM: the peak RSS of this program's own memory. (ru_maxrss is no good here: Linux carries the
        # parent's peak across fork + exec, so a child of a pytest that loaded torch would report >1 GB.)
        "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
        "print('maxrss_kb', hwm)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refused: decompression bomb refused" in out
    maxrss_mb = int(out.split("maxrss_kb")[1]) / 1024
    assert maxrss_mb < 500, maxrss_mb


def test_the_check_never_goes_through_ultralytics_pil_patch(tmp_path: Path):
    """Importing ultralytics wraps PIL's Image.open to pip-install a HEIF plugin on unknown files: not in a check."""
    import ultralytics.utils.patches  # noqa: F401  (applies the patch in this process)

    p = tmp_path / "x.jpg"
    p.write_bytes(os.urandom(2048))
    with pytest.raises(BadImage, match="not a decodable image"):
        inspect_image(p)
