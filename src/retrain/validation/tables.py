"""The tables great-expectations checks: one row per box, one row per image, one row per class.

Built from a COCO document (a batch being ingested, or the master) plus what decoding the images told
us.  Derived columns (``right_margin``, ``bottom_margin``, ``is_val``, ``n_boxes``) turn geometric rules
into plain column expectations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

# Text columns are pandas categoricals: great-expectations hashes every table it is given, and hashing
# a categorical (its categories once, then integer codes) costs a fraction of hashing a million strings.
BOX_COLUMNS = {
    "ann_id": "int64", "image_id": "int64", "category_id": "int64",
    "x": "float64", "y": "float64", "w": "float64", "h": "float64",
    "right_margin": "float64", "bottom_margin": "float64",
    "file_name": "category", "label_file": "category", "batch": "category", "split": "category",
}
IMAGE_COLUMNS = {
    "image_id": "int64", "file_name": "category", "sha256": "object", "width": "int64", "height": "int64",
    "decoded_width": "int64", "decoded_height": "int64", "split": "category", "batch": "category",
    "n_boxes": "int64", "is_val": "int64", "group": "int64", "group_splits": "int64",
}
CLASS_COLUMNS = {"category_id": "int64", "name": "object", "train": "int64", "val": "int64", "test": "int64"}


def image_table(coco: Mapping[str, Any], decoded: Mapping[str, tuple[int, int]]) -> pd.DataFrame:
    """One row per image.

    Args:
        coco: A COCO document whose images carry ``sha256`` (and, for the master, ``split``/``batch``).
        decoded: sha256 -> (width, height) as decoded after EXIF orientation.

    Returns:
        The table, typed as ``IMAGE_COLUMNS``.
    """
    ims = coco["images"]
    counts = pd.Series([a["image_id"] for a in coco["annotations"]], dtype="int64").value_counts()
    df = pd.DataFrame({
        "image_id": [i["id"] for i in ims],
        "file_name": [i["file_name"] for i in ims],
        "sha256": [i["sha256"] for i in ims],
        "width": [i["width"] for i in ims],
        "height": [i["height"] for i in ims],
        "decoded_width": [decoded.get(i["sha256"], (-1, -1))[0] for i in ims],
        "decoded_height": [decoded.get(i["sha256"], (-1, -1))[1] for i in ims],
        "split": [i.get("split", "") for i in ims],
        "batch": [i.get("batch", "") for i in ims],
    })
    df["n_boxes"] = df["image_id"].map(counts).fillna(0).astype("int64")
    df["is_val"] = (df["split"] == "val").astype("int64")
    # The master's near-copy group (merge); an image of a batch is a group of its own.
    df["group"] = [i.get("group", i["id"]) for i in ims]
    df["group_splits"] = df.groupby("group")["split"].transform("nunique").astype("int64")
    return df.astype(IMAGE_COLUMNS)


def box_table(coco: Mapping[str, Any], label_files: Mapping[int, str] | None = None) -> pd.DataFrame:
    """One row per box, with the margins to the image's right and bottom edges.

    Args:
        coco: A COCO document.
        label_files: annotation id -> the label file that states it (for messages); default the image file.

    Returns:
        The table, typed as ``BOX_COLUMNS``; non-numeric coordinates become NaN.
    """
    images = {i["id"]: i for i in coco["images"]}
    anns = coco["annotations"]
    bbox = np.array([_four(a.get("bbox")) for a in anns], dtype="float64").reshape(-1, 4)
    img = [images.get(a["image_id"], {}) for a in anns]
    width = np.array([i.get("width", np.nan) for i in img], dtype="float64")
    height = np.array([i.get("height", np.nan) for i in img], dtype="float64")
    files = [i.get("file_name", "") for i in img]
    df = pd.DataFrame({
        "ann_id": [a["id"] for a in anns],
        "image_id": [a["image_id"] for a in anns],
        "category_id": [a["category_id"] for a in anns],
        "x": bbox[:, 0], "y": bbox[:, 1], "w": bbox[:, 2], "h": bbox[:, 3],
        "right_margin": width - (bbox[:, 0] + bbox[:, 2]),
        "bottom_margin": height - (bbox[:, 1] + bbox[:, 3]),
        "file_name": files,
        "label_file": [(label_files or {}).get(a["id"], f) for a, f in zip(anns, files, strict=True)],
        "batch": [i.get("batch", "") for i in img],
        "split": [i.get("split", "") for i in img],
    })
    return df.astype(BOX_COLUMNS)


def class_table(coco: Mapping[str, Any], boxes: pd.DataFrame) -> pd.DataFrame:
    """One row per class: boxes in train, in val and in test."""
    counts = boxes.groupby(["category_id", "split"], observed=True).size().unstack(fill_value=0)
    rows = []
    for c in coco["categories"]:
        got = counts.loc[c["id"]] if c["id"] in counts.index else {}
        rows.append({"category_id": c["id"], "name": c["name"],
                     "train": int(got.get("train", 0)), "val": int(got.get("val", 0)),
                     "test": int(got.get("test", 0))})
    return pd.DataFrame(rows, columns=list(CLASS_COLUMNS)).astype(CLASS_COLUMNS)


def _four(b: Any) -> list[float]:
    if isinstance(b, list | tuple) and len(b) == 4:
        try:
            return [float(v) for v in b]
        except (TypeError, ValueError):
            pass
    return [np.nan] * 4
