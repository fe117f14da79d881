"""How well the audit finds planted label errors in a new batch, and what it costs.

A champion is trained and promoted through the real stages on clean data it then never sees again.  A new batch of
the same kind of images arrives twice: once clean, once with errors planted box by box (``--drop`` of the boxes
removed, ``--relabel`` given another class of the batch, ``--shift`` moved by half their size).  Each is ingested,
merged and validated in a copy of the champion's workspace, and ``retrain audit``'s code runs on it, once per
``--confident`` level.  Reported per level: the precision and recall of the flagged images against the images
with a planted error (overall and per kind of error, and whether the flag named the planted kind), the share of
the clean batch's images flagged, and the audit's time (prediction and cleanlab).

Data: ``sample`` (the generated shapes; the champion trains on batches 1 and 2, the new batch is drawn like batch
2 with another seed) or ``coco128`` (real photos from ../shared/data: the champion trains on 96 of them, the new
batch is the other 32).

Writes a section into bench/RESULTS.md.  Usage:
    python bench/audit_quality.py [--data sample|coco128] [--images 80] [--new 60] [--epochs 60] [--imgsz 192]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ.setdefault("YOLO_OFFLINE", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import machine, update_results_md  # noqa: E402

from retrain import runner  # noqa: E402
from retrain.audit.audit import audit_batches  # noqa: E402
from retrain.config import Params, load_params  # noqa: E402
from retrain.data.sample import KINDS, generate, generate_batch, plant_errors  # noqa: E402
from retrain.evaluation.report import EvalReport  # noqa: E402
from retrain.paths import Paths  # noqa: E402
from retrain.workspace import init_workspace, set_params  # noqa: E402

SHARED = HERE.parent.parent / "shared" / "data"


def _params(paths: Paths) -> Params:
    return load_params(paths.root / "params.yaml")


def _coco128_split(out: Path, n_new: int) -> tuple[list[Path], Path]:
    """coco128 (COCO JSON) as a training batch of the first images and a new batch of the last ``n_new``."""
    src = SHARED / "coco128-coco"
    doc = json.loads((src / "annotations" / "instances_train2017.json").read_text())
    images = sorted(doc["images"], key=lambda im: im["file_name"])
    parts = {"coco128-a": images[:-n_new], "coco128-new": images[-n_new:]}
    made = {}
    for name, ims in parts.items():
        ids = {im["id"] for im in ims}
        (out / name / "images").mkdir(parents=True)
        for im in ims:
            shutil.copy2(src / "train2017" / im["file_name"], out / name / "images" / im["file_name"])
        sub = {"images": ims, "categories": doc["categories"],
               "annotations": [a for a in doc["annotations"] if a["image_id"] in ids and not a.get("iscrowd")]}
        (out / name / "annotations.json").write_text(json.dumps(sub))
        made[name] = out / name
    return [made["coco128-a"]], made["coco128-new"]


def _champion(base: Path, batches: list[Path], train: dict[str, Any]) -> Paths:
    """A workspace whose registry's champion trained on ``batches`` (through the real stages)."""
    paths = init_workspace(base / "ws", remote=str(base / "remote"))
    set_params(paths, {**{f"train.{k}": v for k, v in train.items()}, "runtime.workers": 0, "runtime.cache": "ram",
                       "evaluate.bootstrap": 20, "promote.min_map": 0.0, "validate.instances_level": "warn",
                       "validate.val_fraction_level": "warn", "validate.drift_level": "warn"})
    for b in batches:
        runner.run_ingest(paths, _params(paths), b, None, "auto")
    for step in (runner.run_merge, runner.run_validate, runner.run_audit, runner.run_train, runner.run_evaluate,
                 runner.run_promote):
        for line in step(paths, _params(paths)):
            print(line, flush=True)
    return paths


def _audit(ws: Paths, dst: Path, batch: Path, levels: list[float]) -> tuple[list[dict[str, Any]], int]:
    """The champion's workspace copied, ``batch`` ingested as batch-new and audited at each confident level."""
    shutil.copytree(ws.root, dst, symlinks=True)
    paths = Paths(dst)
    runner.run_ingest(paths, _params(paths), batch, "batch-new", "auto")
    runner.run_merge(paths, _params(paths))
    list(runner.run_validate(paths, _params(paths)))
    out = []
    for level in levels:
        set_params(paths, {"audit.confident": level})
        params = _params(paths)
        champion = runner.champion(paths, params)
        t0 = time.perf_counter()
        report = audit_batches(paths, params, champion)
        out.append({"confident": level, "seconds": time.perf_counter() - t0, "report": report})
    return out, report.batches["batch-new"].images


