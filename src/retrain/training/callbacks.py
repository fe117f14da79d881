"""Lightning callbacks and the checkpoint IO of a training run (each small; the loop is Lightning's).

- ``WarmupEMA``: Lightning's ``EMAWeightAveraging`` with ultralytics' decay warm-up, so early updates are not
  dominated by the initial weights.  Validation and checkpoints use the EMA weights; its state survives resume.
- Seeding per epoch and close-mosaic are not callbacks: Lightning skips ``on_train_epoch_start`` in the first
  epoch after a resume, and loader processes are persistent, so the epoch travels with each sampled key and
  the dataset starts it where items are made (``data.EpochSampler``, ``data.MasterDataset.start_epoch``).
- ``FaultPoints``: named points for the fault tests (``RETRAIN_FAULT=train.epoch<N>``, in that epoch's 2nd batch).
- ``LastCheckpoint``: ``last.ckpt`` (the resume point) at an epoch's end, at most once per
  ``runtime.checkpoint_every_s`` seconds of training; the run's final epoch always.  Not Lightning's
  ``train_time_interval``: it saves mid-epoch, and a run resumes exactly only at an epoch boundary, where the draws
  of (seed, epoch) begin.
- ``AtomicCheckpointIO``: checkpoints written to a temp file, fsynced and renamed; the previous ``last.ckpt``
  is kept as ``last.prev.ckpt`` (the fallback when the newest is damaged); loads are ``weights_only=True``.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint

from retrain.faults import fault_point
from retrain.fsutil import fsync_dir

LAST = "last.ckpt"
PREVIOUS = "last.prev.ckpt"


class WarmupEMA(EMAWeightAveraging):
    """EMA of the weights with decay ``decay * (1 - exp(-updates / tau))`` (ultralytics' ``ModelEMA`` ramp)."""

    def __init__(self, decay: float, tau: float) -> None:
        super().__init__(decay=decay)

        def ema(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
            # One group of tensors of one dtype: foreach kernels, not a Python call per tensor.  Integer buffers
            # (BatchNorm's num_batches_tracked) take the current value, as ultralytics' ModelEMA leaves them.
            if not averaged[0].is_floating_point():
                torch._foreach_copy_(averaged, current)
                return
            d = decay * (1 - math.exp(-float(num_averaged) / tau))
            torch._foreach_lerp_(averaged, current, 1 - d)

        # Replaces the constant-decay per-tensor function EMAWeightAveraging set (AveragedModel prefers multi_avg_fn).
        self._kwargs["avg_fn"] = None
        self._kwargs["multi_avg_fn"] = ema


class LastCheckpoint(ModelCheckpoint):
    """Lightning's top-1 checkpoint without a monitor (``last.ckpt``), written at an epoch's end once ``every_s``
    seconds passed since the previous write or the start of training; 0 = every epoch.  The final epoch (the last
    of ``max_epochs``, or an early stop) is always written: with no validation run, it is the run's result."""

    def __init__(self, every_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.every_s = every_s
        self.clock: Callable[[], float] = time.monotonic
        self._written = self.clock()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._written = self.clock()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        final = trainer.should_stop or trainer.current_epoch + 1 >= (trainer.max_epochs or 0)
        # Rank 0's clock decides for all (as with Lightning's train_time_interval): ranks whose clocks differ would
        # otherwise part at the save's barrier and hang.
        if not final and self.every_s > 0 and not trainer.strategy.broadcast(
                self.clock() - self._written >= self.every_s):
            return
        super().on_train_epoch_end(trainer, pl_module)
        self._written = self.clock()


class FaultPoints(Callback):
    """``fault_point('train.epoch<N>')`` in the second batch of epoch N (0-based)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == 1:
            fault_point(f"train.epoch{trainer.current_epoch}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Temp file + fsync + rename for every checkpoint; ``last.ckpt`` rotates to ``last.prev.ckpt``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                fault_point("train.checkpoint", tmp)  # mid-save: written, not yet synced nor in place
                f.flush()
                os.fsync(f.fileno())
            if target.name == LAST and target.exists():
                os.replace(target, target.with_name(PREVIOUS))
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(target.parent)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        location = map_location if map_location is not None else torch.device("cpu")
        return super().load_checkpoint(path, map_location=location, weights_only=True)  # type: ignore[arg-type]
