"""Orchestration overhead of the retrain flow: its wall time minus its stages' own times.

Two runs in one fresh workspace on the embedded defaults (local ephemeral Prefect API, sqlite MLflow, local DVC
remote), with the demo's data and params (one sample batch of 40 images, yolo11n at imgsz 320):

- a full run: ingest, merge, validate, train, evaluate, promote, git commit, dvc push;
- a run with nothing new: every stage asked, every stage up to date.

A stage's own time is the wall time of its ``dvc repro --single-item`` process (DVC's checks included: that is how
the stage runs under ``dvc repro`` too); ingest's own time is the ingest call.  The overhead is the flow run's wall
time (Prefect's start and end of the flow run) minus those: task bookkeeping, DVC's stage planning, artifacts,
the run lock, git commit and dvc push.  The whole ``retrain run`` command (interpreter, imports, the ephemeral
API's start) is shown beside it.  Targets: overhead under 10 s and under 5% of the full run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import psutil
from common import cpu_model, flow_run, update_results_md


def cli_run(root: Path) -> float:
    """Wall time of the whole `retrain run` command (a new process, its own ephemeral Prefect API)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "retrain", "run"], cwd=root, capture_output=True, text=True,
                          check=False)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0 and "nothing to retrain" in proc.stdout, proc.stdout + proc.stderr
    return seconds


def section(full: dict[str, Any], idle: dict[str, Any], cli: float, api_start: float) -> str:
    stages = [k for k in full["summary"]["seconds"]]
    lines = ["## flow_overhead: the retrain flow's orchestration overhead", "",
             f"Machine: {psutil.cpu_count()} cores ({cpu_model()}), "
             f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, Python {platform.python_version()}, "
             f"{platform.system()}. Date: {date.today()}. Command: `python bench/flow_overhead.py`.", "",
             "One fresh workspace on the embedded defaults (local ephemeral Prefect API, sqlite MLflow, local DVC "
             "remote); the demo's data and params: one sample batch of 40 images, yolo11n at imgsz 320, 30 epochs.",
             "A stage's own time is its `dvc repro --single-item` process; overhead = the flow run's wall time "
             "(Prefect's start to end) minus the stages' and ingest's own times: Prefect's task runs, DVC's stage "
             "planning, the run lock, the artifacts, and the git commit and `dvc push` (both counted as overhead).",
             "",
             "| | full run | nothing new |", "|---|---:|---:|"]
    for k in stages:
        lines.append(f"| {k} | {full['summary']['seconds'][k]:.2f} s | "
                     + (f"{idle['summary']['seconds'][k]:.2f} s |" if k in idle["summary"]["seconds"] else "- |"))
    for r in (full, idle):
        r["call_overhead"] = r["call"] - r["own"]
    lines += [f"| stages' own time | {full['own']:.2f} s | {idle['own']:.2f} s |",
              f"| flow run wall time (Prefect's start to end of the run) | {full['wall']:.2f} s | "
              f"{idle['wall']:.2f} s |",
              f"| overhead inside the run | {full['overhead']:.2f} s | {idle['overhead']:.2f} s |",
              f"| the call `retrain(...)`, in-process | {full['call']:.2f} s | {idle['call']:.2f} s |",
              f"| **overhead of the call** (creating the run, states, logs, results) | **{full['call_overhead']:.2f} s "
              f"({100 * full['call_overhead'] / full['call']:.1f}%)** | **{idle['call_overhead']:.2f} s** |",
              "", f"Once per process, before the first flow run: Prefect's local ephemeral API starts (a new process "
              f"with its own database here): {api_start:.1f} s, not counted above (with a running `prefect server` "
              f"there is no such start). "
              f"The whole `retrain run` command with nothing new (new process: imports, the API's start, the flow): "
              f"{cli:.1f} s.", ""]
    worst = max(full["call_overhead"], idle["call_overhead"])
    ok = worst < 10 and full["call_overhead"] < 0.05 * full["call"]
    lines += [f"Targets: overhead < 10 s in both runs and < 5% of the full run: {'met' if ok else 'NOT met'} "
              f"(the call's overhead, the larger measure: {worst:.2f} s at most, "
              f"{100 * full['call_overhead'] / full['call']:.1f}% of the full run).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="retrain-bench-flow-") as tmp:
        base = Path(tmp)
        os.environ.update(PREFECT_HOME=str(base / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                          YOLO_OFFLINE="true")
        os.environ.pop("PREFECT_API_URL", None)
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
        from retrain.data.sample import generate
        from retrain.workspace import init_workspace

        paths = init_workspace(base / "ws", remote=str(base / "remote"))
        t0 = time.perf_counter()
        flow_run(paths.root, only_if_new=True)  # nothing waits: this starts the local API (once per process)
        api_start = time.perf_counter() - t0
        sample = generate(base / "samples", 1, 40, 0)[0]
        shutil.move(str(sample.path), str(paths.incoming / sample.path.name))
        full = flow_run(paths.root)
        assert all(full["summary"]["stages"].values()), full["summary"]
        idle = flow_run(paths.root)
        assert idle["summary"]["nothing_to_retrain"], idle["summary"]
        cli = cli_run(paths.root)
    text = section(full, idle, cli, api_start)
    print(text)
    if not args.no_write:
        update_results_md(text)


if __name__ == "__main__":
    main()