def _scores(report: Any, planted: dict[str, set[str]]) -> dict[str, Any]:
    flagged = {Path(f.file_name).name: {x.kind for x in f.issues} for f in report.flagged if f.batch == "batch-new"}
    bad = set().union(*planted.values())
    hit = bad & set(flagged)
    row = {"flagged": len(flagged), "planted": len(bad),
           "precision": len(hit) / len(flagged) if flagged else float("nan"),
           "recall": len(hit) / len(bad) if bad else float("nan")}
    for k, ims in planted.items():
        row[f"recall_{k}"] = len(ims & set(flagged)) / len(ims) if ims else float("nan")
        row[f"named_{k}"] = sum(k in flagged[i] for i in ims if i in flagged) / len(ims) if ims else float("nan")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=["sample", "coco128"], default="sample")
    ap.add_argument("--images", type=int, default=80, help="images per training batch (sample)")
    ap.add_argument("--new", type=int, default=60, help="images in the new batch")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--imgsz", type=int, default=192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--drop", type=float, default=0.10)
    ap.add_argument("--relabel", type=float, default=0.05)
    ap.add_argument("--shift", type=float, default=0.05)
    ap.add_argument("--confident", default="0.3,0.5,0.7,0.95")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    levels = [float(x) for x in args.confident.split(",")]
    train = {"imgsz": args.imgsz, "epochs": args.epochs, "batch": args.batch, "lr": 0.004, "eval_interval": 10,
             "use_champion": False, "augment": {"close_mosaic": 5}}
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        base = Path(tmp)
        if args.data == "sample":
            training = [b.path for b in generate(base / "samples", 2, args.images, args.seed)]
            clean = generate_batch(base / "new-clean", 2, args.new, args.seed + 1000).path
        else:
            training, clean = _coco128_split(base / "coco128", args.new)
        t0 = time.perf_counter()
        ws = _champion(base / "champion", training, train)
        champion_s = time.perf_counter() - t0
        champ_map = EvalReport.read(ws.eval_report).candidate.metrics.map
        planted = plant_errors(clean, base / "new-planted", args.drop, args.relabel, args.shift, args.seed)
        clean_runs, n = _audit(ws, base / "ws-clean", clean, levels)
        planted_runs, _ = _audit(ws, base / "ws-planted", base / "new-planted", levels)
    rows = []
    for c, p in zip(clean_runs, planted_runs, strict=True):
        s = _scores(p["report"], planted)
        clean_share = c["report"].batches["batch-new"].flagged_fraction
        rows.append((c["confident"], s, clean_share, p["seconds"]))
        print(f"confident {c['confident']}: precision {s['precision']:.2f} recall {s['recall']:.2f} "
              f"clean flagged {clean_share:.2f} ({p['seconds']:.1f} s)", flush=True)
    head = (f"## Label audit: planted errors found ({args.data}, champion {args.imgsz} px / {args.epochs} epochs; "
            "bench/audit_quality.py)\n\n"
            f"Machine: {machine()}.\n"
            f"Champion: yolo11n at imgsz {args.imgsz}, {args.epochs} epochs from scratch on "
            + (f"2 generated batches of {args.images}" if args.data == "sample" else "96 coco128 photos")
            + f" ({champion_s / 60:.1f} min through the stages), test mAP50-95 {champ_map:.3f}. New batch: {n} "
            f"unseen images; planted box by box: {args.drop:.0%} removed, {args.relabel:.0%} relabelled, "
            f"{args.shift:.0%} shifted by half their size -> {len(set().union(*planted.values()))} images with "
            f"an error ({', '.join(f'{len(v)} {k}' for k, v in planted.items())}). Precision and recall are of the "
            "flagged images against those; 'named' is the share of a kind's images whose flag names that kind. "
            "Clean: the same batch without errors. Time: `retrain audit`'s code on the new batch (prediction and "
            "cleanlab).\n\n"
            "| confident | flagged | precision | recall | recall missing / wrong class / bad location | named "
            "missing / wrong class / bad location | clean batch flagged | audit s |\n"
            "|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {lvl:g} | {s['flagged']} | {s['precision']:.2f} | {s['recall']:.2f} | "
        + " / ".join(f"{s[f'recall_{k}']:.2f}" for k in KINDS) + " | "
        + " / ".join(f"{s[f'named_{k}']:.2f}" for k in KINDS) + f" | {clean:.1%} | {sec:.1f} |\n"
        for lvl, s, clean, sec in rows)
    update_results_md(head + body)
    print(head + body)


if __name__ == "__main__":
    main()
