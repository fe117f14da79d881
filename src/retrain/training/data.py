"""The master dataset as ultralytics datasets, in a ``LightningDataModule``.

Labels come from ``data/master/annotations.json`` in memory: ultralytics never scans label files, so it
writes no ``labels.cache`` and repairs no JPEG next to the DVC-tracked batches.  Its disk image cache
(``.npy`` files) is redirected to the workspace's ``.cache/images``, keyed by each image's sha256.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Sampler
from ultralytics.cfg import get_cfg
from ultralytics.data.dataset import YOLODataset

from retrain.config import TrainParams
from retrain.errors import RetrainError, ValidationFailed
from retrain.training.trainer import on_cuda
from retrain.validation.images import UnsafePath, safe_member

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Master:
    """The master dataset as training reads it.

    Attributes:
        doc: The master COCO document.
        names: Class names, in class-index order (sorted by category id).
        category_ids: COCO category id of each class index.
        version: sha256 of ``annotations.json``: it names every image by content, so it fixes the data.
        data_root: The folder image file names are relative to.
    """

    doc: dict[str, Any]
    names: tuple[str, ...]
    category_ids: tuple[int, ...]
    version: str
    data_root: Path

    def images(self, split: str) -> list[dict[str, Any]]:
        """The images of one split."""
        return [im for im in self.doc["images"] if im.get("split") == split]


def load_master(master_dir: Path, data_root: Path) -> Master:
    """Read the master written by ``retrain merge``.

    Raises:
        RetrainError: There is no master, or it has no train or no val images.
    """
    ann = master_dir / "annotations.json"
    if not ann.is_file():
        raise RetrainError(f"{ann}: no master dataset; run 'retrain merge' (or 'dvc repro') first")
    raw = ann.read_bytes()
    doc = orjson.loads(raw)
    cats = sorted(doc["categories"], key=lambda c: c["id"])
    master = Master(doc, tuple(c["name"] for c in cats), tuple(c["id"] for c in cats),
                    hashlib.sha256(raw).hexdigest(), data_root.resolve())
    for split in ("train", "val"):
        if not master.images(split):
            raise RetrainError(f"{ann}: the master has no {split} images; ingest more data before training")
    return master


def verify_images(master: Master, max_shown: int = 5) -> int:
    """Re-hash every image of the master and compare it with the sha256 recorded when its batch was ingested.

    What training reads is then exactly what was ingested, validated and versioned: a flipped byte in a file (or
    in the DVC cache object a link type shares with it) stops the run instead of training on it.

    Returns:
        The number of images checked.

    Raises:
        RetrainError: One line per damaged or missing image (the first ``max_shown``), then what to do.
    """
    bad: list[str] = []
    for im in master.doc["images"]:
        path = master.data_root / im["file_name"]
        try:
            with path.open("rb") as f:
                got = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            bad.append(f"{im['file_name']}: [image-sha256] cannot be read ({e.strerror or e})")
            continue
        if got != im["sha256"]:
            bad.append(f"{im['file_name']}: [image-sha256] sha256 {got[:12]}..., ingested {im['sha256'][:12]}...: "
                       "the file (or the DVC cache object linked to it) is damaged")
    if bad:
        lines = bad[:max_shown]
        if len(bad) > max_shown:
            lines.append(f"... and {len(bad) - max_shown} more damaged image(s)")
        raise ValidationFailed([*lines, f"{len(bad)} of {len(master.doc['images'])} images differ from what was "
                                "ingested; nothing was trained. Restore them from the DVC remote (delete the "
                                "damaged files and their cache objects, then 'dvc pull --force')"])
    return len(master.doc["images"])


def _labels(master: Master, images: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
#: MLflow's client, threads' arenas, activations).  Measured 0.6-0.9 GiB for yolo11n at imgsz 64-320 on CPU.
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
    """ultralytics' hyperparameter namespace: its defaults, our augmentations and image size."""
    aug = params.augment.model_dump()
    aug.pop("close_mosaic")
    return get_cfg(overrides={**aug, "imgsz": params.imgsz, "close_mosaic": params.augment.close_mosaic,
                              "batch": params.batch, "plots": False})


