"""The production topology against the embedded defaults: the flow's overhead and promote's time on each.

One run of this script measures both, on the same generated data and params (the demo's: batches of 40 sample
images, yolo11n at imgsz 320, 30 epochs, ``train.batch`` 8):

- **embedded**: a workspace on the defaults: Prefect's local ephemeral API, sqlite MLflow (``mlflow.db``), a local
  folder as DVC remote;
- **stack**: a workspace on the local production stack (``scripts/stack``, started and stopped by this script):
  the Prefect server on PostgreSQL, the MLflow server on PostgreSQL with its artifacts in S3 (moto), the DVC remote
  in S3; the servers sit in a network namespace of their own, reached over a veth link.

Each topology runs in a process of its own (its environment is the configuration: nothing else differs), which
runs the flow in-process, as ``bench/flow_overhead.py`` does: one flow run per arriving batch, then one with
nothing new.  A stage's own time is its ``dvc repro --single-item`` process; the overhead is the flow run's wall
time minus the stages' and ingest's own times (Prefect's bookkeeping, DVC's planning, artifacts, the git commit
and ``dvc push``).  Promote's time is its stage's own time (register, log the model, move the aliases).
"""

from __future__ import annotations

import argparse
import json
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

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ("embedded", "stack")


def measure(topology: str, base: Path, batches: int, images: int, epochs: int) -> dict[str, Any]:
    """One topology's runs, in this process (its environment already set); their figures."""
    import yaml

    from retrain.data.sample import generate
    from retrain.workspace import commit, init_workspace

    remote = f"{os.environ['RETRAIN_DVC_REMOTE']}/bench" if topology == "stack" else str(base / "remote")
    paths = init_workspace(base / "ws", remote=remote)
    doc = yaml.safe_load(paths.params.read_text())
    doc["train"].update(batch=8, epochs=epochs)  # the demo's training for its 40-image batches
    paths.params.write_text(yaml.safe_dump(doc, sort_keys=False))
    commit(paths, "bench params")
    t0 = time.perf_counter()
    flow_run(paths.root, only_if_new=True)  # nothing waits: the local API starts here (embedded only)
    first = time.perf_counter() - t0
    runs = []
    for s in generate(base / "samples", batches, images, seed=0):
        shutil.move(str(s.path), str(paths.incoming / s.path.name))
        r = flow_run(paths.root)
        assert all(r["summary"]["stages"].values()) and r["summary"]["version"], r["summary"]
        runs.append(r)
    idle = flow_run(paths.root)
    assert idle["summary"]["nothing_to_retrain"], idle["summary"]
    return {"topology": topology, "first_call": first, "runs": [_slim(r) for r in runs], "idle": _slim(idle)}


def _slim(r: dict[str, Any]) -> dict[str, Any]:
    s = r["summary"]
    return {"wall": r["wall"], "call": r["call"], "own": r["own"], "overhead": r["overhead"],
            "seconds": s["seconds"], "version": s.get("version"), "promoted": s.get("promoted"),
            "candidate_map": s.get("candidate_map")}


def one(topology: str, base: Path, out: Path, batches: int, images: int, epochs: int) -> None:
    """``--one``: run ``measure`` in this process, with the environment the parent set; JSON to ``out``."""
    base.mkdir(parents=True, exist_ok=True)
    os.environ.update(YOLO_OFFLINE="true", PREFECT_HOME=str(base / "prefect"),
                      PREFECT_SERVER_ANALYTICS_ENABLED="false", DVC_NO_ANALYTICS="1")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    sys.path.insert(0, str(ROOT))
    from flows.api import connect

    t0 = time.perf_counter()
    connect()  # embedded: starts the local API (a new database); stack: the server's health check
    api = time.perf_counter() - t0
    out.write_text(json.dumps({**measure(topology, base, batches, images, epochs), "api": api}))


