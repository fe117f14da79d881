"""``runtime.compile``: whether a run trains through ``torch.compile``, decided on this machine's measurements.

On a CPU a compiled training step is 0.9x-1.2x an eager one depending on the processor, and the first compile
takes minutes (``bench/RESULTS.md``, compile_probe), so no constant answers "does it pay".  ``auto`` compiles when
the run's planned steps times the measured saving per step exceed the compile's cost:

- the compiled artefacts live in the workspace's cache (``.cache/inductor/<torch>-<ISA>-<cpu>``: PyTorch's persistent
  FX-graph and AOTAutograd caches, whose keys already hold the graph, shapes, dtypes, thread count and torch version;
  the folder name adds the CPU, which their keys lack), so the next weekly run compiles from the cache in seconds;
- the measurements (eager step, compiled step, compile seconds cold and from the cache) are kept per CPU, torch
  version, threads, model, image size, batch, precision and memory format in ``.cache/compile.json``;
- with no measurement yet, a run measures only when it is long enough that the best saving seen on any CPU (20% of a
  step) could pay for a first compile (``FIRST_COMPILE_S``); shorter runs stay eager and measure nothing;
- a failed compile (no C++ compiler, an unsupported op) falls back to eager with one warning line, and ``auto``
  remembers it for this machine.

What is compiled: the network's forward in the training step, at the run's batch size (``dynamic=False``); the
loss (ultralytics' target assignment) stays eager, as in ultralytics' own trainer, and so do validation and a last,
smaller batch (each would be one more compile).  The module is compiled as a function of its bound ``forward``, so
its state dict, checkpoints and resume are those of an eager run.  A multi-process (DDP) run stays eager under
``auto`` (every rank would measure its own CPU); ``on`` compiles on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from retrain.config import TrainParams
from retrain.device import cpu_name, on_cuda
from retrain.fsutil import write_atomic
from retrain.training.trainer import fastest, measurement_key, multi_process, resolve_precision

log = logging.getLogger(__name__)

#: The best saving per step any CPU has shown (bench/RESULTS.md: 1.24x on an Intel Xeon, 1.18x on an AMD EPYC).
BEST_SAVING = 0.2
#: What a first compile of yolo11n's training graph costs before this machine has measured it (104 s on the Xeon,
#: 182 s on the EPYC in bench/RESULTS.md); used only to decide whether measuring can pay.
FIRST_COMPILE_S = 100.0

def inductor_folder(cache: Path) -> Path:
    """Where the run's compiled artefacts are (nothing is changed): ``TORCHINDUCTOR_CACHE_DIR`` where it names
    another folder than inductor's default (a folder the user chose), else the workspace's
    ``cache/inductor/torch-<version>-<ISA>-<cpu>``.

    One folder per torch version, vector ISA and CPU model: inductor's FX-graph key holds no CPU description, and a
    workspace's cache may travel (a copied workspace, a shared volume).
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    isa = torch.backends.cpu.get_cpu_capability()
    cpu = hashlib.sha256(cpu_name().encode()).hexdigest()[:8]
    return (cache / "inductor" / f"torch-{torch.__version__}-{isa}-{cpu}".replace("+", "_")).resolve()


def inductor_cache(cache: Path) -> Path:
    """Point PyTorch's compile caches at ``inductor_folder(cache)`` (made if missing).  Call before the first compile.

    Importing torch's compile stack (Lightning and ultralytics do) already wrote inductor's default
    (``/tmp/torchinductor_<user>``) into the environment, and some paths derived from it are memoised: they are
    cleared.
    """
    from torch._inductor.utils import clear_caches

    folder = inductor_folder(cache)
    folder.mkdir(parents=True, exist_ok=True)
    if os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")) != str(folder):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        clear_caches()
    return folder


@dataclass(frozen=True)
class Plan:
    """What a run decides about compiling.

    Attributes:
        compile: Train through the compiled forward.
        measure: Time eager and compiled steps first (no measurement yet on this machine, or ``on``).
        reason: One line for the log and ``reports/train.json``.
    """

    compile: bool
    measure: bool
    reason: str


