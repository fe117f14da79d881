"""The master dataset in a ``LightningDataModule``: train and val loaders over every batch, old and new.

A run warm-started from the champion trains each epoch on every image of the batches new to the champion and on a
replayed sample of the older ones (``data.replay``); val is always the whole master's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from torch.utils.data import DataLoader

from retrain.config import RuntimeParams, TrainParams
from retrain.data.loading import MasterDataset, SplitReader
from retrain.data.master import Master
from retrain.data.replay import ReplayPlan, plan

log = logging.getLogger(__name__)


class MasterDataModule(pl.LightningDataModule):
    """Train and val loaders over the whole master (every batch, old and new), sharded by rank under DDP.

    Args:
        master: The master.
        params: The ``train`` section, with the run's schedule (``train.warm`` applied to a warm start).
        runtime: The ``runtime`` section.
        cache_dir: The workspace's cache folder.
        known: The batches the champion trained on, when replay sampling applies (else ``None``: every epoch covers
            the whole train split).
    """

    def __init__(self, master: Master, params: TrainParams, runtime: RuntimeParams, cache_dir: Path,
                 known: list[str] | None = None) -> None:
        super().__init__()
        self.master, self.params, self.known = master, params, known
        self.replay: ReplayPlan | None = None
        self.reader = SplitReader(master, params, runtime, cache_dir)
        self.train_set: MasterDataset | None = None
        self.val_set: MasterDataset | None = None
        self.val_image_ids: dict[str, int] = {}

    def setup(self, stage: str) -> None:
        """``fit``: the train and val sets."""
        if self.train_set is not None:
            return
        cache = self.reader.cache_for(("train", "val"))
        self.train_set = self.reader.dataset("train", True, cache)
        self.val_set = self.reader.dataset("val", False, cache)
        self.val_image_ids = self.reader.image_ids(self.val_set, "val")
        if self.known is not None and self.params.replay is not False:
            origin = [str(im.get("batch")) for im in self.master.images("train")]
            self.replay = plan(origin, self.train_set.labels, self.known, self.params.replay, self.params.seed,
                               self.params.epochs)
            log.info(self.replay.describe())

    def _loader(self, ds: MasterDataset | None, train: bool, shard: bool = True) -> DataLoader[Any]:
        assert ds is not None, "setup() first"
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None and shard else (0, 1)
        return self.reader.loader(ds, train, rank, world, self.log_epoch if train else None,
                                  self.replay if train else None)

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.train_set, True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, False)

    def eval_dataloader(self) -> DataLoader[Any]:
        """Every val image in one process (scoring after the fit), whatever the world size."""
        return self._loader(self.val_set, False, shard=False)

    def log_epoch(self, epoch: int) -> None:
        """Say when mosaic turns off (the loader processes turn it off, see ``MasterDataset.start_epoch``)."""
        close = self.params.augment.close_mosaic
        if close and epoch == max(0, self.params.epochs - close):
            log.info("epoch %d: mosaic off for the last %d epochs", epoch + 1, close)
