"""Where a training step of `retrain train` spends its time on this CPU: the profile issue 24 asks for.

The same data, model and settings as bench/train_throughput.py (2 sample batches, yolo11n.yaml from scratch, 320 px,
batch 16, the workspace's defaults: precision, memory format and compile chosen by `auto` on this machine), trained
for a few epochs by `retrain.training.train.train` with one more Lightning callback that reads the clock at
Lightning's own hooks (nothing of the loop is replaced):

- data: from the end of one step (or the epoch's start) to the start of the next: the loader's `next()` (mosaic,
  colour and geometry augmentations, collation; in the training process, `workers: auto` on a CPU);
- forward: from the step's start to `on_before_backward`, less the loss;
- loss: ultralytics' `model.loss` (the task-aligned target assignment and the box, class and DFL terms), timed by
  wrapping the module's network's `loss` for this run;
- backward: `on_before_backward` to `on_after_backward`;
- EMA: the `WarmupEMA` callback's `on_train_batch_end` (Lightning's `EMAWeightAveraging` update), wrapped likewise;
- optimizer and the rest: `on_after_backward` to the step's end, less the EMA (gradient clipping, AdamW's step,
  logging, the other callbacks' hooks).

The first epoch (allocator and loader warm-up) and validation are left out. It runs in this process, without the huge
page tunable `retrain train` sets by re-executing itself. The shares are of our own step: the peer's step is not
broken down (its trainer has no such hooks), so this section says where a speed-up could come from, not how we
compare. Usage: python bench/step_profile.py [--epochs N] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ.setdefault("YOLO_OFFLINE", "true")
sys.path.insert(0, str(HERE))
from common import cpu_model, machine, sample_workspace, update_results_md  # noqa: E402

PHASES = ("data", "forward", "loss", "backward", "EMA", "optimizer and the rest")


def profiler() -> Any:
    import pytorch_lightning as pl

    class Phases(pl.Callback):
        """Seconds of each phase of each training step, keyed by epoch."""

        def __init__(self) -> None:
            self.steps: dict[int, list[dict[str, float]]] = defaultdict(list)
            self.mark: float | None = None
            self.inner = {"loss": 0.0, "EMA": 0.0}

        def _timed(self, fn: Any, phase: str) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.inner[phase] += time.perf_counter() - t0
            return wrapper

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            module.model.loss = self._timed(module.model.loss, "loss")
            emas = [cb for cb in trainer.callbacks if type(cb).__name__ == "WarmupEMA"]
            assert len(emas) == 1 and trainer.callbacks.index(emas[0]) < trainer.callbacks.index(self)
            emas[0].on_train_batch_end = self._timed(emas[0].on_train_batch_end, "EMA")

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.mark = time.perf_counter()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            self.data, self.t_start = now - (self.mark or now), now
            self.inner = {"loss": 0.0, "EMA": 0.0}

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            self.t_bb = time.perf_counter()

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            self.t_ab = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            self.steps[trainer.current_epoch].append({
                "data": self.data, "forward": self.t_bb - self.t_start - self.inner["loss"],
                "loss": self.inner["loss"], "backward": self.t_ab - self.t_bb, "EMA": self.inner["EMA"],
                "optimizer and the rest": now - self.t_ab - self.inner["EMA"], "images": float(len(batch["img"]))})
            self.mark = now

    return Phases()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--images-per-batch", type=int, default=80)
    ap.add_argument("--no-write", action="store_true", help="print, do not update RESULTS.md")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    ws = sample_workspace(root, 2, args.images_per_batch)

    from retrain.config import load_params
    from retrain.paths import Paths
    from retrain.runner import run_log
    from retrain.training.train import train

    params = load_params(ws / "params.yaml")
    threads = len(os.sched_getaffinity(0))
    settings = {"model": "yolo11n.yaml", "imgsz": 320, "epochs": args.epochs, "batch": 16, "cache": "ram",
                "use_champion": False, "optimizer": "AdamW", "patience": 1000}
    params = params.model_copy(update={"train": params.train.model_copy(update=settings),
                                       "runtime": params.runtime.model_copy(update={"threads": threads})})
    phases = profiler()
    result = train(Paths(ws), params, None, run_log(Paths(ws), params), callbacks=[phases])
    assert result is not None
    report = result.report.to_json()

    steps = [s for epoch, got in sorted(phases.steps.items()) if epoch > 0 for s in got]
    full = [s for s in steps if s["images"] == 16]  # a last, smaller batch is a shorter step
    total = sum(sum(s[p] for p in PHASES) for s in full)
    rows = [(p, sum(s[p] for s in full) / len(full), sum(s[p] for s in full) / total) for p in PHASES]
    step_s = total / len(full)
    table = "\n".join(f"| {p} | {sec * 1000:.0f} | {share:.1%} |" for p, sec, share in rows)
    section = f"""## step_profile: where a training step of `retrain train` spends its time ({cpu_model()})

Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Command: `python bench/step_profile.py --epochs {args.epochs}`.

Data: 2 sample batches of {args.images_per_batch} images; yolo11n.yaml from scratch, 320 px, batch 16, AdamW, mosaic,
{threads} torch threads, RAM cache; precision {report['precision']}, {report['compile']['reason']}.
{len(full)} full steps of epochs 2-{args.epochs} (epoch 1 and validation left out), timed at Lightning's hooks
(see the script's docstring); in the bench's own process (no huge-page tunable).

| phase | ms a step | share |
|---|---:|---:|
{table}
| a step | {step_s * 1000:.0f} | 100% |
"""
    print(section)
    if not args.no_write:
        update_results_md(section)


if __name__ == "__main__":
    main()