def decide(mode: str, steps: int, known: dict[str, Any] | None, cached: bool, eager_s: float | None = None,
           multi_process: bool = False) -> Plan:
    """The plan for ``mode`` (``auto``/``on``/``off``) and a run of ``steps`` planned training steps.

    Args:
        known: This machine's measurement for the run's key (``None``: not measured).
        cached: Whether the inductor cache folder holds compiled artefacts already.
        eager_s: Seconds of an eager step, where known without a measurement (for the "could it pay" bound).
        multi_process: A DDP run.
    """
    if mode == "off":
        return Plan(False, False, "compile: off")
    if mode == "on":
        return Plan(True, True, "compile: on")
    if multi_process:
        return Plan(False, False, "compile: auto: eager in a multi-process run (every rank would measure its own CPU)")
    if known is not None and known.get("failed"):
        return Plan(False, False, f"compile: auto: eager; compiling failed on this machine before ({known['failed']})")
    if known is not None and "compiled_s" in known:
        saving = float(known["eager_s"]) - float(known["compiled_s"])
        cost = float(known["compile_s_cached"] if cached and "compile_s_cached" in known else known["compile_s"])
        pays = saving > 0 and steps * saving > cost
        return Plan(pays, False, f"compile: auto: {'compiled' if pays else 'eager'}: {steps} steps x {saving:+.3f} s "
                    f"saved per step (measured: eager {float(known['eager_s']):.3f} s, compiled "
                    f"{float(known['compiled_s']):.3f} s) {'>' if pays else '<='} {cost:.0f} s to compile"
                    f"{' from the cache' if cached and 'compile_s_cached' in known else ''}")
    if eager_s is None and known is not None and "eager_s" in known:
        eager_s = float(known["eager_s"])
    if eager_s is None:
        return Plan(False, False, "compile: auto: eager (no step time to judge by)")
    bound = steps * eager_s * BEST_SAVING
    if bound <= FIRST_COMPILE_S:
        return Plan(False, False, f"compile: auto: eager: {steps} steps of {eager_s:.2f} s could save at most "
                    f"{bound:.0f} s, less than a first compile (~{FIRST_COMPILE_S:.0f} s); not measured")
    return Plan(True, True, f"compile: auto: measuring: {steps} steps of {eager_s:.2f} s could save up to "
                f"{bound:.0f} s")


