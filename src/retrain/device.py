"""Where a stage computes: a CUDA GPU or the CPU cores this process may run on."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from retrain.config import RuntimeParams, TrainParams


def cpu_threads(runtime: RuntimeParams) -> int:
    """Threads for torch: ``runtime.threads``, else the cores this process may run on."""
    return runtime.threads or len(os.sched_getaffinity(0))


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), or ``"cpu"`` where it is not known."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "cpu"


def on_cuda(params: TrainParams) -> bool:
    """Whether this run trains on a CUDA GPU (the accelerator allows it and one is present)."""
    return params.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
