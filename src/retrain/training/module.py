"""The ``LightningModule``: ultralytics' ``DetectionModel`` and its own detection loss.

Validation predicts with ultralytics' NMS and scores with pycocotools on the master's val split
(``val/mAP50-95`` is what checkpoints and early stopping watch).  Under DDP every rank gathers all
ranks' detections, so each computes the same score.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from ultralytics.nn.tasks import DetectionModel

from retrain.config import TrainParams
from retrain.data.loading import hyperparameters
from retrain.data.master import Master
from retrain.detector.predict import postprocess
from retrain.metrics.coco import CocoMetrics, ground_truth, score


def make_optimizer(p: TrainParams, groups: list[dict[str, Any]], precision: str) -> torch.optim.Optimizer:
    """SGD or AdamW over ``groups``, fused where Lightning allows it.

    fused: one kernel per step for all parameters (CPU and CUDA), where torch's plain default on a CPU is a Python
    loop over ~450 tensors.  Lightning's mixed-precision plugin refuses gradient clipping with an optimizer that
    unscales gradients itself (any fused one), even in bf16 where nothing is scaled: a mixed-precision run with
    ``grad_clip`` takes the multi-tensor (foreach) path instead.  Found on the first run on a CUDA GPU.
    """
    kind = {"foreach": True} if "mixed" in precision and p.grad_clip else {"fused": True}
    if p.optimizer == "SGD":
        return torch.optim.SGD(groups, lr=p.lr, momentum=p.momentum, nesterov=True, **kind)
    return torch.optim.AdamW(groups, lr=p.lr, betas=(p.momentum, 0.999), **kind)


class DetectorModule(pl.LightningModule):
    """Fine-tunes a ``DetectionModel`` on the master.

    ``compiled_forward``: the network's forward compiled for training batches of ``params.batch`` images
    (``training.compiled``), or ``None``; a smaller last batch and validation run eagerly.

    Args:
        model: The network (warm-started or fresh).
        master: The dataset (class names and the val ground truth).
        params: The ``train`` section.
    """

    compiled_forward: Callable[[torch.Tensor], Any] | None = None  # a class default: deep copies (EMA) have none

    def __init__(self, model: DetectionModel, master: Master, params: TrainParams) -> None:
        super().__init__()
        self.model = model
        self.model.args = hyperparameters(params)  # box/cls/dfl gains for ultralytics' loss
        self.params = params
        self.category_ids = master.category_ids
        self.gt = ground_truth(master.doc, "val")
        self.image_ids: dict[str, int] = {}
        self._dets: list[dict[str, Any]] = []
        self.last_metrics: CocoMetrics | None = None
        self.run_meta: dict[str, Any] = {}  # data version, params hash, MLflow run: saved in every checkpoint
        self.memory_format = torch.channels_last if params.channels_last == "on" else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)  # the weights too, for oneDNN's NHWC kernels

    def forward(self, img: torch.Tensor) -> Any:
        return self.model(img)

    def _images(self, batch: dict[str, Any]) -> torch.Tensor:
        return (batch["img"].float() / 255).contiguous(memory_format=self.memory_format)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        img = self._images(batch)
        fast = self.compiled_forward if img.shape[0] == self.params.batch else None
        preds = fast(img) if fast is not None else self.model(img)
        loss, items = self.model.loss(batch, preds)
        n = batch["img"].shape[0]
        self.log_dict({f"train/{k}": v for k, v in items.items()}, on_step=False, on_epoch=True, batch_size=n)
        total = loss.sum()
        self.log("loss", total.detach() / n, prog_bar=True, on_step=True, on_epoch=False, logger=False, batch_size=n)
        self.log("train/loss", total.detach() / n, on_step=False, on_epoch=True, batch_size=n)
        return total

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("compiled_forward", None)  # bound to this module's network, not to a copy's
        return state

    def on_validation_epoch_start(self) -> None:
        self._dets = []

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        preds = self.model(self._images(batch))
        ids = [self.image_ids[f] for f in batch["im_file"]]
        p = self.params
        self._dets.extend(postprocess(preds, batch, ids, self.category_ids, p.nms_conf, p.nms_iou, p.max_det))

    def on_validation_epoch_end(self) -> None:
        dets = self._dets
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, dets)
            # DistributedSampler pads with repeated images: keep one copy of each image's detections.
            seen: dict[int, list[dict[str, Any]]] = {}
            for part in gathered:
                for d in part:
                    seen.setdefault(d["image_id"], []).append(d)
            dets = _dedupe(seen)
        m = score(self.gt, dets).overall
        self.last_metrics = m
        self.log_dict({"val/mAP50-95": m.map, "val/mAP50": m.map50, "val/mAP75": m.map75, "val/AR100": m.ar100},
                      prog_bar=False, sync_dist=False, rank_zero_only=False)
        self.log("val/map", m.map, prog_bar=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["retrain"] = dict(self.run_meta)

    def configure_optimizers(self) -> Any:
        p = self.params
        decay: list[nn.Parameter] = []
        norm: list[nn.Parameter] = []
        bias: list[nn.Parameter] = []
        norms = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
        for module in self.model.modules():  # ultralytics' groups: decayed weights, norm weights, biases
            for name, param in module.named_parameters(recurse=False):
                (bias if name == "bias" else norm if isinstance(module, norms) else decay).append(param)
        groups = [{"params": decay, "weight_decay": p.weight_decay}, {"params": norm, "weight_decay": 0.0},
                  {"params": bias, "weight_decay": 0.0}]
        opt = make_optimizer(p, groups, str(self.trainer.precision))
        total = int(self.trainer.estimated_stepping_batches)
        warm = min(round(p.warmup_epochs * total / p.epochs), max(total - 1, 0))
        # As ultralytics' trainer: during warm-up the biases' LR falls from warmup_bias_lr, the others' rises from 0.
        plain = _lr_lambda(warm, total, p.lrf, p.schedule)
        biases = _lr_lambda(warm, total, p.lrf, p.schedule, start=p.warmup_bias_lr / p.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [plain, plain, biases])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _lr_lambda(warmup: int, total: int, lrf: float, schedule: str, start: float = 0.0) -> Any:
    """Linear warm-up from ``start`` over ``warmup`` steps, then cosine or linear decay to ``lrf`` at ``total``.

    A plain function (not an object), so the scheduler's state dict holds numbers only.
    """

    def factor(step: int) -> float:
        t = min(1.0, max(0, step - warmup) / max(1, total - warmup))
        shape = (1 + math.cos(math.pi * t)) / 2 if schedule == "cosine" else 1 - t
        target = lrf + (1 - lrf) * shape
        if warmup and step < warmup:
            return start + (target - start) * (step + 1) / warmup
        return target

    return factor


def _dedupe(by_image: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for dets in by_image.values():
        unique = {(d["category_id"], tuple(d["bbox"]), d["score"]): d for d in dets}
        out.extend(unique.values())
    return out
