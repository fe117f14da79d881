"""The master's images as ultralytics datasets: letterbox, augmentations, mosaic, and the image cache.

Labels come from ``data/master/annotations.json`` in memory: ultralytics never scans label files, so it
writes no ``labels.cache`` and repairs no JPEG next to the DVC-tracked batches.  Its disk image cache
(``.npy`` files) is redirected to the workspace's ``.cache/images``, keyed by each image's sha256.  Training
(``training/datamodule.py``) and prediction on a split (``detector/predict.py``) read the master through these.
"""

from __future__ import annotations

import logging
import os
import random
from copy import copy
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Sampler
from ultralytics.cfg import get_cfg
from ultralytics.data.dataset import YOLODataset

from retrain.config import RuntimeParams, TrainParams
from retrain.data.master import Master
from retrain.data.replay import ReplayPlan
from retrain.device import on_cuda
from retrain.errors import RetrainError
from retrain.safety import UnsafePath, safe_member

log = logging.getLogger(__name__)


def labels_for(master: Master, images: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ultralytics label dicts (normalised xywh, class index) for ``images``."""
    index = {c: i for i, c in enumerate(master.category_ids)}
    by_image: dict[int, list[dict[str, Any]]] = {}
    for a in master.doc["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    out: list[dict[str, Any]] = []
    for im in images:
        try:
            path = safe_member(master.data_root, master.data_root, im["file_name"])
        except UnsafePath as e:
            raise RetrainError(f"master: {im['file_name']}: [path-inside-root] {e}") from e
        w, h = float(im["width"]), float(im["height"])
        anns = by_image.get(im["id"], [])
        xywh = np.array([[(x + bw / 2) / w, (y + bh / 2) / h, bw / w, bh / h] for x, y, bw, bh in
                         (a["bbox"] for a in anns)], dtype=np.float32).reshape(-1, 4)
        cls = np.array([[index[a["category_id"]]] for a in anns], dtype=np.float32).reshape(-1, 1)
        out.append({"im_file": str(path), "shape": (int(h), int(w)), "cls": cls, "bboxes": xywh.clip(0, 1),
                    "segments": [], "keypoints": None, "normalized": True, "bbox_format": "xywh"})
    return out


class MasterDataset(YOLODataset):
    """ultralytics' ``YOLODataset`` (letterbox, augmentations, mosaic) over label dicts given in memory.

    Items are asked for as ``(index, epoch, rank)`` (``EpochSampler`` yields them), so the epoch starts where the
    item is made: in the persistent loader process that holds this copy of the dataset, or in the main process
    with no workers.  Starting an epoch reseeds ``random``/``numpy``/``torch`` from (seed, epoch, rank, worker),
    forgets the mosaic buffer and, for the last ``close_mosaic`` epochs, turns mosaic off.  What an epoch draws
    then depends on nothing before it: a run resumed at epoch N draws exactly what an unbroken run draws.
    """

    def __init__(self, labels: list[dict[str, Any]], shas: list[str], npy_dir: Path, seed: int = 0,
                 close_from: int | None = None, **kwargs: Any) -> None:
        self._given = labels
        self._npy = [npy_dir / f"{s}.npy" for s in shas]
        super().__init__(img_path=[lb["im_file"] for lb in labels], **kwargs)
        self.npy_files = self._npy  # never next to the data, in any cache mode
        self.seed, self.close_from, self.closing_hyp = seed, close_from, copy(kwargs["hyp"])
        self.epoch: int | None = None
        self.mosaic_closed = False

    def __getitem__(self, key: Any) -> Any:
        index, epoch, rank = key if isinstance(key, tuple) else (key, None, 0)
        if epoch is not None and epoch != self.epoch:
            self.start_epoch(epoch, rank)
        return super().__getitem__(index)

    def start_epoch(self, epoch: int, rank: int = 0) -> None:
        """Reseed, forget the previous epoch's mosaic buffer, and close mosaic for the last epochs."""
        self.epoch = epoch
        info = torch.utils.data.get_worker_info()
        stream = ((self.seed * 1000 + epoch) * 1000 + rank) * 1000 + (info.id if info is not None else 0)
        random.seed(stream)
        np.random.seed(stream % 2**32)
        torch.manual_seed(stream)
        for j in self.buffer:  # mosaic draws partners from recently loaded images: not from another epoch's
            if self.cache != "ram":
                self.ims[j] = None
        self.buffer.clear()
        if self.augment and self.close_from is not None and epoch >= self.close_from and not self.mosaic_closed:
            self.close_mosaic(hyp=copy(self.closing_hyp))
            self.mosaic_closed = True

    def load_image(self, i: int, *args: Any, **kwargs: Any) -> Any:
        """ultralytics' loader, with an unreadable image as one clear line (validation should have caught it)."""
        try:
            return super().load_image(i, *args, **kwargs)
        except FileNotFoundError as e:
            raise RetrainError(f"master: {self.im_files[i]}: [image-decodes] cannot be read for training; "
                               "run 'retrain validate' (dvc repro runs it before train)") from e

    def get_img_files(self, img_path: str | list[str]) -> list[str]:
        return list(img_path)

    def get_labels(self) -> list[dict[str, Any]]:
        return [dict(lb) for lb in self._given]

    def check_cache_disk(self, safety_margin: float = 0.1) -> bool:
        self.npy_files = self._npy
        self._npy[0].parent.mkdir(parents=True, exist_ok=True)
        return bool(super().check_cache_disk(safety_margin))


def _memory_headroom() -> tuple[int, str]:
    """Bytes this process can still allocate, and where that figure came from (for the log).

    psutil's available memory, or less when the address space is capped (``RLIMIT_AS``: ``prlimit --as``,
    ``ulimit -v``), which available memory does not show: the cap's soft limit minus what the process has mapped
    already (its VMS).
    """
    avail = psutil.virtual_memory().available
    what = f"available memory {avail / 2**20:.1f} MiB"
    if not hasattr(psutil, "RLIMIT_AS"):  # psutil has rlimits on Linux and FreeBSD only
        return avail, what
    soft = psutil.Process().rlimit(psutil.RLIMIT_AS)[0]
    if soft == psutil.RLIM_INFINITY:
        return avail, what
    vms = psutil.Process().memory_info().vms
    left = max(0, soft - vms)
    if left >= avail:
        return avail, f"{what}; address-space limit {soft / 2**20:.1f} MiB leaves more"
    return left, (f"address-space limit (RLIMIT_AS) {soft / 2**20:.1f} MiB - {vms / 2**20:.1f} MiB mapped = "
                  f"{left / 2**20:.1f} MiB, below {what}")


#: Room left to training itself after the cache is chosen: what it maps later (optimizer state, EMA, loggers and
#: MLflow's client, threads' arenas, activations); what yolo11n took: ``bench/RESULTS.md``, "measured in development".
TRAINING_ROOM = 1 << 30


def choose_cache(mode: str, images: list[dict[str, Any]], imgsz: int, workers: int) -> str:
    """The image cache mode: RAM only when the decoded, resized images fit three times over in the memory headroom,
    with ``TRAINING_ROOM`` to spare for training itself.

    The headroom is psutil's available memory or, when the address space is capped (``RLIMIT_AS``), the cap less
    what this process has mapped already, whichever is smaller.  When RAM does not fit the choice is ``disk``; the
    dataset itself then drops to no cache when ultralytics' disk check finds too little space
    (``MasterDataset.check_cache_disk``).

    Args:
        mode: ``auto``, ``ram``, ``disk`` or ``none`` (from params).
        images: The images to cache (with ``width``/``height``).
        imgsz: Training size (images are cached resized to it).
        workers: Dataloader processes (each may copy pages of the cache).

    Returns:
        ``ram``, ``disk`` or ``none``: ``disk`` and ``none`` as asked; ``auto`` logged with the figures; ``ram``
        as asked when it fits, else ``disk`` with a warning (a RAM cache that does not fit fails the run midway
        with ``MemoryError``).
    """
    if mode not in ("auto", "ram"):
        return mode
    need = 0
    for im in images:
        r = imgsz / max(im["width"], im["height"]) if max(im["width"], im["height"]) else 1.0  # up or down, as
        need += int(im["width"] * r) * int(im["height"] * r) * 3  # ultralytics' load_image resizes them
    headroom, what = _memory_headroom()
    choice = "ram" if 3 * need + TRAINING_ROOM <= headroom else "disk"
    figures = (f"decoded images {need / 2**20:.1f} MiB, x3 + {TRAINING_ROOM / 2**20:.0f} MiB for training = "
               f"{(3 * need + TRAINING_ROOM) / 2**20:.1f} MiB; headroom {headroom / 2**20:.1f} MiB: {what}; "
               f"{workers} workers")
    if mode == "ram" and choice == "disk":
        log.warning("image cache: disk, not the ram asked for: the images do not fit (%s)", figures)
    elif mode == "auto":
        log.info("image cache: %s (%s)", choice, figures)
    return choice


def hyperparameters(params: TrainParams) -> Any:
    """ultralytics' hyperparameter namespace: its defaults, our augmentations and image size.

    ``deterministic`` is off: it is ultralytics' trainer's switch (``torch.use_deterministic_algorithms``), which
    Lightning's loop never reads; in a dataset it only warns that a RAM cache "may produce non-deterministic
    training results", which is not so here (every epoch draws from (seed, epoch) alone, ``MasterDataset``; the
    kill test resumes to the unbroken run's losses).
    """
    aug = params.augment.model_dump()
    aug.pop("close_mosaic")
    return get_cfg(overrides={**aug, "imgsz": params.imgsz, "close_mosaic": params.augment.close_mosaic,
                              "batch": params.batch, "plots": False, "deterministic": False})


class EpochSampler(Sampler[tuple[int, int, int]]):
    """Keys ``(index, epoch, rank)`` for one process, shuffled from ``(seed, epoch)``; ``set_epoch`` starts the epoch.

    Lightning calls ``set_epoch`` on the train sampler before every epoch, including the first one after a resume
    (where it skips ``on_train_epoch_start``).  The epoch travels with each key to ``MasterDataset``, which starts
    the epoch in whichever process makes the item (loader workers are persistent: forking new ones every epoch
    from a trainer holding gigabytes costs a copy-on-write fault on every page it touches next, which on this
    project's machines doubled the time of a training step).  Under DDP each rank takes every ``world``-th index
    of the same permutation, padded to equal length.  With a replay plan (``data.replay``) an epoch covers the
    plan's draw for (seed, epoch), not every index.
    """

    def __init__(self, n: int, seed: int, shuffle: bool, on_epoch: Any = None, rank: int = 0, world: int = 1,
                 replay: ReplayPlan | None = None) -> None:
        self.n = replay.size if replay is not None else n
        self.seed, self.shuffle, self.on_epoch, self.replay = seed, shuffle, on_epoch, replay
        self.rank, self.world, self.epoch = rank, world, 0
        self.per_rank = -(-self.n // world)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        import pytorch_lightning as pl  # here: evaluate and audit load images without Lightning (seconds to import)

        pl.seed_everything(self.seed * 1000 + epoch, workers=True, verbose=False)  # this process's own RNGs
        if self.on_epoch is not None:
            self.on_epoch(epoch)

    def __iter__(self) -> Any:
        items = self.replay.draw(self.seed, self.epoch) if self.replay is not None else list(range(self.n))
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
            order = [items[j] for j in torch.randperm(self.n, generator=g).tolist()]
        else:
            order = items
        order += order[: self.per_rank * self.world - self.n]  # pad, as DistributedSampler does
        return iter([(i, self.epoch, self.rank) for i in order[self.rank::self.world]])

    def __len__(self) -> int:
        return self.per_rank


def loader_workers(runtime: RuntimeParams, train: TrainParams) -> int:
    """Dataloader processes: ``runtime.workers``, or for ``auto`` none on a CPU and min(8, cores) with a GPU.

    On a CPU the training step is compute-bound (loading and augmenting a batch is a few percent of a step:
    ``bench/RESULTS.md``), so a loader process only takes cores from the step; with a GPU the loaders keep it fed.
    """
    if runtime.workers != "auto":
        return runtime.workers
    return min(8, len(os.sched_getaffinity(0))) if on_cuda(train) else 0


class SplitReader:
    """Datasets and loaders over the master's splits, as training and prediction read them.

    Args:
        master: The master dataset.
        params: The ``train`` section (image size, batch, seed, augmentations, epochs for closing mosaic).
        runtime: The ``runtime`` section (loader processes, image cache).
        cache_dir: The workspace's cache folder (decoded images go to its ``images/``).
    """

    def __init__(self, master: Master, params: TrainParams, runtime: RuntimeParams, cache_dir: Path) -> None:
        self.master, self.params, self.cache_dir = master, params, cache_dir
        self.workers = loader_workers(runtime, params)
        self.cache_mode = runtime.cache
        self.hyp = hyperparameters(params)

    def cache_for(self, splits: tuple[str, ...]) -> str:
        """The image cache mode for reading ``splits`` (``choose_cache`` over their images)."""
        images = [im for s in splits for im in self.master.images(s)]
        return choose_cache(self.cache_mode, images, self.params.imgsz, self.workers)

    def dataset(self, split: str, augment: bool, cache: str) -> MasterDataset:
        """One split as an ultralytics dataset (augmented for training, letterboxed only otherwise)."""
        images = self.master.images(split)
        p, close = self.params, self.params.augment.close_mosaic
        return MasterDataset(labels_for(self.master, images), [im["sha256"] for im in images],
                             self.cache_dir / "images", seed=p.seed, close_from=p.epochs - close if close else None,
                             data={"names": dict(enumerate(self.master.names)), "channels": 3}, task="detect",
                             imgsz=p.imgsz, cache=None if cache == "none" else cache, augment=augment,
                             hyp=copy(self.hyp), prefix=f"{split}: ", rect=False, batch_size=p.batch,
                             stride=32, pad=0.0 if augment else 0.5)

    def loader(self, ds: MasterDataset, train: bool, rank: int = 0, world: int = 1, on_epoch: Any = None,
               replay: ReplayPlan | None = None) -> DataLoader[Any]:
        """Batches of ``ds``: shuffled per (seed, epoch) for training, in order otherwise; ``rank``'s shard; with
        ``replay``, each epoch the plan's draw."""
        sampler = EpochSampler(len(ds), self.params.seed, shuffle=train, on_epoch=on_epoch, rank=rank, world=world,
                               replay=replay)
        if world > 1 and train:
            log.info("rank %d of %d reads %d of the %d training images an epoch (every %d-th of the epoch's order)",
                     rank, world, len(sampler), sampler.n, world)
        return DataLoader(ds, batch_size=self.params.batch, sampler=sampler, num_workers=self.workers,
                          persistent_workers=self.workers > 0, collate_fn=YOLODataset.collate_fn, pin_memory=False,
                          drop_last=False)

    def image_ids(self, ds: MasterDataset, split: str) -> dict[str, int]:
        """Image file as the loader names it -> the master's COCO image id."""
        return {lb["im_file"]: im["id"] for lb, im in zip(ds.labels, self.master.images(split), strict=True)}