def child_env(topology: str, stack: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
    if topology == "stack":
        env.update(stack.client_env())
    return env


def section(results: dict[str, dict[str, Any]], stack_up: float, batches: int, images: int, epochs: int) -> str:
    e, s = results["embedded"], results["stack"]

    def avg(r: dict[str, Any], key: str) -> float:
        return sum(x[key] for x in r["runs"]) / len(r["runs"])

    def avg_stage(r: dict[str, Any], stage: str) -> float:
        return sum(x["seconds"].get(stage, 0.0) for x in r["runs"]) / len(r["runs"])

    lines = [
        "## topology: the flow on the production stack against the embedded defaults", "",
        f"Machine: {psutil.cpu_count()} cores ({cpu_model()}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"Python {platform.python_version()}, {platform.system()}. Date: {date.today()}. "
        "Command: `python bench/topology.py`.", "",
        f"The same {batches} generated batches of {images} images, arriving one at a time (one flow run each, then "
        f"one with nothing new), the demo's params (yolo11n, imgsz 320, {epochs} epochs, batch 8), in one run of the "
        "script. **embedded**: Prefect's local ephemeral API (sqlite), sqlite MLflow, a local folder as DVC remote. "
        "**stack**: `scripts/stack` (the Prefect server and the MLflow server on PostgreSQL 15, MLflow artifacts and "
        "the DVC remote in S3 (moto), the servers in a network namespace reached over a veth link); the flow runs on "
        "the host, a client of the stack as a worker is. Overhead = the flow run's wall time minus the stages' "
        "and ingest's own times (Prefect's task runs, logs and artifacts sent to its API, DVC's planning, the run "
        "lock, the git commit and `dvc push`).", "",
        "| per flow run (mean over the runs with a batch) | embedded | stack | stack / embedded |",
        "|---|---:|---:|---:|",
    ]
    rows = [("flow run wall time", avg(e, "wall"), avg(s, "wall")),
            ("stages' own time", avg(e, "own"), avg(s, "own")),
            ("**overhead inside the run**", avg(e, "overhead"), avg(s, "overhead")),
            ("overhead of the in-process call", avg(e, "call") - avg(e, "own"), avg(s, "call") - avg(s, "own"))]
    rows += [(f"stage {st}", avg_stage(e, st), avg_stage(s, st)) for st in ("train", "evaluate")]
    rows += [("**stage promote** (register, log the model, aliases)", avg_stage(e, "promote"),
              avg_stage(s, "promote"))]
    rows += [("nothing new: wall time", e["idle"]["wall"], s["idle"]["wall"]),
             ("nothing new: overhead", e["idle"]["overhead"], s["idle"]["overhead"]),
             ("once a process: the API ready (embedded: the local one starts on a new database; stack: a health "
              "check)", e["api"], s["api"]),
             ("the process's first flow run, nothing waiting", e["first_call"], s["first_call"])]
    for name, a, b in rows:
        lines.append(f"| {name} | {a:.2f} s | {b:.2f} s | {b / a:.2f}x |" if a else f"| {name} | {a:.2f} s | "
                     f"{b:.2f} s | - |")
    lines += ["", "Per run (promote's own time, overhead, candidate mAP50-95, decision):", "",
              "| run | embedded promote | stack promote | embedded overhead | stack overhead | mAP50-95 e / s |",
              "|---|---:|---:|---:|---:|---|"]
    for i, (a, b) in enumerate(zip(e["runs"], s["runs"], strict=True), 1):
        maps = " / ".join("-" if x["candidate_map"] is None else f"{x['candidate_map']:.3f}" for x in (a, b))
        lines.append(f"| batch-{i} | {a['seconds']['promote']:.2f} s | {b['seconds']['promote']:.2f} s | "
                     f"{a['overhead']:.2f} s | {b['overhead']:.2f} s | {maps} |")
    same = all(a["candidate_map"] == b["candidate_map"] for a, b in zip(e["runs"], s["runs"], strict=True))
    lines += ["", "The candidates are " + ("the same in both topologies (same mAP50-95 to the last digit): only "
                                           "where things are stored differs." if same else
                                           "not the same in both topologies (see the mAP50-95 column)."),
              "", f"The stack itself took {stack_up:.1f} s to start (`scripts/stack up`: PostgreSQL, S3, both servers, "
              "the work pool), once, not counted above.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--images-per-batch", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--one", choices=TOPOLOGIES, help=argparse.SUPPRESS)
    ap.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(args.one, args.base, args.out, args.batches, args.images_per_batch, args.epochs)
        return
    sys.path.insert(0, str(ROOT))
    from stack.services import Stack

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="retrain-bench-topology-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)  # PostgreSQL's unprivileged user must reach its folder inside
        stack = Stack.at(base / "stack", "rtb", "10.231.78")
        t0 = time.perf_counter()
        stack.up()
        stack_up = time.perf_counter() - t0
        try:
            for topology in TOPOLOGIES:
                out = base / f"{topology}.json"
                subprocess.run([sys.executable, __file__, "--one", topology, "--base", str(base / topology),
                                "--out", str(out), "--batches", str(args.batches), "--images-per-batch",
                                str(args.images_per_batch), "--epochs", str(args.epochs)],
                               env=child_env(topology, stack), check=True)
                results[topology] = json.loads(out.read_text())
                print(json.dumps(results[topology]), flush=True)
        finally:
            stack.down()
    text = section(results, stack_up, args.batches, args.images_per_batch, args.epochs)
    print(text)
    if not args.no_write:
        update_results_md(text)


if __name__ == "__main__":
    main()
