"""How `retrain merge` scales: a 1,000-image batch joins masters of 10k and 100k images.

For each size, in a fresh workspace: generate source batches of tiny unique JPEGs (COCO JSON, 1-3
boxes each), ingest them for real (checks + `dvc add`), merge, then ingest the new 1,000-image batch
and time the merge that adds it:
- `retrain merge` as a user runs it (a subprocess, Python start-up included), median of 3 runs;
- the same merge in-process under an audit hook that counts every open() of an image file: old images
  must never be read again (their hashes come from the batch manifests);
- the peer, measured in the same run: loading the merged master's annotations with pycocotools' COCO()
  (what every consumer of the master pays once), so the ratio says how much more a merge costs than a load.
Writes a section into bench/RESULTS.md.  Usage: python bench/merge_scaling.py [--sizes 10000 100000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, update_results_md
from PIL import Image
from pycocotools.coco import COCO

from retrain.config import load_params
from retrain.ingest import ingest
from retrain.merge import merge
from retrain.paths import Paths
from retrain.workspace import init_workspace

BATCH = 10_000


def write_source_batch(out: Path, first: int, n: int) -> Path:
    """n tiny images, unique by construction (a lossless PNG of one colour per index), 1-3 boxes each, as COCO."""
    (out / "images").mkdir(parents=True)
    images, anns = [], []
    for k in range(n):
        i = first + k
        buf = io.BytesIO()
        Image.new("RGB", (32, 24), (i & 255, (i >> 8) & 255, (i >> 16) & 255)).save(buf, "PNG")
        name = f"im{i:08d}.png"
        (out / "images" / name).write_bytes(buf.getvalue())
        images.append({"id": k + 1, "file_name": name, "width": 32, "height": 24})
        for j in range(1 + i % 3):
            anns.append({"id": len(anns) + 1, "image_id": k + 1, "category_id": 1 + (i + j) % 5,
                         "bbox": [j * 4.0, j * 3.0, 8.0, 6.0], "iscrowd": 0})
    cats = [{"id": c + 1, "name": f"class{c}"} for c in range(5)]
    (out / "annotations.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return out


def cli_merge_seconds(root: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "retrain", "merge"], cwd=root, check=True, capture_output=True)
    return time.perf_counter() - t


def audited_merge(paths: Paths) -> tuple[float, int, int]:
    """In-process merge; returns (seconds, image files opened, images in master)."""
    images_root = str(paths.batches)
    opened = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(images_root) \
                and "/images/" in args[0]:
            opened.append(args[0])

    sys.addaudithook(hook)  # stays installed; harmless afterwards (only this list grows)
    opened.clear()
    t = time.perf_counter()
    result = merge(paths, load_params(paths.params).merge)
    seconds = time.perf_counter() - t
    count = len(opened)
    opened.clear()
    images_root = "\0"  # stop counting
    return seconds, count, result.report["totals"]["images"]


def peer_seconds(paths: Paths) -> float:
    """The peer: loading the merged annotations with pycocotools (the field's standard COCO loader)."""
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        COCO(str(paths.master / "annotations.json"))
    return time.perf_counter() - t


def run_size(size: int, tmp: Path) -> dict[str, float]:
    paths = init_workspace(tmp / f"ws-{size}", remote=str(tmp / f"remote-{size}"))
    params = load_params(paths.params)
    t = time.perf_counter()
    for b in range(0, size, BATCH):
        n = min(BATCH, size - b)
        src = write_source_batch(tmp / f"src-{size}-{b}", b, n)
        ingest(paths, src, params, name=f"old-{b // BATCH:03d}")
    ingest_old = time.perf_counter() - t
    merge(paths, params.merge)
    src = write_source_batch(tmp / f"src-{size}-new", 10_000_000, 1000)
    t = time.perf_counter()
    ingest(paths, src, params, name="new")
    ingest_new = time.perf_counter() - t
    cli = [cli_merge_seconds(paths.root) for _ in range(3)]
    inproc, opened, total = audited_merge(paths)
    peer = peer_seconds(paths)
    return {"size": size, "total": total, "cli_median": statistics.median(cli), "cli_max": max(cli),
            "inproc": inproc, "opened": opened, "peer": peer, "ingest_old": ingest_old, "ingest_new": ingest_new}


def write_results(rows: list[dict[str, float]]) -> str:
    lines = [
        "## merge_scaling: a 1,000-image batch joins the master",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Command: `python bench/merge_scaling.py`.",
        "",
        "| master before | master after | `retrain merge` (CLI, median of 3) | in-process merge | image files opened "
        "by the merge | peer: pycocotools COCO() load of the master | in-process merge / peer |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['size']:,} | {r['total']:,} | {r['cli_median']:.2f} s | {r['inproc']:.2f} s | "
                     f"{r['opened']} | {r['peer']:.2f} s | {r['inproc'] / r['peer']:.2f} |")
    lines += ["", "Setting up (not part of the merge): ingest of the old batches (checks, copy, `dvc add`) took "
              + ", ".join(f"{r['ingest_old']:.0f} s for {r['size']:,}" for r in rows)
              + "; the new 1,000-image batch took "
              + ", ".join(f"{r['ingest_new']:.1f} s" for r in rows) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="retrain-bench-") as tmp:
        for size in args.sizes:
            r = run_size(size, Path(tmp))
            print(json.dumps(r), flush=True)
            rows.append(r)
    section = write_results(rows)
    print(section)
    if not args.no_write:
        update_results_md(section)
    bad = [r for r in rows if r["opened"]]
    if bad:
        sys.exit(f"merge opened image files: {bad}")


if __name__ == "__main__":
    main()