def read_known(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        got = json.loads(path.read_text())
        if isinstance(got, dict):
            return got
    return {}


@dataclass(frozen=True)
class Setting:
    """The shape of the run's training steps, which a measurement reproduces.

    Attributes:
        imgsz: Image size.
        batch: Images per step.
        classes: Classes of the head.
        autocast: The autocast dtype of the run's precision (``None``: full precision).
        memory_format: NCHW or channels_last.
        device: Where the run trains.
    """

    imgsz: int
    batch: int
    classes: int
    autocast: torch.dtype | None = None
    memory_format: torch.memory_format = torch.contiguous_format
    device: torch.device = torch.device("cpu")


def _dummy_batch(s: Setting) -> dict[str, torch.Tensor]:
    """A batch of noise with three boxes an image: the shapes and dtypes of the real training batches."""
    g = torch.Generator().manual_seed(0)
    per = 3
    data = {"img": torch.rand(s.batch, 3, s.imgsz, s.imgsz, generator=g),
            "batch_idx": torch.arange(s.batch).repeat_interleave(per).float(),
            "cls": torch.randint(0, max(1, s.classes), (s.batch * per, 1), generator=g).float(),
            "bboxes": torch.rand(s.batch * per, 4, generator=g) * 0.4 + 0.3}
    return {k: v.to(s.device) for k, v in data.items()}


@contextlib.contextmanager
def _restored(model: torch.nn.Module) -> Iterator[None]:
    """Put the weights and buffers (BatchNorm's running statistics) back, and drop the gradients, after timing."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    was_training = model.training
    try:
        yield
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def _step(model: Any, forward: Callable[[torch.Tensor], Any], data: dict[str, torch.Tensor], s: Setting) -> float:
    cuda = s.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(s.device)
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    # As Lightning's mixed-precision plugin enters it (cache_enabled=False): the autocast state is part of the
    # compiled graph's guards, and another one would compile again at the first real step.
    with torch.autocast(s.device.type, dtype=s.autocast or torch.float32, enabled=s.autocast is not None,
                        cache_enabled=False):
        preds = forward(data["img"].contiguous(memory_format=s.memory_format))
        loss, _ = model.loss(data, preds)
    loss.sum().backward()
    if cuda:
        torch.cuda.synchronize(s.device)
    return time.perf_counter() - t0


def eager_step_seconds(model: Any, s: Setting) -> float:
    """The fastest eager training step (forward, ultralytics' loss, backward; ``trainer.fastest``)."""
    data = _dummy_batch(s)
    with _restored(model):
        model.train()
        return fastest(lambda: _step(model, model, data, s))[1]


@dataclass(frozen=True)
class Compiled:
    """A compiled forward and what compiling it measured.

    Attributes:
        forward: The compiled ``model.forward`` (``None``: compiling failed).
        compile_s: Seconds the first compiled step took beyond an eager one (the compile, cold or from the cache).
        step_s: Seconds of a compiled step (the fastest after the compile; ``trainer.fastest``).
        error: Why compiling failed.
    """

    forward: Callable[[torch.Tensor], Any] | None
    compile_s: float
    step_s: float
    error: str | None = None


def compile_forward(model: Any, s: Setting, eager_s: float, multi_process: bool = False) -> Compiled:
    """Compile ``model.forward`` for training batches of ``batch`` images and time it on a noise batch.

    The compile (the forward and the backward, which torch compiles lazily at the first ``backward()``) happens
    here, so a failure is met before the fit: it returns ``forward=None`` and the error, with dynamo's state reset.
    The model's weights, buffers and gradients are as they were afterwards.
    """
    if multi_process:
        # One graph per rank (DDP's reducer still overlaps nothing on CPU cores); dynamo's DDP optimizer would split
        # the graph at each gradient bucket and compile every piece.
        torch._dynamo.config.optimize_ddp = False
    forward = torch.compile(model.forward, dynamic=False)
    data = _dummy_batch(s)
    try:
        with _restored(model):
            model.train()
            first, step = fastest(lambda: _step(model, forward, data, s))
    except Exception as e:  # any compile error: BackendCompilerFailed, CppCompileError, Unsupported, ...
        torch.compiler.reset()
        line = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        return Compiled(None, math.nan, math.nan, f"{type(e).__name__}: {line[:160]}")
    return Compiled(forward, max(0.0, first - eager_s), step)


def record(path: Path, run_key: str, known: dict[str, Any] | None, eager_s: float, got: Compiled | None,
           cached: bool) -> dict[str, Any]:
    """Write this measurement into ``path`` (atomic; ``got=None``: the eager step alone); returns the key's entry."""
    entry = dict(known or {})
    if got is None:
        entry["eager_s"] = round(eager_s, 4)
    elif got.forward is None:
        entry = {"failed": got.error}
    else:
        entry.update({"eager_s": round(eager_s, 4), "compiled_s": round(got.step_s, 4)})
        entry["compile_s_cached" if cached and "compile_s" in entry else "compile_s"] = round(got.compile_s, 1)
        entry.pop("failed", None)
    table = read_known(path)
    table[run_key] = entry
    write_atomic(path, json.dumps(table, indent=1, sort_keys=True))
    return entry


def has_artefacts(folder: Path) -> bool:
    """Whether the inductor cache folder holds a compiled FX graph already."""
    graphs = folder / "fxgraph"
    return graphs.is_dir() and any(graphs.iterdir())


def choose(cache: Path, mode: str, p: TrainParams, model: Any, classes: int, channels_last: bool, steps: int,
           main_process: bool = True) -> tuple[Callable[[torch.Tensor], Any] | None, dict[str, Any]]:
    """``runtime.compile`` for a run of ``steps`` planned training steps of ``model`` (on the device it trains on,
    where it is moved): the compiled forward to train through, or ``None``; and what was chosen and why, for the log
    and the report (``{"compiled", "reason", "compile_s"}``).  Measurements go to ``cache/compile.json`` (written by
    the main process only), compiled artefacts to ``cache/inductor/``.
    """
    if mode == "off":
        return None, {"compiled": False, "reason": "compile: off", "compile_s": None}
    folder = inductor_folder(cache)  # pointed at only when this run compiles
    precision = resolve_precision(p)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_cuda(p) else torch.device("cpu")
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
    s = Setting(p.imgsz, p.batch, classes, dtype if "mixed" in precision else None,
                torch.channels_last if channels_last else torch.contiguous_format, device)
    model.to(device)
    table = cache / "compile.json"
    run_key = measurement_key(model, f"{p.imgsz} px", f"batch {p.batch}", precision,
                              "channels_last" if channels_last else "NCHW", device=device)
    known = read_known(table).get(run_key)
    cached = has_artefacts(folder)
    multi = multi_process(p)
    eager_s = None
    if mode == "auto" and known is None and not multi:  # timed once per key: the bound on what compiling can save
        eager_s = eager_step_seconds(model, s)
        if main_process:
            known = record(table, run_key, None, eager_s, None, cached)
    plan = decide(mode, steps, known, cached, eager_s, multi)
    log.info(plan.reason)
    if not plan.compile:
        return None, {"compiled": False, "reason": plan.reason, "compile_s": None}
    if eager_s is None:
        eager_s = float(known["eager_s"]) if known and "eager_s" in known else eager_step_seconds(model, s)
    inductor_cache(cache)
    got = compile_forward(model, s, eager_s, multi)
    if main_process:
        record(table, run_key, known, eager_s, got, cached)
    if got.forward is None:
        log.warning("compile: failed (%s); training eagerly", got.error)
        return None, {"compiled": False, "reason": f"compile failed: {got.error}", "compile_s": None}
    reason = (f"compile: compiled in {got.compile_s:.1f} s{' from the cache' if cached else ''}; a step "
              f"{got.step_s:.3f} s compiled, {eager_s:.3f} s eager")
    if plan.measure and mode == "auto" and got.step_s >= eager_s:
        reason += ": not faster on this machine, training eagerly (remembered)"
        log.info(reason)
        return None, {"compiled": False, "reason": reason, "compile_s": round(got.compile_s, 1)}
    log.info(reason)
    return got.forward, {"compiled": True, "reason": reason, "compile_s": round(got.compile_s, 1)}
