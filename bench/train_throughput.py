"""Training throughput and accuracy of `retrain train` against ultralytics' own trainer, in one run.

Same data (the sample batches, merged; exported to ultralytics' YOLO layout for the peer), same model
(yolo11n.yaml from scratch), imgsz, batch, epochs, optimizer, schedule and augmentations. The peer runs with
its thread count set to this machine's cores (`ultralytics.utils.torch_utils.NUM_THREADS`; its default is
cores - 1, capped at 8, which on 2 cores is 1 thread and no fair peer) and with its gradient accumulation off
(`nbs` = batch), as ours.

Each trainer runs in a process of its own, as its users run it: ours as `retrain train` runs (its process
tuning: glibc's huge-page tunable, set by re-executing, and `mallopt`), the peer as `yolo train` runs. A
third run gives the peer the same process tuning, so the table also says how much of the lead is that tuning.
A fourth runs ours again in the same workspace, as next week's run on this machine would: it finds the first
run's measurements and compiled artefacts (`runtime.compile: auto`) in the workspace's cache.

Ours runs with the defaults' `precision: auto` and `compile: auto`; the table says what each chose on this CPU and
the seconds spent compiling (outside the epoch times; a row spreads them over the run).

- training images/s: train-loop time only (validation excluded), epochs after the first (warm-up excluded);
- the machine's limit: measured float32 matmul GFLOP/s divided by 3x the model's forward FLOPs per image
  (forward + backward ~ 3x forward), counted by torch's FlopCounterMode. The matmul is measured twice, as
  `a @ b` (MKL) and as the same product written as a 1x1 convolution (oneDNN, which runs the model's
  convolutions), and the faster sets the limit: on AMD CPUs MKL takes its AVX2 path while oneDNN uses
  AVX-512, so `a @ b` alone understates the machine 1.5-2x there (measured: 213 vs 330 GFLOP/s on 2 cores);
- mAP50-95 / mAP50 of both after the same epochs, both scored by the same code (`retrain.evaluation`,
  pycocotools) on the same val images with the EMA weights each trainer keeps.

Writes a section into bench/RESULTS.md. Usage: python bench/train_throughput.py [--epochs N] [--imgsz N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ.setdefault("YOLO_OFFLINE", "true")
_CONFIG = tempfile.mkdtemp(prefix="ultralytics-config-")
os.environ["YOLO_CONFIG_DIR"] = _CONFIG  # its settings file (mlflow off below) never touches the user's

sys.path.insert(0, str(HERE))
from common import cpu_model, machine, sample_workspace, update_results_md  # noqa: E402


def export_yolo(ws: Path, out: Path) -> Path:
    """The master as ultralytics' YOLO layout (images linked, labels normalised cx cy w h): the peer's data."""
    from retrain.data.master import load_master

    master = load_master(ws / "data" / "master", ws / "data")
    index = {cid: i for i, cid in enumerate(master.category_ids)}
    boxes: dict[int, list[str]] = {}
    for a in master.doc["annotations"]:
        boxes.setdefault(a["image_id"], []).append(a)
    for split in ("train", "val"):
        (out / "images" / split).mkdir(parents=True)
        (out / "labels" / split).mkdir(parents=True)
        for im in master.images(split):
            src = master.data_root / im["file_name"]
            (out / "images" / split / f"{im['sha256']}{src.suffix}").symlink_to(src)
            lines = []
            for a in boxes.get(im["id"], []):
                x, y, w, h = a["bbox"]
                lines.append(f"{index[a['category_id']]} {(x + w / 2) / im['width']:.6f} "
                             f"{(y + h / 2) / im['height']:.6f} {w / im['width']:.6f} {h / im['height']:.6f}")
            (out / "labels" / split / f"{im['sha256']}.txt").write_text("\n".join(lines) + "\n")
    data = out / "data.yaml"
    data.write_text(json.dumps({"path": str(out), "train": "images/train", "val": "images/val",
                                "names": dict(enumerate(master.names))}))
    return data


class EpochTimer:
    """Seconds of each training epoch's loop (validation excluded)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def start(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def stop(self, *_: Any) -> None:
        self.seconds.append(time.perf_counter() - self._t0)


