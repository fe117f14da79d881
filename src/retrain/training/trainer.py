"""``build_trainer()``: the Lightning ``Trainer`` of a run, assembled from params and callbacks."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

from retrain.config import TrainParams
from retrain.training.callbacks import LAST, AtomicCheckpointIO, FaultPoints, WarmupEMA

log = logging.getLogger(__name__)

MONITOR = "val/mAP50-95"


def cpu_threads(params: TrainParams) -> int:
    """Threads for torch: ``params.threads``, else the cores this process may run on."""
    return params.threads or len(os.sched_getaffinity(0))


def resolve_precision(params: TrainParams) -> str:
    """``auto``: bf16-mixed on a CUDA GPU that supports it, else 32-true."""
    if params.precision != "auto":
        return params.precision
    on_gpu = params.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"


def use_channels_last(params: TrainParams) -> bool:
    """``auto``: channels_last on CUDA (faster convolutions there), not on CPU."""
    if params.channels_last != "auto":
        return params.channels_last == "on"
    return params.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def build_trainer(params: TrainParams, checkpoint_dir: Path, loggers: list[Any], extra: list[Any] | None = None
                  ) -> pl.Trainer:
    """The Trainer: EMA, last and best checkpoints, early stopping, LR monitor, fault points.

    Args:
        params: The ``train`` section.
        checkpoint_dir: Where ``last.ckpt`` / ``best.ckpt`` go (outside any DVC output, so resume survives).
        loggers: Lightning loggers (MLflow, CSV).
        extra: More callbacks (progress reporting, for instance).

    Returns:
        The configured Trainer.
    """
    # "last" as a top-1 checkpoint without a monitor: Lightning writes ``save_last`` only in epochs where a
    # top-k checkpoint was saved too, which with save_top_k=0 is never.
    last = ModelCheckpoint(dirpath=checkpoint_dir, filename=Path(LAST).stem, monitor=None, save_top_k=1,
                           every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False)
    best = ModelCheckpoint(dirpath=checkpoint_dir, filename="best", monitor=MONITOR, mode="max", save_top_k=1,
                           auto_insert_metric_name=False, enable_version_counter=False,
                           save_on_train_epoch_end=False)  # after each validation, which may skip epochs
    callbacks: list[Any] = [
        WarmupEMA(params.ema_decay, params.ema_tau), last, best,
        EarlyStopping(monitor=MONITOR, mode="max", patience=params.patience, check_on_train_epoch_end=False),
        FaultPoints(),
        *(extra or []),
    ]
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="epoch"))
    return pl.Trainer(
        accelerator=params.accelerator, devices=params.devices, strategy=params.strategy, num_nodes=params.num_nodes,
        precision=resolve_precision(params),  # type: ignore[arg-type]
        max_epochs=params.epochs, check_val_every_n_epoch=params.eval_interval,
        accumulate_grad_batches=params.accumulate, gradient_clip_val=params.grad_clip or None,
        callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()],
        default_root_dir=str(checkpoint_dir), log_every_n_steps=1, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # MasterDataModule shards by rank itself (EpochSampler)
        deterministic=False, benchmark=False, enable_model_summary=False,
    )
