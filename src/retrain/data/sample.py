"""Procedural sample batches: real JPEGs with exact boxes, learnable by a small detector on a CPU.

Batch 1 has three shapes on smooth gradients.  Later batches shift the distribution, as real new
data does: new backgrounds (stripes, then noise), other object scales, and from batch 2 a new class
(``star``).  Deterministic for a seed.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

BASE_CLASSES = ("circle", "square", "triangle")
KINDS = ("missing", "wrong_class", "bad_location")  # planted label errors, named as the audit names them
NEW_CLASS = "star"
_BACKGROUNDS = ("gradient", "stripes", "noise")
_SCALES = ((36, 96), (24, 64), (48, 120))  # object side range in pixels, per batch (cycling)


@dataclass(frozen=True)
class SampleBatch:
    """One generated batch."""

    path: Path
    classes: tuple[str, ...]
    images: int
    boxes: int


def classes_for(batch_index: int) -> tuple[str, ...]:
    """Classes present in batch ``batch_index`` (1-based)."""
    return BASE_CLASSES + ((NEW_CLASS,) if batch_index >= 2 else ())


def _background(rng: random.Random, style: str, w: int, h: int) -> Image.Image:
    c0 = tuple(rng.randint(0, 255) for _ in range(3))
    c1 = tuple(rng.randint(0, 255) for _ in range(3))
    img = Image.new("RGB", (w, h), c0)
    draw = ImageDraw.Draw(img)
    if style == "gradient":
        for y in range(h):
            t = y / max(1, h - 1)
            draw.line([(0, y), (w, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(c0, c1, strict=True)))
    elif style == "stripes":
        step = rng.randint(8, 24)
        for x in range(-h, w, step * 2):
            draw.polygon([(x, 0), (x + step, 0), (x + step + h, h), (x + h, h)], fill=c1)
    else:
        cell = rng.randint(4, 10)
        for y in range(0, h, cell):
            for x in range(0, w, cell):
                v = rng.randint(-40, 40)
                draw.rectangle([x, y, x + cell, y + cell], fill=tuple(max(0, min(255, c + v)) for c in c0))
    return img


def _shape_points(cls: str, x: float, y: float, s: float, rng: random.Random) -> list[tuple[float, float]]:
    if cls == "triangle":
        return [(x + s / 2, y), (x + s, y + s), (x, y + s)]
    if cls == "star":
        cx, cy, r_out, r_in = x + s / 2, y + s / 2, s / 2, s / 5
        pts = []
        for k in range(10):
            r, a = (r_out if k % 2 == 0 else r_in), -math.pi / 2 + k * math.pi / 5
            pts.append((cx + r * math.cos(a), cy + r * math.sin(a)))
        return pts
    return [(x, y), (x + s, y), (x + s, y + s), (x, y + s)]


def _overlaps(box: tuple[float, float, float, float], others: list[tuple[float, float, float, float]]) -> bool:
    x, y, w, h = box
    return any(x < ox + ow and ox < x + w and y < oy + oh and oy < y + h for ox, oy, ow, oh in others)


def _draw_image(rng: random.Random, batch_index: int, classes: tuple[str, ...]) -> tuple[Image.Image, list]:
    w, h = rng.randrange(288, 385, 8), rng.randrange(224, 321, 8)
    style = _BACKGROUNDS[(batch_index - 1) % len(_BACKGROUNDS)]
    img = _background(rng, style, w, h)
    draw = ImageDraw.Draw(img)
    lo, hi = _SCALES[(batch_index - 1) % len(_SCALES)]
    placed: list[tuple[float, float, float, float]] = []
    boxes = []
    for _ in range(rng.randint(1, 5)):
        cls = rng.choice(classes)
        for _attempt in range(20):
            s = rng.randint(lo, min(hi, w - 2, h - 2))
            x, y = rng.randint(0, w - s - 1), rng.randint(0, h - s - 1)
            pts = _shape_points(cls, x, y, s, rng)
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            box = (min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys))
            if not _overlaps(box, placed):
                break
        else:
            continue
        color = tuple(rng.randint(0, 255) for _ in range(3))
        if cls == "circle":
            draw.ellipse([x, y, x + s, y + s], fill=color, outline=(0, 0, 0))
            box = (float(x), float(y), float(s + 1), float(s + 1))
        else:
            draw.polygon(pts, fill=color, outline=(0, 0, 0))
            box = (box[0], box[1], box[2] + 1, box[3] + 1)
        box = (box[0], box[1], min(box[2], w - box[0]), min(box[3], h - box[1]))
        placed.append(box)
        boxes.append((cls, [round(v, 2) for v in box]))
    return img, boxes


def generate_batch(out: Path, batch_index: int, n_images: int, seed: int) -> SampleBatch:
    """Write one COCO batch: ``out/images/*.jpg`` and ``out/annotations.json``.

    Args:
        out: The batch folder (created).
        batch_index: 1-based; decides background, scale and classes.
        n_images: Number of images.
        seed: Base seed.

    Returns:
        What was written.
    """
    rng = random.Random(f"{seed}:{batch_index}")
    classes = classes_for(batch_index)
    (out / "images").mkdir(parents=True, exist_ok=True)
    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    for i in range(1, n_images + 1):
        img, boxes = _draw_image(rng, batch_index, classes)
        name = f"b{batch_index}_{i:05d}.jpg"
        img.save(out / "images" / name, format="JPEG", quality=90)
        images.append({"id": i, "file_name": name, "width": img.width, "height": img.height})
        for cls, bbox in boxes:
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": classes.index(cls) + 1, "bbox": bbox,
                         "area": round(bbox[2] * bbox[3], 2), "iscrowd": 0})
    doc = {"images": images, "annotations": anns,
           "categories": [{"id": k + 1, "name": c} for k, c in enumerate(classes)]}
    (out / "annotations.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return SampleBatch(out, classes, len(images), len(anns))


def generate(out: Path, batches: int, images_per_batch: int, seed: int) -> list[SampleBatch]:
    """Write ``batches`` sample batches as ``out/batch-1`` .. ``out/batch-N``.

    Args:
        out: Parent folder.
        batches: How many batches.
        images_per_batch: Images in each.
        seed: Base seed; the same seed gives the same bytes.

    Returns:
        The batches written.
    """
    return [generate_batch(out / f"batch-{k}", k, images_per_batch, seed) for k in range(1, batches + 1)]


def _render(background: Image.Image, shapes: list[tuple[str, int, int, int, tuple[int, ...]]],
            rng: random.Random) -> tuple[Image.Image, list]:
    """Draw ``shapes`` ``(class, x, y, side, colour)`` on a copy of ``background``; their exact boxes."""
    img = background.copy()
    draw = ImageDraw.Draw(img)
    w, h = img.size
    boxes = []
    for cls, x, y, s, color in shapes:
        if cls == "circle":
            draw.ellipse([x, y, x + s, y + s], fill=color, outline=(0, 0, 0))
            box = (float(x), float(y), float(s + 1), float(s + 1))
        else:
            pts = _shape_points(cls, x, y, s, rng)
            draw.polygon(pts, fill=color, outline=(0, 0, 0))
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            box = (min(xs), min(ys), max(xs) - min(xs) + 1, max(ys) - min(ys) + 1)
        box = (box[0], box[1], min(box[2], w - box[0]), min(box[3], h - box[1]))
        boxes.append((cls, [round(v, 2) for v in box]))
    return img, boxes


def generate_scenes(out: Path, scenes: int, frames: int, seed: int, copies: int = 1, step: int = 1,
                    video_ids: bool = False) -> SampleBatch:
    """Write a COCO batch of near-duplicates, the shape of real deliveries: each scene is ``frames`` consecutive
    frames of shapes moving ``step`` pixels a frame over a fixed background, and each frame's first ``copies``
    frames also come re-encoded (JPEG quality 60, a different file with the same picture).

    Args:
        out: The batch folder (created).
        scenes: Number of scenes.
        frames: Frames per scene.
        seed: Base seed.
        copies: Re-encoded copies per scene (of its first frames).
        step: Pixels each shape moves per frame.
        video_ids: Also label each frame with its scene's ``video_id`` (COCO-VID style).

    Returns:
        What was written.
    """
    rng = random.Random(f"{seed}:scenes")
    classes = BASE_CLASSES
    (out / "images").mkdir(parents=True, exist_ok=True)
    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []

    def add(img: Image.Image, name: str, boxes: list, scene: int, quality: int) -> None:
        img.save(out / "images" / name, format="JPEG", quality=quality)
        image_id = len(images) + 1
        images.append({"id": image_id, "file_name": name, "width": img.width, "height": img.height,
                       **({"video_id": scene} if video_ids else {})})
        for cls, bbox in boxes:
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": classes.index(cls) + 1,
                         "bbox": bbox, "area": round(bbox[2] * bbox[3], 2), "iscrowd": 0})

    for scene in range(1, scenes + 1):
        w, h = rng.randrange(288, 385, 8), rng.randrange(224, 321, 8)
        background = _background(rng, rng.choice(_BACKGROUNDS), w, h)
        shapes = []
        for _ in range(rng.randint(1, 4)):
            s = rng.randint(36, 80)
            margin = step * frames + 2
            if w - s - 2 * margin <= 0 or h - s - 2 * margin <= 0:
                continue
            x, y = rng.randint(margin, w - s - margin), rng.randint(margin, h - s - margin)
            shapes.append((rng.choice(classes), x, y, s, tuple(rng.randint(0, 255) for _ in range(3)),
                           rng.choice((-1, 1)), rng.choice((-1, 1))))
        for f in range(frames):
            moved = [(c, x + dx * step * f, y + dy * step * f, s, col) for c, x, y, s, col, dx, dy in shapes]
            img, boxes = _render(background, moved, random.Random(0))
            add(img, f"s{scene:03d}_f{f:02d}.jpg", boxes, scene, 90)
            if f < copies:
                add(img, f"s{scene:03d}_f{f:02d}_copy.jpg", boxes, scene, 60)
    doc = {"images": images, "annotations": anns,
           "categories": [{"id": k + 1, "name": c} for k, c in enumerate(classes)]}
    (out / "annotations.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return SampleBatch(out, classes, len(images), len(anns))


def plant_errors(src: Path, dst: Path, drop: float, relabel: float, shift: float, seed: int) -> dict[str, set[str]]:
    """Copy a COCO batch with label errors planted box by box, as annotators make them (the audit's benchmark and
    tests): each box independently is removed (``drop``), given another class of the batch (``relabel``) or moved
    by half its size, staying in its image (``shift``).

    Returns:
        Per kind (``missing``, ``wrong_class``, ``bad_location``): the file names of the images with such an error.
    """
    shutil.copytree(src, dst)
    doc = json.loads((src / "annotations.json").read_text())
    rng = random.Random(seed)
    images = {im["id"]: im for im in doc["images"]}
    cats = [c["id"] for c in doc["categories"]]
    planted: dict[str, set[str]] = {k: set() for k in KINDS}
    kept = []
    for a in doc["annotations"]:
        r, im = rng.random(), images[a["image_id"]]
        if r < drop:
            planted["missing"].add(im["file_name"])
            continue
        if r < drop + relabel:
            a["category_id"] = rng.choice([c for c in cats if c != a["category_id"]])
            planted["wrong_class"].add(im["file_name"])
        elif r < drop + relabel + shift:
            x, y, w, h = a["bbox"]
            x = x + w / 2 if x + 1.5 * w <= im["width"] else x - w / 2  # half its size, staying in the image
            y = y + h / 2 if y + 1.5 * h <= im["height"] else y - h / 2
            a["bbox"] = [max(0.0, x), max(0.0, y), w, h]
            planted["bad_location"].add(im["file_name"])
        kept.append(a)
    doc["annotations"] = kept
    (dst / "annotations.json").write_text(json.dumps(doc))
    return planted
