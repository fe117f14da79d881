"""YOLO txt batches in the ultralytics layout: ``images/**``, ``labels/**`` and class names.

Class names come from ``data.yaml`` / ``dataset.yaml`` (or the one ``*.yaml`` at the root; key ``names``,
a list or an ``{index: name}`` mapping), else from ``classes.txt`` / ``names.txt``.  An image without a
label file is a background image; a label file without an image is reported, not fatal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from retrain.data.formats.model import SourceBatch, SourceBox, SourceImage, list_image_files

_YAML_NAMES = ("data.yaml", "dataset.yaml", "data.yml", "dataset.yml")
_TXT_NAMES = ("classes.txt", "names.txt", "labels/classes.txt")


def _names_from_yaml(batch: SourceBatch, path: Path) -> list[str] | None:
    try:
        doc: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0]
        batch.problem(path, "safe-yaml", f"not safe YAML ({first})")
        return None
    except (OSError, UnicodeDecodeError) as e:
        batch.problem(path, "readable", f"cannot be read ({e})")
        return None
    names = doc.get("names") if isinstance(doc, dict) else None
    if isinstance(names, list) and all(isinstance(n, str) and n for n in names):
        return list(names)
    if isinstance(names, dict):
        keys = sorted(k for k in names if isinstance(k, int))
        if keys == list(range(len(names))) and all(isinstance(names[k], str) and names[k] for k in keys):
            return [names[k] for k in keys]
    batch.problem(path, "class-names", "'names' must be a list of names or a mapping 0..N-1 -> name")
    return None


def read_names(batch: SourceBatch) -> list[str] | None:
    """Find and read the class names of a YOLO batch; records a problem when there are none."""
    root = batch.root
    yamls = [root / n for n in _YAML_NAMES if (root / n).is_file()]
    if not yamls:
        yamls = sorted(p for p in root.glob("*.y*ml") if p.is_file())
    if len(yamls) > 1:
        batch.problem(root, "class-names", f"several YAML files, expected one with 'names': {[p.name for p in yamls]}")
        return None
    if yamls:
        return _names_from_yaml(batch, yamls[0])
    for n in _TXT_NAMES:
        p = root / n
        if p.is_file():
            lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
            if lines:
                return lines
    batch.problem(root, "class-names", "no class names: add data.yaml with 'names', or classes.txt")
    return None


def _parse_label_file(batch: SourceBatch, path: Path, n_classes: int) -> list[SourceBox] | None:
    rel = batch.rel(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        batch.problem(path, "readable", f"cannot be read ({e})")
        return None
    boxes: list[SourceBox] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        where = f"{rel}:{lineno}"
        try:
            values = [float(v) for v in parts[1:]]
            cls = int(parts[0])
        except ValueError:
            batch.problem(where, "label-syntax", f"expected 'class cx cy w h' numbers, got {line.strip()!r:.60}")
            continue
        if not 0 <= cls < n_classes:
            batch.problem(where, "known-class", f"class index {cls} is not among the {n_classes} names")
            continue
        if len(values) == 4:
            coords = (values[0], values[1], values[2], values[3])
        elif len(values) >= 6 and len(values) % 2 == 0:
            # A segment polygon (ultralytics segment labels): its box is the polygon's extent.
            xs, ys = values[0::2], values[1::2]
            x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
            coords = ((x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0)
        else:
            batch.problem(where, "label-syntax", f"expected 4 box values or a polygon, got {len(values)} values")
            continue
        boxes.append(SourceBox(cls, coords, "cxcywh-norm", where))
    return boxes


def read_yolo(root: Path) -> SourceBatch:
    """Read a YOLO-format batch.

    Args:
        root: The batch root (resolved), holding ``images/`` and ``labels/``.

    Returns:
        The batch; structural defects are in ``problems``.
    """
    batch = SourceBatch(root=root, format="yolo")
    images_dir, labels_dir = root / "images", root / "labels"
    if not images_dir.is_dir():
        batch.problem(root, "yolo-structure", "no images/ folder")
        return batch
    names = read_names(batch)
    if names is None:
        return batch
    batch.categories = names
    used_labels: set[Path] = set()
    for img in list_image_files(images_dir):
        rel = img.relative_to(images_dir)
        label = (labels_dir / rel).with_suffix(".txt")
        boxes: list[SourceBox] = []
        label_rel = batch.rel(label)
        if label.is_file():
            used_labels.add(label)
            parsed = _parse_label_file(batch, label, len(names))
            boxes = parsed or []
        batch.images.append(SourceImage(rel.as_posix(), images_dir, None, tuple(boxes), label_rel))
    if labels_dir.is_dir():
        orphans = sorted(p for p in labels_dir.rglob("*.txt") if p not in used_labels and p.name != "classes.txt")
        for p in orphans:
            batch.notes.append(f"{batch.rel(p)}: label file with no image, skipped")
    backgrounds = sum(1 for i in batch.images if not i.boxes)
    if backgrounds:
        batch.notes.append(f"{backgrounds} image(s) without boxes kept as background images")
    return batch
