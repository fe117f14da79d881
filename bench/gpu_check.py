"""A short check of the training task on a CUDA GPU: bf16-mixed training, throughput at imgsz 640, batch 64.

Run by ``bench/gpu_check.sh`` on a lent GPU machine (no MLflow, DVC or great-expectations needed there: the
master is built in memory from generated sample batches).  It trains ``--steps`` optimizer steps of yolo11n
from scratch with the project's own ``DetectorModule``, ``MasterDataModule`` and ``build_trainer()`` (EMA,
checkpoints, pycocotools validation at the end), and prints, as JSON: the precision Lightning used (``precision:
auto``'s choice), ``runtime.compile``'s choice and why (``training.compiled.choose``, as ``retrain train`` makes
it: ``--compile auto|on|off``), training images/s after the warm-up steps, peak GPU memory, the loss at the start
and the end, and val mAP50-95.

``--smoke`` runs the same code on the CPU at a tiny size: how this script is tested where there is no GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("YOLO_OFFLINE", "true")


def build_master(root: Path, images_per_batch: int) -> Any:
    """Two generated sample batches as a ``Master`` (every 5th image in val), without ingest or merge."""
    from retrain.data.master import Master
    from retrain.data.sample import generate

    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    cats: dict[str, int] = {}
    for b in generate(root, 2, images_per_batch, seed=0):
        doc = json.loads((b.path / "annotations.json").read_text())
        names = {c["id"]: c["name"] for c in doc["categories"]}
        ids: dict[int, int] = {}
        for im in doc["images"]:
            rel = (b.path / "images" / im["file_name"]).relative_to(root).as_posix()
            sha = hashlib.sha256((root / rel).read_bytes()).hexdigest()
            ids[im["id"]] = len(images) + 1
            images.append({**im, "id": ids[im["id"]], "file_name": rel, "sha256": sha,
                           "split": "val" if len(images) % 5 == 0 else "train", "batch": b.path.name})
        for a in doc["annotations"]:
            cid = cats.setdefault(names[a["category_id"]], len(cats) + 1)
            annotations.append({**a, "id": len(annotations) + 1, "image_id": ids[a["image_id"]], "category_id": cid})
    master_doc = {"images": images, "annotations": annotations,
                  "categories": [{"id": i, "name": n} for n, i in cats.items()]}
    version = hashlib.sha256(json.dumps(master_doc, sort_keys=True).encode()).hexdigest()
    return Master(master_doc, tuple(cats), tuple(cats.values()), version, root.resolve())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    ap.add_argument("--warmup-steps", type=int, default=30, help="steps left out of the throughput")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images-per-batch", type=int, default=800)
    ap.add_argument("--workers", type=int, default=min(12, len(os.sched_getaffinity(0))))
    ap.add_argument("--smoke", action="store_true", help="tiny run on the CPU (tests this script)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="runtime.compile")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup_steps, args.imgsz, args.batch, args.images_per_batch, args.workers = 6, 2, 96, 4, 10, 0

    import pytorch_lightning as pl
    import torch

    from retrain.config import RuntimeParams, TrainParams
    from retrain.detector.model import build_model
    from retrain.training.compiled import choose
    from retrain.training.datamodule import MasterDataModule
    from retrain.training.module import DetectorModule
    from retrain.training.trainer import build_trainer, cpu_flags, native_bf16, resolve_precision

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --smoke to test this script on the CPU)")
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.perf_counter()
    master = build_master(tmp / "data", args.images_per_batch)
    setup_s = time.perf_counter() - t0
    n_train = len(master.images("train"))
    steps_per_epoch = -(-n_train // args.batch)
    epochs = max(1, -(-args.steps // steps_per_epoch))
    runtime = RuntimeParams(workers=args.workers, cache="ram")
    params = TrainParams(imgsz=args.imgsz, batch=args.batch, epochs=epochs, eval_interval=epochs,
                         use_champion=False, accelerator="cpu" if args.smoke else "gpu", devices=1,
                         precision="auto", channels_last="auto", patience=1000,
                         augment={"close_mosaic": 0})  # type: ignore[arg-type]
    pl.seed_everything(0, verbose=False)
    model = build_model(params.model, master.names)
    dm = MasterDataModule(master, params, runtime, tmp / "cache")
    dm.setup("fit")
    from retrain.training.trainer import use_channels_last

    run_p = params.model_copy(update={"channels_last": "on" if use_channels_last(params) else "off"})
    module = DetectorModule(model, master, run_p)
    module.image_ids = dm.val_image_ids
    steps = len(dm.train_dataloader()) * epochs
    module.compiled_forward, compile_info = choose(tmp / "cache", args.compile, run_p, model, len(master.names),
                                                   run_p.channels_last == "on", steps)

    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    class Meter(pl.Callback):
        """Images/s from batch end to batch end after the warm-up steps (data loading in, validation out)."""

        def __init__(self) -> None:
            self.last: float | None = None
            self.images = 0
            self.seconds = 0.0
            self.losses: list[float] = []

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.last = None  # the gap across an epoch boundary holds validation and loader start-up

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            t = now()
            self.losses.append(float(outputs["loss"]) / batch["img"].shape[0])
            if self.last is not None and trainer.global_step > args.warmup_steps:
                self.seconds += t - self.last
                self.images += batch["img"].shape[0]
            self.last = t

    meter = Meter()
    trainer = build_trainer(params, tmp / "checkpoints", [], [meter])
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    fit_s = time.perf_counter() - t0
    m = module.last_metrics
    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "precision": str(trainer.precision), "resolved": resolve_precision(params),
        "channels_last": use_channels_last(params), "compile": compile_info,
        "cpu_native_bf16": native_bf16(cpu_flags()), "imgsz": args.imgsz, "batch": args.batch,
        "train_images": n_train, "steps": trainer.global_step, "epochs": trainer.current_epoch,
        "images_per_s": round(meter.images / meter.seconds, 1) if meter.seconds else None,
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20) if torch.cuda.is_available() else None,
        "loss_first": round(meter.losses[0], 4), "loss_last": round(meter.losses[-1], 4),
        "val_mAP50-95": None if m is None else round(m.map, 4), "val_mAP50": None if m is None else round(m.map50, 4),
        "data_s": round(setup_s, 1), "fit_s": round(fit_s, 1),
        "checkpoints": sorted(p.name for p in (tmp / "checkpoints").glob("*.ckpt")),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    ok = result["steps"] >= args.steps and bool(result["checkpoints"])
    # The GPU run must also learn, in bf16. The smoke's 8 tiny CPU steps say nothing about learning (one mosaic
    # batch's loss swings either way): it checks that the code runs end to end.
    if not args.smoke:
        ok = ok and result["loss_last"] < result["loss_first"] and result["precision"] == "bf16-mixed"
    sys.exit(0 if ok else "gpu_check: FAILED (see the figures above)")


if __name__ == "__main__":
    main()