class EpochSampler(Sampler[tuple[int, int, int]]):
    """Keys ``(index, epoch, rank)`` for one process, shuffled from ``(seed, epoch)``; ``set_epoch`` starts the epoch.

    Lightning calls ``set_epoch`` on the train sampler before every epoch, including the first one after a resume
    (where it skips ``on_train_epoch_start``).  The epoch travels with each key to ``MasterDataset``, which starts
    the epoch in whichever process makes the item (loader workers are persistent: forking new ones every epoch
    from a trainer holding gigabytes costs a copy-on-write fault on every page it touches next, which on this
    project's machines doubled the time of a training step).  Under DDP each rank takes every ``world``-th index
    of the same permutation, padded to equal length.
    """

    def __init__(self, n: int, seed: int, shuffle: bool, on_epoch: Any = None, rank: int = 0, world: int = 1) -> None:
        self.n, self.seed, self.shuffle, self.on_epoch = n, seed, shuffle, on_epoch
        self.rank, self.world, self.epoch = rank, world, 0
        self.per_rank = -(-n // world)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        pl.seed_everything(self.seed * 1000 + epoch, workers=True, verbose=False)  # this process's own RNGs
        if self.on_epoch is not None:
            self.on_epoch(epoch)

    def __iter__(self) -> Any:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        order += order[: self.per_rank * self.world - self.n]  # pad, as DistributedSampler does
        return iter([(i, self.epoch, self.rank) for i in order[self.rank::self.world]])

    def __len__(self) -> int:
        return self.per_rank


def loader_workers(params: TrainParams) -> int:
    """Dataloader processes: ``params.workers``, or for ``auto`` none on a CPU and min(8, cores) with a GPU.

    On a CPU the training step is compute-bound (loading and augmenting a batch of the sample data took 3% of a
    step), so a loader process only takes cores from the step; with a GPU the loaders keep it fed.
    """
    if params.workers != "auto":
        return params.workers
    return min(8, len(os.sched_getaffinity(0))) if on_cuda(params) else 0


class MasterDataModule(pl.LightningDataModule):
    """Train and val loaders over the whole master (every batch, old and new)."""

    def __init__(self, master: Master, params: TrainParams, cache_dir: Path) -> None:
        super().__init__()
        params = params.model_copy(update={"workers": loader_workers(params)})
        self.master, self.params, self.cache_dir = master, params, cache_dir
        self.hyp = hyperparameters(params)
        self.train_set: MasterDataset | None = None
        self.val_set: MasterDataset | None = None
        self.val_image_ids: dict[str, int] = {}

    def _dataset(self, split: str, augment: bool, cache: str) -> MasterDataset:
        images = self.master.images(split)
        close = self.params.augment.close_mosaic
        return MasterDataset(_labels(self.master, images), [im["sha256"] for im in images], self.cache_dir / "images",
                             seed=self.params.seed, close_from=self.params.epochs - close if close else None,
                             data={"names": dict(enumerate(self.master.names)), "channels": 3}, task="detect",
                             imgsz=self.params.imgsz, cache=None if cache == "none" else cache, augment=augment,
                             hyp=copy(self.hyp), prefix=f"{split}: ", rect=False, batch_size=self.params.batch,
                             stride=32, pad=0.0 if augment else 0.5)

    def setup(self, stage: str) -> None:
        """``fit``: train and val sets; ``validate``: the val set only (``retrain evaluate``)."""
        if self.val_set is not None and (self.train_set is not None or stage == "validate"):
            return
        images = self.master.doc["images"] if stage == "fit" else self.master.images("val")
        cache = choose_cache(self.params.cache, images, self.params.imgsz, int(self.params.workers))
        if stage == "fit":
            self.train_set = self._dataset("train", True, cache)
        self.val_set = self._dataset("val", False, cache)
        self.val_image_ids = {lb["im_file"]: im["id"] for lb, im in
                              zip(self.val_set.labels, self.master.images("val"), strict=True)}

    def _loader(self, ds: MasterDataset | None, train: bool, shard: bool = True) -> DataLoader[Any]:
        assert ds is not None, "setup() first"
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None and shard else (0, 1)
        sampler = EpochSampler(len(ds), self.params.seed, shuffle=train,
                               on_epoch=self.log_epoch if train else None, rank=rank, world=world)
        if world > 1 and train:
            log.info("rank %d of %d reads %d of the %d training images an epoch (every %d-th of the epoch's order)",
                     rank, world, len(sampler), len(ds), world)
        workers = int(self.params.workers)
        return DataLoader(ds, batch_size=self.params.batch, sampler=sampler, num_workers=workers,
                          persistent_workers=workers > 0, collate_fn=YOLODataset.collate_fn, pin_memory=False,
                          drop_last=False)

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
