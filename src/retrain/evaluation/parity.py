"""Does an exported model answer as the PyTorch one? The same images, every raw prediction, then mAP50-95.

Both backends go through the evaluation's NMS (``evaluate``'s conf, iou, max_det), the same mapping back to the
original pixels (``detector.predict.postprocess``) and pycocotools (``metrics.coco``), so only the network's arithmetic
differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from retrain.config import Params
from retrain.data.master import Master
from retrain.detector.files import ModelFile
from retrain.detector.onnx_export import ExportError, OnnxDetector
from retrain.detector.predict import Nms, postprocess, split_batches
from retrain.metrics.coco import ground_truth, score

#: Tolerances: mAP50-95 on the same images (issue 23), and per raw prediction before NMS (boxes in input pixels, class
#: scores in 0-1): float32 kernels of two runtimes differ in their last bits (measured: 0.003 px, 1e-6), never more.
MAP_TOLERANCE = 0.002
BOX_TOLERANCE = 0.05
SCORE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Parity:
    """An exported model (ONNX, or OpenVINO IR converted from it) against the PyTorch one on the same images.

    Attributes:
        split: The master's split compared.
        images: Its images.
        map_torch: mAP50-95 of the PyTorch model (pycocotools).
        map_onnx: mAP50-95 of the exported model, same NMS and scoring.
        box_diff: Largest difference of a raw predicted box coordinate (input pixels), before NMS.
        score_diff: Largest difference of a raw class score, before NMS.
        passed: Within ``MAP_TOLERANCE``, ``BOX_TOLERANCE`` and ``SCORE_TOLERANCE``.
        reason: Why not, when it did not pass.
    """

    split: str
    images: int
    map_torch: float
    map_onnx: float
    box_diff: float
    score_diff: float
    passed: bool
    reason: str = ""

    def tags(self) -> dict[str, str]:
        """As MLflow tags (``retrain.onnx.parity.*``; ``reason`` only when it did not pass)."""
        return {f"retrain.onnx.parity.{k}": str(v) for k, v in asdict(self).items() if k != "reason" or v}


def parity(mf: ModelFile, exported: Path | Callable[[torch.Tensor], torch.Tensor], master: Master, split: str,
           params: Params, cache_dir: Path) -> Parity:
    """Compare an exported model (an ONNX file, run by onnxruntime, or any runner of a float batch such as
    ``OpenVinoDetector``) with ``mf`` on the master's ``split``: every raw prediction, then mAP50-95 through the
    evaluation's NMS (``evaluate``'s conf, iou, max_det) and pycocotools.

    Raises:
        ExportError: The split has no images.
    """
    images = master.images(split)
    if not images:
        raise ExportError(f"parity: the master has no {split} images to compare the exported model on")
    e = params.evaluate
    nms = Nms(e.conf, e.iou, e.max_det)
    data = split_batches(mf, master, split, e.batch, params.train, params.runtime, cache_dir)
    ids, cats = data.image_ids, data.category_ids
    model = mf.build().eval()
    onnx = OnnxDetector(exported) if isinstance(exported, Path) else exported
    box = cls = 0.0
    dets: dict[str, list[dict[str, Any]]] = {"torch": [], "onnx": []}
    for batch in data.loader:  # one pass: each batch through both backends, compared, then through the same NMS
        img = batch["img"].float() / 255
        with torch.no_grad():
            out = model(img)
        want = out[0] if isinstance(out, tuple | list) else out
        got = onnx(img)
        if got.shape != want.shape:
            raise ExportError(f"parity: the exported model answers shape {tuple(got.shape)}, "
                              f"PyTorch {tuple(want.shape)}")
        box = max(box, float((got[:, :4] - want[:, :4]).abs().max()))
        cls = max(cls, float((got[:, 4:] - want[:, 4:]).abs().max()))
        batch_ids = [ids[f] for f in batch["im_file"]]
        for name, preds in (("torch", want), ("onnx", got)):
            dets[name] += postprocess(preds, batch, batch_ids, cats, nms.conf, nms.iou, nms.max_det)
    gt = ground_truth(master.doc, split)
    m_torch, m_onnx = score(gt, dets["torch"]).overall, score(gt, dets["onnx"]).overall
    a, b = float(m_torch.map), float(m_onnx.map)
    reasons = []
    if not (math.isfinite(b) and abs(a - b) <= MAP_TOLERANCE):
        reasons.append(f"mAP50-95 {b:.4f} vs PyTorch {a:.4f} (tolerance {MAP_TOLERANCE})")
    if not box <= BOX_TOLERANCE:
        reasons.append(f"a box differs by {box:.4g} px (tolerance {BOX_TOLERANCE})")
    if not cls <= SCORE_TOLERANCE:
        reasons.append(f"a class score differs by {cls:.4g} (tolerance {SCORE_TOLERANCE})")
    return Parity(split, len(images), round(a, 5), round(b, 5), box, cls, not reasons, "; ".join(reasons))