def ours(ws: Path, settings: dict[str, Any]) -> tuple[EpochTimer, dict[str, Any], int]:
    import pytorch_lightning as pl

    from retrain.config import load_params
    from retrain.data.master import load_master
    from retrain.paths import Paths
    from retrain.runner import run_log
    from retrain.training.train import train

    timer = EpochTimer()

    class Timer(pl.Callback):
        """Lightning validates inside the epoch, before ``on_train_epoch_end``: its time is taken out."""

        val = 0.0

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.val = 0.0
            timer.start()

        def on_validation_start(self, trainer: Any, module: Any) -> None:
            self.v0 = time.perf_counter()

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            self.val += time.perf_counter() - self.v0

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            timer.stop()
            timer.seconds[-1] -= self.val

    params = load_params(ws / "params.yaml")
    runtime = {k: settings.pop(k) for k in RUNTIME if k in settings}
    params = params.model_copy(update={"train": params.train.model_copy(update=settings),
                                       "runtime": params.runtime.model_copy(update=runtime)})
    result = train(Paths(ws), params, None, run_log(Paths(ws), params), callbacks=[Timer()])
    assert result is not None
    n_train = len(load_master(ws / "data" / "master", ws / "data").images("train"))
    report = result.report.to_json()
    return timer, {**report["ema"], "raw": report["raw"], "precision": report["precision"],
                   "compile": report["compile"]}, n_train


def peer(data: Path, ws: Path, out: Path, settings: dict[str, Any], threads: int) -> tuple[EpochTimer, dict[str, Any]]:
    import ultralytics.utils.torch_utils as tu
    from ultralytics import YOLO
    from ultralytics.utils import SETTINGS

    SETTINGS.update({k: False for k in ("mlflow", "tensorboard", "wandb", "clearml", "comet", "dvc", "neptune",
                                        "raytune") if k in SETTINGS})  # no integration writes runs anywhere
    tu.NUM_THREADS = threads  # select_device() calls torch.set_num_threads(NUM_THREADS) for CPU training
    timer = EpochTimer()
    model = YOLO("yolo11n.yaml")  # built from the yaml: no download
    model.add_callback("on_train_epoch_start", timer.start)
    model.add_callback("on_train_epoch_end", timer.stop)
    aug = settings["augment"]
    model.train(data=str(data), epochs=settings["epochs"], imgsz=settings["imgsz"], batch=settings["batch"],
                workers=0, device="cpu", optimizer="AdamW", lr0=settings["lr"], lrf=settings["lrf"],
                cos_lr=True, momentum=settings["momentum"], weight_decay=settings["weight_decay"],
                warmup_epochs=settings["warmup_epochs"], nbs=settings["batch"], cache="ram", seed=0,
                deterministic=False, amp=False, plots=False, val=True, project=str(out), name="peer",
                exist_ok=True, pretrained=False, verbose=False, close_mosaic=aug["close_mosaic"],
                **{k: v for k, v in aug.items() if k != "close_mosaic"})
    # Score the peer's best EMA weights with the same code that scores ours.
    from retrain.config import load_params
    from retrain.data.master import load_master
    from retrain.detector.files import load_model_file
    from retrain.detector.predict import Nms, predict_split
    from retrain.metrics.coco import ground_truth, score

    mf = load_model_file(Path(model.trainer.best))
    master = load_master(ws / "data" / "master", ws / "data")
    params = load_params(ws / "params.yaml")
    p = params.train.model_copy(update={k: v for k, v in settings.items() if k != "augment" and k not in RUNTIME})
    dets = predict_split(mf, master, "val", Nms(p.nms_conf, p.nms_iou, p.max_det), p.batch, p, params.runtime,
                         ws / ".cache")
    return timer, score(ground_truth(master.doc, "val"), dets).overall.to_json()


