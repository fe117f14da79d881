"""The expectation suites, defined in code and versioned with the repo.

Each ``Rule`` is one great-expectations expectation on one table, with a stable name (what the user
reads in ``[rule]``), a level (``fail`` stops the loop, ``warn`` is reported) and the column that names
the offending file in messages.  ``batch_rules`` hold for any batch and for the master;
``master_rules`` add what only the whole dataset can answer (split, instances per class, drift).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import great_expectations.expectations as gxe

from retrain.config import ValidateParams
from retrain.validation.tables import BOX_COLUMNS, CLASS_COLUMNS, IMAGE_COLUMNS

# How great-expectations names a pandas dtype: it compares the dtype's scalar type, and a categorical's is this.
_GX_TYPE = {"category": "CategoricalDtypeType"}


@dataclass(frozen=True)
class Rule:
    """One check.

    Attributes:
        name: Stable rule name shown to users.
        table: ``boxes``, ``images``, ``classes`` or ``new_boxes``.
        level: ``fail`` or ``warn``.
        what: The rule in plain words.
        expectation: The great-expectations expectation.
        file_column: Column naming the file (or class) in messages.
    """

    name: str
    table: str
    level: str
    what: str
    expectation: Any
    file_column: str = "file_name"


def _schema(table: str, columns: dict[str, str], file_column: str) -> list[Rule]:
    rules = [Rule("schema", table, "fail", f"{table} table has exactly the expected columns",
                  gxe.ExpectTableColumnsToMatchSet(column_set=list(columns), exact_match=True), file_column)]
    for col, dtype in columns.items():
        rules.append(Rule("schema", table, "fail", f"{table}.{col} is {dtype}",
                          gxe.ExpectColumnValuesToBeOfType(column=col, type_=_GX_TYPE.get(dtype, dtype)),
                          file_column))
        if table != "boxes" or col not in ("x", "y", "w", "h", "right_margin", "bottom_margin"):
            rules.append(Rule("schema", table, "fail", f"{table}.{col} has no nulls",
                              gxe.ExpectColumnValuesToNotBeNull(column=col), file_column))
    return rules


def box_rules(params: ValidateParams, class_ids: list[int]) -> list[Rule]:
    """Rules on the one-row-per-box table."""
    tol = -params.box_tolerance_px
    f = "label_file"
    rules = _schema("boxes", BOX_COLUMNS, f)
    rules += [
        Rule("unique-id", "boxes", "fail", "annotation ids are unique",
             gxe.ExpectColumnValuesToBeUnique(column="ann_id"), f),
    ]
    for col in ("x", "y", "w", "h"):
        rules.append(Rule("box-finite", "boxes", "fail", f"box {col} is a finite number",
                          gxe.ExpectColumnValuesToNotBeNull(column=col), f))
    for col in ("w", "h"):
        rules.append(Rule("box-area", "boxes", "fail", f"box {col} > 0",
                          gxe.ExpectColumnValuesToBeBetween(column=col, min_value=0, strict_min=True), f))
    for col, edge in (("x", "left"), ("y", "top"), ("right_margin", "right"), ("bottom_margin", "bottom")):
        rules.append(Rule("box-inside-image", "boxes", "fail",
                          f"box inside the image's {edge} edge (tolerance {params.box_tolerance_px:g}px)",
                          gxe.ExpectColumnValuesToBeBetween(column=col, min_value=tol), f))
    rules.append(Rule("known-class", "boxes", "fail", "category_id is in the class map",
                      gxe.ExpectColumnValuesToBeInSet(column="category_id", value_set=sorted(class_ids)), f))
    return rules


def image_rules(params: ValidateParams) -> list[Rule]:
    """Rules on the one-row-per-image table."""
    rules = _schema("images", IMAGE_COLUMNS, "file_name")
    rules += [
        Rule("unique-id", "images", "fail", "image ids are unique",
             gxe.ExpectColumnValuesToBeUnique(column="image_id")),
        Rule("unique-file", "images", "fail", "each (batch, file) is listed once",
             gxe.ExpectCompoundColumnsToBeUnique(column_list=["batch", "file_name"])),
        Rule("unique-content", "images", "fail", "each image content (sha256) appears once",
             gxe.ExpectColumnValuesToBeUnique(column="sha256")),
        Rule("image-size", "images", "fail", "width and height are positive",
             gxe.ExpectColumnValuesToBeBetween(column="width", min_value=1)),
        Rule("image-size", "images", "fail", "height is positive",
             gxe.ExpectColumnValuesToBeBetween(column="height", min_value=1)),
        Rule("image-size", "images", "fail", "width equals the decoded width (after EXIF orientation)",
             gxe.ExpectColumnPairValuesToBeEqual(column_A="width", column_B="decoded_width")),
        Rule("image-size", "images", "fail", "height equals the decoded height (after EXIF orientation)",
             gxe.ExpectColumnPairValuesToBeEqual(column_A="height", column_B="decoded_height")),
        Rule("boxes-per-image", "images", "fail", f"at most {params.max_boxes_per_image} boxes per image",
             gxe.ExpectColumnValuesToBeBetween(column="n_boxes", min_value=0, max_value=params.max_boxes_per_image)),
    ]
    return rules


def batch_rules(params: ValidateParams, class_ids: list[int]) -> list[Rule]:
    """What every batch, and the master, must satisfy."""
    return box_rules(params, class_ids) + image_rules(params)


def master_rules(params: ValidateParams, class_ids: list[int], old_distribution: dict[int, float] | None
                 ) -> list[Rule]:
    """Batch rules plus split, near-copy groups, instances per class, val fraction and drift of the newest batch.

    Args:
        params: The ``validate`` section.
        class_ids: The master's category ids.
        old_distribution: category id -> share of boxes in the batches before the newest; ``None`` when the
            master has a single batch (no drift to measure).
    """
    lvl = params.instances_level
    rules = batch_rules(params, class_ids) + _schema("classes", CLASS_COLUMNS, "name")
    rules += [
        Rule("split", "images", "fail", "split is train, val or test",
             gxe.ExpectColumnValuesToBeInSet(column="split", value_set=["train", "val", "test"])),
        # Merge puts a group of near-copies in one split by construction; this proves it on the data.
        Rule("group-split", "images", "fail", "every near-copy group (pHash or sequence) lies in one split",
             gxe.ExpectColumnValuesToBeBetween(column="group_splits", min_value=1, max_value=1)),
        Rule("val-fraction", "images", params.val_fraction_level,
             f"val fraction between {params.val_fraction_min:g} and {params.val_fraction_max:g}",
             gxe.ExpectColumnMeanToBeBetween(column="is_val", min_value=params.val_fraction_min,
                                             max_value=params.val_fraction_max)),
        Rule("min-train-instances", "classes", lvl, f"every class has >= {params.min_train_instances} boxes in train",
             gxe.ExpectColumnValuesToBeBetween(column="train", min_value=params.min_train_instances), "name"),
        Rule("min-val-instances", "classes", lvl, f"every class has >= {params.min_val_instances} boxes in val",
             gxe.ExpectColumnValuesToBeBetween(column="val", min_value=params.min_val_instances), "name"),
    ]
    if old_distribution:
        values = sorted(old_distribution)
        rules.append(Rule(
            "drift", "new_boxes", params.drift_level,
            f"KL divergence of the newest batch's class distribution from the older batches' <= "
            f"{params.drift_threshold:g}",
            gxe.ExpectColumnKLDivergenceToBeLessThan(
                column="category_id", threshold=params.drift_threshold, tail_weight_holdout=0.01,
                partition_object={"values": values, "weights": [old_distribution[v] for v in values]}),
            "label_file"))
    return rules
