"""``build_trainer()``: the Lightning ``Trainer`` of a run, assembled from params and callbacks."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

from retrain.config import TrainParams
from retrain.device import cpu_name, on_cuda
from retrain.fsutil import write_atomic
from retrain.training.callbacks import LAST, AtomicCheckpointIO, FaultPoints, LastCheckpoint, WarmupEMA

log = logging.getLogger(__name__)


class _NotForOurUsers(logging.Filter):
    """Lightning's advertisement for its cloud logger (a run's log is no place for it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_third_party() -> None:
    """Filter, at their sources, the lines of our libraries that say nothing about this run (idempotent).

    - Lightning's LitLogger tip (``rank_zero_info`` on every ``Trainer``);
    - the ``FutureWarning`` torch raises when Lightning's ``_pytree`` builds a ``LeafSpec`` (torch deprecated the
      class Lightning 2.6 still uses; nothing to change on our side);
    - Lightning's CSV logger warning that a resumed run's ``reports/train/`` "will be deleted" (the rows before the
      resumed step are put back: ``train._loggers``).
    """
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    rank_zero = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    if not any(isinstance(f, _NotForOurUsers) for f in rank_zero.filters):
        rank_zero.addFilter(_NotForOurUsers())

MONITOR = "val/mAP50-95"


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the kernel after each step.

    Every training step frees and reallocates the same activation buffers (tens of MB each).  By default glibc
    serves blocks over its mmap threshold with fresh ``mmap`` calls and trims its heap, so each step page-faults
    its buffers in again (the count and its share of a step: ``bench/RESULTS.md``, "measured in development").
    Raising the mmap threshold to its maximum (32 MiB on 64-bit) and the trim threshold to 1 GiB makes steady
    steps fault-free; the process keeps its peak heap, as a training process does anyway.  It is PyTorch's CPU
    tuning advice (there: jemalloc/tcmalloc), done with ``mallopt`` so nothing must be preloaded.

    Returns:
        False where the C library is not glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def cpu_flags() -> dict[str, bool]:
    """The CPU's capability flags as torch reads them (``amx_bf16``, ``avx512_bf16``, ...), else ``/proc/cpuinfo``'s."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        with contextlib.suppress(Exception):
            return {str(k): bool(v) for k, v in caps().items()}
    info = Path("/proc/cpuinfo")
    flags = next((ln.split(":", 1)[1].split() for ln in info.read_text().splitlines() if ln.startswith("flags")),
                 []) if info.is_file() else []
    return dict.fromkeys(flags, True)


def native_bf16(flags: dict[str, bool]) -> bool:
    """Whether the CPU computes bf16 in hardware: AMX (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``).  Elsewhere
    oneDNN converts to float32 for every bf16 operation, and bf16 is slower than float32."""
    return bool(flags.get("amx_bf16") or flags.get("avx512_bf16"))


def resolve_precision(params: TrainParams, flags: dict[str, bool] | None = None) -> str:
    """``auto``: bf16-mixed on a CUDA GPU that supports it, and on a CPU that computes bf16 natively (``flags``:
    the CPU's, read when not given); else 32-true.  An explicit value is used as it is."""
    if params.precision != "auto":
        return params.precision
    if on_cuda(params):
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    if params.accelerator in ("auto", "cpu") and native_bf16(cpu_flags() if flags is None else flags):
        return "bf16-mixed"
    return "32-true"


def multi_process(params: TrainParams) -> bool:
    devices = str(params.devices)
    return params.num_nodes > 1 or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or (
        devices.isdigit() and int(devices) > 1)


def machine_cache() -> Path:
    """This machine's record of ``channels_last: auto``'s choices, shared by its workspaces:
    ``$XDG_CACHE_HOME/retrain/memory-format.json`` (default ``~/.cache/retrain``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "retrain" / "memory-format.json"


def _read_choices(path: Path | None) -> dict[str, bool]:
    if path is None or not path.is_file():
        return {}
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(path.read_text())
        if isinstance(known, dict):
            return {k: v for k, v in known.items() if isinstance(v, bool)}
    return {}


def use_channels_last(params: TrainParams, model: torch.nn.Module | None = None, cache: Path | None = None,
                      machine: Path | None = None) -> bool:
    """Whether to train in channels_last memory format.

    ``auto``: on CUDA, yes (faster convolutions there).  On a CPU it depends on the processor (oneDNN's NHWC
    kernels won on a Xeon with AMX and may lose elsewhere: ``bench/RESULTS.md``), so one training step
    of ``model`` is timed in both formats, once per processor, torch version, thread count, model and size.  The
    answer is kept in ``cache`` (the workspace's JSON file: a resumed run makes the same choice, whatever happens
    to the machine's record) and in ``machine`` (``machine_cache()``: every workspace on this machine then trains
    in the same format; the two formats' arithmetic differs, and when the timings are close, timing again in each
    workspace made two runs of the same data pick differently).  A run of several processes (DDP) on CPUs trains
    in NCHW: DDP needs one format on every rank, and ranks on other machines would time their own processors.
    """
    if params.channels_last != "auto":
        return params.channels_last == "on"
    if on_cuda(params):
        return True
    if model is None or multi_process(params):
        return False  # every rank of a DDP run must use one format, and each would time its own CPU's
    key = measurement_key(model, params.imgsz)
    known = _read_choices(cache)
    if key in known:
        return known[key]
    shared = _read_choices(machine)
    if key in shared:
        known[key] = shared[key]
        log.info("memory format: %s, as timed before on this CPU (%s)", "channels_last" if known[key] else "NCHW",
                 machine)
    else:
        batch = min(params.batch, 4)
        nchw, nhwc = _step_seconds(model, params.imgsz, batch, False), _step_seconds(model, params.imgsz, batch, True)
        known[key] = nhwc < nchw
        log.info("memory format: one training step (batch %d, imgsz %d) took %.3f s in NCHW, %.3f s in channels_last"
                 " on this CPU: training in %s", batch, params.imgsz, nchw, nhwc,
                 "channels_last" if known[key] else "NCHW")
        if machine is not None:
            try:
                write_atomic(machine, json.dumps({**_read_choices(machine), key: known[key]}, indent=1,
                                                 sort_keys=True))
            except OSError as e:  # a read-only home: the workspace's record still holds
                log.warning("memory format: could not record the choice in %s (%s)", machine, e)
    if cache is not None:
        write_atomic(cache, json.dumps(known, indent=1, sort_keys=True))
    return known[key]


def measurement_key(model: torch.nn.Module, *parts: object, device: torch.device | None = None) -> str:
    """The key of a measurement made on this machine: CPU (or CUDA GPU), torch version, threads, ``parts`` (image
    size, batch, ...) and the model's architecture, which together decide how fast a training step runs."""
    spec = json.dumps(getattr(model, "yaml", {}), sort_keys=True, default=str)
    where = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else cpu_name()
    return "|".join([where, f"torch {torch.__version__}", f"{torch.get_num_threads()} threads", *map(str, parts),
                     hashlib.sha256(spec.encode()).hexdigest()[:12]])


#: Steps timed by a measurement, after the first (which warms up, or compiles).
TIMED_STEPS = 2


def fastest(step: Callable[[], float]) -> tuple[float, float]:
    """Run ``step`` (which returns its own seconds) ``1 + TIMED_STEPS`` times: the first one's seconds, and the
    fastest of the rest."""
    times = [step() for _ in range(1 + TIMED_STEPS)]
    return times[0], min(times[1:])


def _step_seconds(model: torch.nn.Module, imgsz: int, batch: int, channels_last: bool) -> float:
    """The fastest forward + backward pass of a copy of ``model`` (``fastest``)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = copy.deepcopy(model).train().to(memory_format=fmt)
    x = torch.rand(batch, 3, imgsz, imgsz).contiguous(memory_format=fmt)

    def step() -> float:
        t0 = time.perf_counter()
        torch.stack([t.float().sum() for t in _tensors(net(x))]).sum().backward()
        return time.perf_counter() - t0

    return fastest(step)[1]


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    return [t for item in items for t in _tensors(item)]


def build_trainer(params: TrainParams, checkpoint_dir: Path, loggers: list[Any], extra: list[Any] | None = None,
                  last_every_s: float = 0.0) -> pl.Trainer:
    """The Trainer: EMA, last and best checkpoints, early stopping, LR monitor, fault points.

    Args:
        params: The ``train`` section.
        checkpoint_dir: Where ``last.ckpt`` / ``best.ckpt`` go (outside any DVC output, so resume survives).
        loggers: Lightning loggers (MLflow, CSV).
        extra: More callbacks (progress reporting, for instance).
        last_every_s: ``runtime.checkpoint_every_s``: seconds of training between writes of ``last.ckpt`` (0: each
            epoch; the final epoch always).

    Returns:
        The configured Trainer.
    """
    # "last" as a top-1 checkpoint without a monitor: Lightning writes ``save_last`` only in epochs where a
    # top-k checkpoint was saved too, which with save_top_k=0 is never.
    last = LastCheckpoint(last_every_s, dirpath=checkpoint_dir, filename=Path(LAST).stem, monitor=None, save_top_k=1,
                          every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False)
    best = ModelCheckpoint(dirpath=checkpoint_dir, filename="best", monitor=MONITOR, mode="max", save_top_k=1,
                           auto_insert_metric_name=False, enable_version_counter=False,
                           save_on_train_epoch_end=False)  # after each validation, which may skip epochs
    callbacks: list[Any] = [
        WarmupEMA(params.ema_decay, params.ema_tau), last, best,
        EarlyStopping(monitor=MONITOR, mode="max", patience=params.patience, check_on_train_epoch_end=False),
        FaultPoints(),
        *(extra or []),
    ]
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="epoch"))
    quiet_third_party()
    return pl.Trainer(
        accelerator=params.accelerator, devices=params.devices, strategy=params.strategy, num_nodes=params.num_nodes,
        precision=resolve_precision(params),  # type: ignore[arg-type]
        max_epochs=params.epochs, check_val_every_n_epoch=params.eval_interval,
        accumulate_grad_batches=params.accumulate, gradient_clip_val=params.grad_clip or None,
        callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()],
        default_root_dir=str(checkpoint_dir), log_every_n_steps=1, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # MasterDataModule shards by rank itself (EpochSampler)
        deterministic=False, benchmark=False, enable_model_summary=False,
    )