def matmul_gflops(threads: int, n: int = 2048, reps: int = 10, rounds: int = 5) -> dict[str, float]:
    """Float32 GFLOP/s of an n x n x n product, the best of `rounds`: as `a @ b` (MKL) and as a 1x1 convolution
    (oneDNN)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    x, w = torch.randn(1, n, 32, n // 32), torch.randn(n, n, 1, 1)  # n output channels at n positions

    def rate(product: Any) -> float:
        for _ in range(3):
            product()
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                product()
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 * reps / best / 1e9

    return {"matmul (MKL)": rate(lambda: a @ b), "1x1 convolution (oneDNN)": rate(lambda: F.conv2d(x, w))}


def forward_gflops(imgsz: int, classes: int) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from retrain.detector.model import build_model

    model = build_model("yolo11n.yaml", tuple(f"c{i}" for i in range(classes))).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, imgsz, imgsz))
    return counter.get_total_flops() / 1e9


ROLES = ("ours", "peer", "peer-tuned", "ours-again")
#: The settings that are params.yaml's ``runtime`` keys (the rest are ``train``'s).
RUNTIME = ("workers", "cache", "threads")


def role_main(role: str, root: Path, settings: dict[str, Any]) -> None:
    """One trainer in this process; its epoch seconds and scores go to ``root/<role>.json``."""
    from retrain.training import hugepages

    if role != "peer":
        hugepages.reexec("auto")  # what `retrain train` does first (glibc reads its tunables at exec)
    threads = int(settings["threads"])
    if role.startswith("ours"):
        from retrain.config import AugmentParams

        timer, metrics, n_train = ours(root / "ws", {**settings, "augment": AugmentParams(**settings["augment"])})
    else:
        if role == "peer-tuned":
            from retrain.training.trainer import keep_freed_memory

            keep_freed_memory()  # train() does this for ours
        timer, metrics = peer(root / "yolo" / "data.yaml", root / "ws", root / role, settings, threads)
        n_train = 0
    out = {"seconds": timer.seconds, "metrics": metrics, "n_train": n_train, "memory": hugepages.describe("auto")}
    (root / f"{role}.json").write_text(json.dumps(out))


def run_role(role: str, root: Path, settings: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # each role sets up its own process
    subprocess.run([sys.executable, __file__, "--role", role, "--root", str(root), "--settings", json.dumps(settings)],
                   env=env, check=True)
    return dict(json.loads((root / f"{role}.json").read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--imgsz", type=int, default=320)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--images-per-batch", type=int, default=80)
    ap.add_argument("--no-write", action="store_true", help="print, do not update RESULTS.md")
    ap.add_argument("--no-peer-tuned", action="store_true", help="leave out the context run (the peer with our "
                    "process tuning): a long run's time")
    ap.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)  # internal: one trainer's process
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        role_main(args.role, args.root, json.loads(args.settings))
        return
    threads = len(os.sched_getaffinity(0))
    root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    ws = sample_workspace(root, 2, args.images_per_batch)
    export_yolo(ws, root / "yolo")
    settings: dict[str, Any] = {
        "model": "yolo11n.yaml", "imgsz": args.imgsz, "epochs": args.epochs, "batch": args.batch, "workers": "auto",
        "cache": "ram", "use_champion": False, "threads": threads, "optimizer": "AdamW", "lr": 0.002, "lrf": 0.01,
        "momentum": 0.9, "weight_decay": 0.0005, "warmup_epochs": 1.0, "patience": 1000,
        "augment": {"hsv_h": 0.015, "hsv_s": 0.7, "hsv_v": 0.4, "degrees": 0.0, "translate": 0.1, "scale": 0.5,
                    "fliplr": 0.5, "flipud": 0.0, "mosaic": 1.0, "mixup": 0.0,
                    "close_mosaic": max(1, args.epochs // 4)},
    }
    runs = {role: run_role(role, root, settings) for role in ROLES
            if not (args.no_peer_tuned and role == "peer-tuned")}
    n_train = runs["ours"]["n_train"]
    m_ours, m_peer = runs["ours"]["metrics"], runs["peer"]["metrics"]
    formats = json.loads((ws / ".cache" / "memory-format.json").read_text())
    fmt = "channels_last" if any(formats.values()) else "NCHW"
    steady = slice(1, None)  # epoch 1 warms up (allocator, first loader start)
    ips = {role: n_train * len(r["seconds"][steady]) / sum(r["seconds"][steady]) for role, r in runs.items()}
    ips_ours, ips_peer = ips["ours"], ips["peer"]
    choice = {role: runs[role]["metrics"]["compile"] for role in ("ours", "ours-again")}
    spent = {role: c["compile_s"] or 0.0 for role, c in choice.items()}
    # The whole run's rate, the first epoch and the compile included (what a user waits for, validation aside).
    whole = {role: n_train * len(runs[role]["seconds"]) / (sum(runs[role]["seconds"]) + spent.get(role, 0.0))
             for role in runs}
    rates = matmul_gflops(threads)
    gflops = max(rates.values())
    fwd = forward_gflops(args.imgsz, 4)
    limit = gflops / (3 * fwd)
    rows = [
        ("training images/s: ours vs ultralytics' trainer (NUM_THREADS = cores), each in its own process",
         f"{ips_ours:.2f}", f"{ips_peer:.2f}", f"{ips_ours / ips_peer:.2f}"),
        ("training images/s: ours vs the machine's limit", f"{ips_ours:.2f}", f"{limit:.2f}",
         f"{ips_ours / limit:.2f}"),
        ("peer vs the machine's limit", f"{ips_peer:.2f}", f"{limit:.2f}", f"{ips_peer / limit:.2f}"),
        *([("context: ours vs the peer given retrain's process tuning (huge pages, mallopt)", f"{ips_ours:.2f}",
            f"{ips['peer-tuned']:.2f}", f"{ips_ours / ips['peer-tuned']:.2f}")] if "peer-tuned" in ips else []),
        ("whole run, every epoch and ours' compile seconds included: first run", f"{whole['ours']:.2f}",
         f"{whole['peer']:.2f}", f"{whole['ours'] / whole['peer']:.2f}"),
        ("whole run, the same: ours' second run in the same workspace (cached measurements and compiled graphs)",
         f"{whole['ours-again']:.2f}", f"{whole['peer']:.2f}", f"{whole['ours-again'] / whole['peer']:.2f}"),
        ("ours' second run: training images/s (epochs after the first), vs the peer", f"{ips['ours-again']:.2f}",
         f"{ips_peer:.2f}", f"{ips['ours-again'] / ips_peer:.2f}"),
        (f"val mAP50-95 after {args.epochs} epochs (EMA, pycocotools)", f"{m_ours['mAP50-95']:.4f}",
         f"{m_peer['mAP50-95']:.4f}", f"{m_ours['mAP50-95'] - m_peer['mAP50-95']:+.4f} (difference)"),
        (f"val mAP50 after {args.epochs} epochs", f"{m_ours['mAP50']:.4f}", f"{m_peer['mAP50']:.4f}",
         f"{m_ours['mAP50'] - m_peer['mAP50']:+.4f} (difference)"),
        ("ours: val mAP50-95 of the EMA weights vs the raw weights of the same checkpoint",
         f"{m_ours['mAP50-95']:.4f}", f"{m_ours['raw']['mAP50-95']:.4f}",
         f"{m_ours['mAP50-95'] - m_ours['raw']['mAP50-95']:+.4f} (difference)"),
    ]
    seconds = "; ".join(f"{role} {', '.join(f'{s:.1f}' for s in r['seconds'])}" for role, r in runs.items())
    chose = []
    for role, c in choice.items():
        spent_s = "" if c["compile_s"] is None else f" ({c['compile_s']} s compiling)"
        chose.append(f"{'First' if role == 'ours' else 'Second'} run of ours: precision "
                     f"{runs[role]['metrics']['precision']}; {c['reason']}{spent_s}.")
    lines = [
        f"## train_throughput: `retrain train` against ultralytics' own trainer ({cpu_model()}, {args.epochs} epochs)",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Command: `python bench/train_throughput.py "
        f"--epochs {args.epochs} --imgsz {args.imgsz} --batch {args.batch} --images-per-batch "
        f"{args.images_per_batch}{' --no-peer-tuned' if args.no_peer_tuned else ''}`.",
        "",
        f"Data: 2 sample batches, {n_train} train images, {m_ours['images']} val images; yolo11n.yaml from scratch, "
        f"imgsz {args.imgsz}, batch {args.batch}, {args.epochs} epochs, AdamW, cosine, mosaic, no loader processes "
        f"(ultralytics forces 0 on a CPU; ours: workers auto = 0 on a CPU), RAM cache, {threads} torch threads for "
        f"both; ours in {runs['ours']['metrics']['precision']} (precision auto), the peer in float32; ours in "
        f"{fmt} (channels_last auto: timed once by `retrain train` on this CPU), the peer in "
        "NCHW. Each trainer ran in a fresh process: ours as `retrain train` runs "
        f"({runs['ours']['memory'].removeprefix('memory: ')}; mallopt), the peer as `yolo train` runs "
        f"({runs['peer']['memory'].removeprefix('memory: ')})"
        + (f", and the peer again with ours' process tuning ({runs['peer-tuned']['memory'].removeprefix('memory: ')}"
           "; mallopt)" if "peer-tuned" in runs else " (the peer with ours' process tuning left out: --no-peer-tuned)")
        + f". Epoch seconds (train loop only, "
        f"the first epoch of each excluded): {seconds}. Machine limit: the faster float32 matmul ("
        + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
        + f" GFLOP/s) / (3 x {fwd:.2f} GFLOP forward per image).",
        "",
        " ".join(chose),
        "",
        "| what | ours | peer | ours / peer |",
        "|---|---:|---:|---:|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
        "",
        f"Targets (issue 24): >= 1.5x the peer ({'met' if ips_ours >= 1.5 * ips_peer else 'NOT met'}), >= 50% of "
        f"the limit ({'met' if ips_ours >= 0.5 * limit else 'NOT met'}), mAP50-95 within 0.01 of the peer or above "
        f"({'met' if m_ours['mAP50-95'] >= m_peer['mAP50-95'] - 0.01 else 'NOT met'}).",
        "",
    ]
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        update_results_md(section)


if __name__ == "__main__":
    main()
