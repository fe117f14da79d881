"""Helpers shared by the benchmarks: the machine's description, ``RESULTS.md`` sections, a timed flow run.

Every benchmark imports these from here (``bench/`` is on ``sys.path`` when a script in it runs), never from
another benchmark.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("RESULTS.md")
SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def cpu_model() -> str:
    """The CPU's model name (as ``lscpu`` shows it), or the architecture where /proc/cpuinfo is missing."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def machine() -> str:
    """Cores, CPU model, memory, Python and OS: the "Machine:" line of a results section."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu_model()}), {mem:.0f} GiB RAM, Python {platform.python_version()}, "
            f"{platform.system()}")


def update_results_md(section: str) -> None:
    """Put ``section`` into ``RESULTS.md``, replacing the section with the same heading line, else appending it."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    head = section.splitlines()[0]
    if head in text:
        start = text.index(head)
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + (section.rstrip("\n") + "\n\n" + text[nxt + 1:] if nxt != -1 else section)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


def flow_run(root: Path, only_if_new: bool = False) -> dict[str, Any]:
    """One retrain flow run in this process; its summary plus Prefect's own timing of it.

    Returns:
        ``summary`` (the run's summary), ``wall`` (the flow run's start to end, by Prefect), ``call`` (the in-process
        call), ``own`` (the stages' and ingest's own times), ``overhead`` (``wall - own``).
    """
    from prefect import get_client

    from flows.retrain import outcome, retrain

    t0 = time.perf_counter()
    state = retrain(project=str(root), only_if_new=only_if_new, return_state=True)
    call = time.perf_counter() - t0
    summary = outcome(state)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
    wall = (run.end_time - run.start_time).total_seconds()
    own = sum(summary["seconds"].values())
    return {"summary": summary, "wall": wall, "call": call, "own": own, "overhead": wall - own}


def coco128_batches(base: Path, parts: int) -> list[Path]:
    """coco128 (COCO JSON, ``../shared/data``) split into ``parts`` batches by image order (every parts-th image): one
    folder per batch, as deliveries would come."""
    import json
    import shutil

    src = SHARED / "coco128-coco"
    doc = json.loads((src / "annotations" / "instances_train2017.json").read_text())
    images = sorted(doc["images"], key=lambda im: im["file_name"])
    out = []
    for k in range(parts):
        part = images[k::parts]
        ids = {im["id"] for im in part}
        d = base / "coco128" / f"batch-{k + 1}"
        (d / "images").mkdir(parents=True)
        for im in part:
            shutil.copy2(src / "train2017" / im["file_name"], d / "images" / im["file_name"])
        (d / "annotations.json").write_text(json.dumps({
            "images": part, "categories": doc["categories"],
            "annotations": [a for a in doc["annotations"] if a["image_id"] in ids]}))
        out.append(d)
    return out


def run_module(*args: str | Path, cwd: Path) -> None:
    """``python -m ARGS`` in ``cwd`` with this interpreter's scripts on PATH; raises on failure."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    subprocess.run([sys.executable, "-m", *map(str, args)], cwd=cwd, env=env, check=True, capture_output=True)


def sample_workspace(root: Path, batches: int, images: int) -> Path:
    """``root/ws``: a retrain workspace with ``batches`` sample batches of ``images`` ingested, merged, validated."""
    from retrain.data.sample import generate

    ws = root / "ws"
    run_module("retrain", "init", ws, "--remote", root / "remote", cwd=root)
    for b in generate(root / "samples", batches, images, seed=0):
        run_module("retrain", "ingest", b.path, cwd=ws)
    run_module("retrain", "merge", cwd=ws)
    run_module("retrain", "validate", cwd=ws)
    return ws
