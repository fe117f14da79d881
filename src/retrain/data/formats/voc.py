"""Pascal VOC batches: one XML per image (``Annotations/*.xml`` or anywhere in the batch).

Images are looked up by ``<filename>`` in ``JPEGImages/``, ``images/`` or beside the XML; ``<path>`` is
ignored (it is an absolute path on the labeller's machine).  Class names come from ``labels.txt`` /
``classes.txt`` when present (then any other name is unknown), else from the XMLs, sorted.
XML is parsed with defusedxml (no entity expansion, no external entities).
"""

from __future__ import annotations

from pathlib import Path
from xml.etree.ElementTree import Element

import defusedxml.ElementTree as SafeET
from defusedxml import DefusedXmlException

from retrain.data.formats.model import SourceBatch, SourceBox, SourceImage, list_image_files

_CLASS_FILES = ("labels.txt", "classes.txt")


def _text(el: Element | None, tag: str) -> str | None:
    child = el.find(tag) if el is not None else None
    return child.text.strip() if child is not None and child.text else None


def _image_root(root: Path, xml: Path) -> Path:
    for c in (root / "JPEGImages", root / "images", xml.parent):
        if c.is_dir():
            return c
    return root


def read_voc(root: Path) -> SourceBatch:  # noqa: C901 - one pass over a documented structure
    """Read a Pascal VOC batch.

    Args:
        root: The batch root (resolved).

    Returns:
        The batch; structural defects are in ``problems``.
    """
    batch = SourceBatch(root=root, format="voc")
    xmls = sorted(p for p in root.rglob("*.xml") if not any(s.startswith(".") for s in p.relative_to(root).parts))
    if not xmls:
        batch.problem(root, "voc-structure", "no .xml annotation files")
        return batch
    fixed: list[str] | None = None
    for n in _CLASS_FILES:
        if (root / n).is_file():
            fixed = [ln.strip() for ln in (root / n).read_text(encoding="utf-8").splitlines() if ln.strip()]
            break
    parsed: list[tuple[Path, str, Path, tuple[int, int] | None, list[tuple[str, tuple[float, ...], str]]]] = []
    for xml in xmls:
        rel = batch.rel(xml)
        try:
            tree = SafeET.parse(xml)
        except (SafeET.ParseError, DefusedXmlException, OSError) as e:
            batch.problem(xml, "xml-valid", f"cannot be parsed as XML ({e})")
            continue
        ann = tree.getroot()
        filename = _text(ann, "filename")
        if not filename:
            batch.problem(xml, "voc-structure", "no <filename>")
            continue
        size = ann.find("size")
        w, h = _text(size, "width"), _text(size, "height")
        claimed = (int(w), int(h)) if w and h and w.isdigit() and h.isdigit() and int(w) and int(h) else None
        objs = []
        for i, obj in enumerate(ann.iter("object"), start=1):
            name, bb = _text(obj, "name"), obj.find("bndbox")
            where = f"{rel} object {i}"
            try:
                coords = tuple(float(_text(bb, k) or "nan") for k in ("xmin", "ymin", "xmax", "ymax"))
            except ValueError:
                batch.problem(where, "box-valid", "bndbox coordinates must be numbers")
                continue
            if not name:
                batch.problem(where, "voc-structure", "object without <name>")
                continue
            objs.append((name, coords, where))
        parsed.append((xml, filename, _image_root(root, xml), claimed, objs))

    names = fixed if fixed is not None else sorted({o[0] for p in parsed for o in p[4]})
    index = {n: i for i, n in enumerate(names)}
    batch.categories = list(names)
    listed: set[Path] = set()
    for xml, filename, image_root, claimed, objs in parsed:
        boxes = []
        for name, coords, where in objs:
            if name not in index:
                batch.problem(where, "known-class", f"class {name!r} is not in {_CLASS_FILES}")
                continue
            boxes.append(SourceBox(index[name], (coords[0], coords[1], coords[2], coords[3]), "xyxy", where))
        listed.add((image_root / filename).absolute())
        batch.images.append(SourceImage(filename, image_root, claimed, tuple(boxes), batch.rel(xml)))
    roots = {i.image_root for i in batch.images}
    for r in sorted(roots):
        for f in list_image_files(r):
            if f.absolute() not in listed:
                batch.problem(f, "listed-file", "image file has no VOC annotation")
    return batch
