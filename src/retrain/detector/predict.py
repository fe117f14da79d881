"""Predictions of a detector as COCO result dicts: on a collated batch, on a loader, on a split of the master.

ultralytics' own NMS (evaluation settings from params) and ``scale_boxes`` map the letterboxed
boxes back to each original image, as its validator does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ultralytics.utils import ops
from ultralytics.utils.nms import non_max_suppression

from retrain.config import RuntimeParams, TrainParams
from retrain.data.master import Master
from retrain.detector.files import ModelFile
from retrain.device import on_cuda


@dataclass(frozen=True)
class Nms:
    """NMS settings: confidence threshold, IoU threshold, detections kept per image, and whether a box may be kept
    once per class above ``conf`` (the evaluation convention, for mAP) or only with its best class (a deployed
    detector's answer, what the audit compares labels with)."""

    conf: float
    iou: float
    max_det: int
    multi_label: bool = True


def postprocess(preds: Any, batch: Mapping[str, Any], image_ids: Sequence[int], category_ids: Sequence[int],
                conf: float, iou: float, max_det: int, multi_label: bool = True) -> list[dict[str, Any]]:
    """NMS, back to original pixels, COCO result dicts.

    Args:
        preds: The model's eval-mode output (decoded predictions, or a tuple whose first item is).
        batch: The collated batch (``img``, ``ori_shape``, ``ratio_pad``).
        image_ids: COCO image id of each image in the batch.
        category_ids: COCO category id of each class index; a negative id drops that class's detections (a
            champion's class the master no longer has).
        conf: Confidence threshold.
        iou: NMS IoU threshold.
        max_det: Detections kept per image.
        multi_label: Keep a box once per class above ``conf`` (evaluation), or only with its best class.

    Returns:
        One dict per detection: ``image_id``, ``category_id``, ``bbox`` (x, y, w, h), ``score``.
    """
    out = non_max_suppression(preds, conf, iou, multi_label=multi_label, max_det=max_det)
    shape = batch["img"].shape[2:]
    dets: list[dict[str, Any]] = []
    for i, d in enumerate(out):
        if not len(d):
            continue
        boxes = torch.as_tensor(ops.scale_boxes(shape, d[:, :4].clone().float(), batch["ori_shape"][i],
                                                ratio_pad=batch["ratio_pad"][i]))
        xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).cpu().tolist()
        for box, score, cls in zip(xywh, d[:, 4].cpu().tolist(), d[:, 5].cpu().tolist(), strict=True):
            if category_ids[int(cls)] < 0:
                continue
            dets.append({"image_id": int(image_ids[i]), "category_id": int(category_ids[int(cls)]),
                         "bbox": [round(v, 3) for v in box], "score": round(float(score), 5)})
    return dets


@torch.no_grad()
def predict_loader(model: torch.nn.Module, loader: Any, image_ids: Mapping[str, int], category_ids: Sequence[int],
                   conf: float, iou: float, max_det: int, multi_label: bool = True) -> list[dict[str, Any]]:
    """Detections of ``model`` (put in eval mode) on every batch of ``loader``, as COCO result dicts."""
    model.eval()
    device = next(model.parameters()).device
    dets: list[dict[str, Any]] = []
    for batch in loader:
        img = batch["img"].to(device).float() / 255
        ids = [image_ids[f] for f in batch["im_file"]]
        dets.extend(postprocess(model(img), batch, ids, category_ids, conf, iou, max_det, multi_label))
    return dets


def category_ids_for(model_names: Sequence[str], master: Master) -> list[int]:
    """The master's category id of each of a model's classes, matched by name (-1: the master has no such class)."""
    by_name = dict(zip(master.names, master.category_ids, strict=True))
    return [by_name.get(n, -1) for n in model_names]


@dataclass(frozen=True)
class SplitBatches:
    """A split of the master as a model of a given ``imgsz`` sees it: the loader of its letterboxed batches (no
    augmentation, no decoded-image cache), each image file's COCO image id, and the master's category id of each of
    the model's classes."""

    loader: Any
    image_ids: Mapping[str, int]
    category_ids: list[int]


def split_batches(mf: ModelFile, master: Master, split: str, batch: int, train: TrainParams, runtime: RuntimeParams,
                  cache_dir: Path) -> SplitBatches:
    """The batches ``predict_split`` (and ``evaluation.parity``) run ``mf``'s network on."""
    from retrain.data.loading import SplitReader  # here: the served model imports this module, never Lightning

    tp = train.model_copy(update={"imgsz": mf.imgsz, "batch": batch})
    reader = SplitReader(master, tp, runtime.model_copy(update={"cache": "none"}), cache_dir)
    ds = reader.dataset(split, augment=False, cache="none")
    return SplitBatches(reader.loader(ds, train=False), reader.image_ids(ds, split), category_ids_for(mf.names, master))


@torch.no_grad()
def predict_split(mf: ModelFile, master: Master, split: str, nms: Nms, batch: int, train: TrainParams,
                  runtime: RuntimeParams, cache_dir: Path) -> list[dict[str, Any]]:
    """One model file's detections on one split of the master, as COCO result dicts.

    The images are letterboxed to the model's own ``imgsz`` (no decoded-image cache); its classes are mapped to the
    master's by name; it runs where training would (``train.accelerator``).
    """
    data = split_batches(mf, master, split, batch, train, runtime, cache_dir)
    model = mf.build()
    if on_cuda(train):
        model = model.cuda()
    return predict_loader(model, data.loader, data.image_ids, data.category_ids, nms.conf, nms.iou, nms.max_det,
                          nms.multi_label)
