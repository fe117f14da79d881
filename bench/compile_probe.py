"""Does ``torch.compile`` pay for a training step on this CPU, and what does a persistent compile cache save?

Groundwork for ``compile: auto`` (issue 24): the network of ``train.model`` (default yolo11n, 4 classes) at
``--imgsz`` and ``--batch``, one training step as ``DetectorModule.training_step`` takes it (forward through the
module call, ultralytics' loss, backward, an optimizer step; a fixed random batch, no data loading, no EMA), timed:

- eager;
- compiled in place (``nn.Module.compile``: the state dict keeps its keys, so checkpoints stay those of an eager run)
  with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``): the first step pays the whole compile (forward and the
  lazily compiled backward);
- compiled again in a new process with the same cache directory: what a second weekly run on the same machine pays.

Each row runs in its own fresh process, with OMP_NUM_THREADS as the caller had it (importing ultralytics sets it to
1).  Reported: the first step's seconds, the median of ``--steps`` later steps, inductor's own compile time
(``torch._dynamo.utils.calculate_time_spent``) and its FX-graph cache hits and misses, and the break-even: the steps
after which compiling has paid for itself (never, when the compiled step is not faster).  One section per CPU model in
bench/RESULTS.md.  Run it alone.  Usage:
    python bench/compile_probe.py [--imgsz 320] [--batch 16] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_OMP_AT_START = os.environ.get("OMP_NUM_THREADS")  # before ultralytics' import sets it (see serve_speed.py)
os.environ.setdefault("YOLO_OFFLINE", "true")
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

MARK = "COMPILE_PROBE "


def row(mode: str, imgsz: int, batch: int, steps: int) -> dict[str, Any]:
    """One mode's timings, in this process."""
    import torch

    from retrain.config import TrainParams
    from retrain.data.loading import hyperparameters
    from retrain.detector.model import build_model

    torch.manual_seed(0)
    params = TrainParams(imgsz=imgsz, batch=batch)
    model = build_model(params.model, ["a", "b", "c", "d"]).train()
    model.args = hyperparameters(params)
    for q in model.parameters():
        q.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    per = 3  # boxes per image
    data = {"img": torch.rand(batch, 3, imgsz, imgsz, generator=g),
            "batch_idx": torch.arange(batch).repeat_interleave(per).float(),
            "cls": torch.randint(0, 4, (batch * per, 1), generator=g).float(),
            "bboxes": torch.rand(batch * per, 4, generator=g) * 0.4 + 0.3}
    if mode != "eager":
        model.compile()

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, _ = model.loss(data, model(data["img"]))  # the module call (compiled), then the loss (eager)
        loss.sum().backward()
        opt.step()
        return time.perf_counter() - t

    first = step()
    later = [step() for _ in range(steps)]
    out: dict[str, Any] = {"mode": mode, "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "first_s": first, "step_s": statistics.median(later)}
    if mode != "eager":
        from torch._dynamo.utils import calculate_time_spent, counters

        out["compile_s"] = calculate_time_spent().get("total_wall_time", float("nan"))
        out["cache"] = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return out


def _child(mode: str, args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if _OMP_AT_START is not None:
        env["OMP_NUM_THREADS"] = _OMP_AT_START
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--row", mode, "--imgsz", str(args.imgsz),
                           "--batch", str(args.batch), "--steps", str(args.steps)], stdout=subprocess.PIPE, text=True,
                          env=env, check=False)
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{proc.stdout[-3000:]}"
    line = [x for x in proc.stdout.splitlines() if x.startswith(MARK)][-1]
    got: dict[str, Any] = json.loads(line[len(MARK):])
    print(got, flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--imgsz", type=int, default=320)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="timed steps after the first")
    ap.add_argument("--row", choices=("eager", "cold", "warm"), help=argparse.SUPPRESS)  # child: one row
    args = ap.parse_args()
    if args.row:
        print(MARK + json.dumps(row(args.row, args.imgsz, args.batch, args.steps)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="compile-probe-") as tmp:
        rows = [_child(mode, args, Path(tmp) / "inductor") for mode in ("eager", "cold", "warm")]
    write(rows, args)


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from common import cpu_model, machine, update_results_md

    eager = rows[0]["step_s"]
    labels = {"eager": "eager", "cold": "compiled, empty cache", "warm": "compiled, cache of the run above"}
    lines = [f"## compile_probe: torch.compile of a training step on {cpu_model()} (bench/compile_probe.py)", "",
             f"Machine: {machine()}. Run alone. torch {rows[0]['torch']}, {rows[0]['threads']} threads; yolo11n, 4 "
             f"classes, {args.imgsz} px, batch {args.batch}; a step: forward, ultralytics' loss, backward, SGD "
             f"(no data loading, no EMA); median of {args.steps} steps after the first.", "",
             "| row | first step s | compile s (inductor) | FX-graph cache | step s | vs eager | break-even steps |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = eager / r["step_s"]
        if r["mode"] == "eager":
            compile_s, cache, even = "", "", ""
        else:
            compile_s = f"{r['compile_s']:.1f}"
            cache = ", ".join(f"{k.removeprefix('fxgraph_cache_')} {v}" for k, v in sorted(r["cache"].items()))
            saved = eager - r["step_s"]
            even = f"{(r['first_s'] - r['step_s']) / saved:.0f}" if saved > 0 else "never (slower)"
        lines.append(f"| {labels[r['mode']]} | {r['first_s']:.1f} | {compile_s} | {cache} | {r['step_s']:.3f} | "
                     f"{speed:.2f}x | {even} |")
    text = "\n".join(lines) + "\n"
    print(text)
    update_results_md(text)


if __name__ == "__main__":
    main()
