"""``retrain train``: fine-tune a candidate on the whole master (old and new batches together).

The run: resolve the warm start (the champion it is given, else ``base_model``, else scratch); resume from
``models/checkpoints/last.ckpt`` when it was written for the same data and params (falling back to
``last.prev.ckpt`` when the newest is damaged, starting fresh, and saying why, when they differ); fit with
Lightning; score the best checkpoint's EMA and raw weights with pycocotools; export the EMA weights as a
small, safe model file in ``models/candidate/``; write ``reports/train.json``.  The champion and where the MLflow run
goes come in from the command that runs the stage (it resolves them in the registry); this stage reads no registry.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, MLFlowLogger

from retrain.config import WARM_PLAN_LOG, Params, TrainParams
from retrain.data.master import Master, load_master, verify_images
from retrain.detector.files import ModelFile, load_model_file, save_model_file, warm_start
from retrain.detector.model import build_model
from retrain.detector.predict import predict_loader
from retrain.detector.registered import RegisteredModel
from retrain.device import cpu_threads
from retrain.errors import RetrainError
from retrain.fsutil import replace_dir
from retrain.metrics.coco import MetricsRecord, score
from retrain.paths import Paths
from retrain.training import compiled, hugepages
from retrain.training.callbacks import LAST, PREVIOUS
from retrain.training.datamodule import MasterDataModule
from retrain.training.module import DetectorModule
from retrain.training.report import TrainReport
from retrain.training.trainer import build_trainer, keep_freed_memory, machine_cache, use_channels_last
from retrain.validation.verdict import require_validated
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)

class CheckpointError(RetrainError):
    """Every checkpoint of the interrupted run is damaged: resuming is impossible, restarting is not silent."""


@dataclass(frozen=True)
class TrainResult:
    """A finished training.

    Attributes:
        candidate: The exported model file.
        report: What ``reports/train.json`` holds.
    """

    candidate: Path
    report: TrainReport


@dataclass(frozen=True)
class RunLog:
    """Where the training's MLflow run goes (Lightning's ``MLFlowLogger``).

    Attributes:
        tracking_uri: The tracking store.
        artifact_location: Artifact location for a new experiment (``None``: the tracking server decides).
        experiment: Experiment name.
    """

    tracking_uri: str
    artifact_location: str | None
    experiment: str


def fingerprint(data_version: str, params: TrainParams, base: dict[str, Any]) -> dict[str, str]:
    """What a checkpoint must match to be resumed: data version, params hash, warm-start source.

    Only the ``train`` section counts: the ``runtime`` section (threads, loaders, cache) changes speed, not results.
    """
    text = json.dumps({"params": params.model_dump(mode="json"), "base": base}, sort_keys=True)
    return {"data_version": data_version, "params": hashlib.sha256(text.encode()).hexdigest()[:16],
            "base": json.dumps(base, sort_keys=True)}


def _why_fresh(old: dict[str, Any], new: dict[str, str]) -> str:
    changed = [k for k in ("data_version", "params", "base") if old.get(k) != new[k]]
    words = {"data_version": "the data version changed", "params": "the training params changed",
             "base": "the warm-start model changed"}
    return "; ".join(words[k] for k in changed) or "the checkpoint has no run fingerprint"


def find_resume(ckpt_dir: Path, fp: dict[str, str]) -> tuple[Path | None, dict[str, Any]]:
    """The checkpoint to resume from, and the run info it recorded (MLflow run id, ...).

    Returns ``(None, {})`` when there is none, or when it belongs to other data or params (the log says why).

    Raises:
        CheckpointError: Checkpoints exist but none can be read.
    """
    if ckpt_dir.is_dir() and _is_main_process():
        for tmp in ckpt_dir.glob(".*.tmp"):  # a save cut short by a kill: never renamed into place, never read
            log.warning("removing %s: a checkpoint save that did not finish", tmp)
            tmp.unlink(missing_ok=True)
    found = [p for p in (ckpt_dir / LAST, ckpt_dir / PREVIOUS) if p.is_file()]
    damaged: list[Path] = []
    for path in found:
        try:
            ck = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            log.error("checkpoint %s is damaged (%s: %s)", path, type(e).__name__, str(e).splitlines()[0][:120])
            damaged.append(path)
            continue
        meta = ck.get("retrain", {}) if isinstance(ck, dict) else {}
        if {k: meta.get(k) for k in fp} != fp:
            log.warning("not resuming from %s: %s; starting fresh", path, _why_fresh(meta, fp))
            return None, {}
        for d in damaged if _is_main_process() else ():
            d.rename(d.with_name(f"{d.name}.damaged-{int(time.time())}"))
        if damaged:
            log.warning("falling back to the previous good checkpoint %s", path)
        log.info("resuming from %s: epoch %d done, global step %d", path, ck["epoch"] + 1, ck["global_step"])
        return path, {**meta, "global_step": int(ck["global_step"])}
    if damaged:
        raise CheckpointError(f"{ckpt_dir}: every checkpoint is damaged ({', '.join(p.name for p in damaged)}); "
                              f"nothing to resume from. Delete {ckpt_dir} to train from the start")
    return None, {}


def resolve_base(paths: Paths, params: Params, champion: RegisteredModel | None
                 ) -> tuple[ModelFile | None, dict[str, Any]]:
    """The warm-start weights: the champion, else ``train.base_model``, else none (scratch)."""
    if params.train.use_champion and champion is not None:
        log.info("warm start from the champion: models:/%s@champion (version %s)", champion.name, champion.version)
        return load_model_file(champion.weights), {"kind": "champion", "model": champion.name,
                                                   "version": champion.version}
    if params.train.base_model:
        path = (paths.root / params.train.base_model).resolve()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        log.info("warm start from %s (no champion%s)", params.train.base_model,
                 "" if params.train.use_champion else ": use_champion is off")
        return load_model_file(path), {"kind": "file", "path": params.train.base_model, "sha256": digest}
    log.info("training from scratch: no champion%s and no base_model", "" if params.train.use_champion else
             " (use_champion is off)")
    return None, {"kind": "scratch"}


def class_runs(base: ModelFile | None) -> dict[str, int]:
    """The runs each class of ``base`` has trained in since it arrived new to a champion (its file's
    ``class_runs``); classes of a from-scratch model, or of a file without the record, are not counted: established."""
    runs = base.meta.get("class_runs") if base is not None else None
    if not isinstance(runs, dict):
        return {}
    return {str(k): int(v) for k, v in runs.items() if isinstance(v, int) and not isinstance(v, bool)}


def next_class_runs(base: ModelFile | None, names: tuple[str, ...]) -> dict[str, int]:
    """``class_runs`` of the model this run makes: a class new to ``base`` has had 1 run, a counted one one more."""
    if base is None:
        return {}
    counted = class_runs(base)
    return {n: 1 if n not in base.names else counted[n] + 1 for n in names if n not in base.names or n in counted}


def young_classes(p: TrainParams, base_info: dict[str, Any], base: ModelFile | None, names: tuple[str, ...]
                  ) -> dict[str, int]:
    """Classes in their first ``warm.new_class_runs`` runs since they arrived new to the champion, with the count this
    run gives them; none unless the run starts from the champion with ``train.warm`` on."""
    if base_info.get("kind") != "champion" or p.warm is False:
        return {}
    return {n: run for n, run in next_class_runs(base, names).items() if run <= p.warm.new_class_runs}


def schedule(p: TrainParams, base_info: dict[str, Any], base: ModelFile | None = None,
             names: tuple[str, ...] = ()) -> TrainParams:
    """The run's schedule: ``train.warm`` applied when the run starts from the champion (never more epochs than
    ``train.epochs``), else ``train`` as it is.

    A class new to the champion starts with a fresh head row: the run that brings it takes the full schedule on every
    train image (no replay, see ``known_batches``), and so do the next ``warm.new_class_runs`` - 1 (in
    ``bench/retrain_cost.py`` a new class learned in 12 warm epochs scored 0.00 where the full schedule reached 0.27,
    at 20 warm epochs after its first run it stayed at 0.18-0.52 where full runs reached 0.53-0.77, and with the full
    schedule on a replayed sample 0.40-0.61).
    """
    if base_info.get("kind") != "champion" or p.warm is False:
        return p
    w = p.warm
    young = young_classes(p, base_info, base, names)
    if young:
        log.info("classes new to the champion or in their first %d runs (%s): the full schedule (train.epochs) on "
                 "every train image, not train.warm and train.replay", w.new_class_runs,
                 ", ".join(f"{n}: run {run}" for n, run in young.items()))
        return p
    log.info(WARM_PLAN_LOG, min(w.epochs, p.epochs), w.lr, w.warmup_epochs, w.close_mosaic)
    return p.model_copy(update={"epochs": min(w.epochs, p.epochs), "lr": w.lr, "warmup_epochs": w.warmup_epochs,
                                "augment": p.augment.model_copy(update={"close_mosaic": w.close_mosaic})})


def known_batches(p: TrainParams, base: ModelFile | None, base_info: dict[str, Any], names: tuple[str, ...]
                  ) -> list[str] | None:
    """The batches the champion trained on, when replay sampling applies; ``None``: every epoch covers everything
    (no champion, ``replay: off``, or a class in its first ``warm.new_class_runs`` runs: ``schedule`` says so)."""
    if base is None or base_info.get("kind") != "champion" or p.replay is False:
        return None
    if young_classes(p, base_info, base, names):
        return None
    known = base.meta.get("batches")
    if not isinstance(known, list):
        log.warning("replay: the champion's model file does not say which batches it trained on (an earlier retrain "
                    "made it): every epoch covers the whole train split")
        return None
    return [str(b) for b in known]


def _model_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``DetectionModel`` part of a LightningModule state dict."""
    return {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}


def _is_main_process() -> bool:
    """False in the processes of ranks > 0: those Lightning's DDP launcher starts (they rerun this command), and
    those another launcher started on this or another node (``torchrun`` sets ``RANK``)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def _metrics_until(path: Path, step: int) -> list[dict[str, float]]:
    """The rows of the per-epoch CSV logged before ``step`` (the resumed checkpoint's), as CSVLogger queues them."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        rows = [{k: int(float(v)) if k in ("epoch", "step") else float(v) for k, v in row.items() if v}
                for row in csv.DictReader(f)]
    # Lightning logs an epoch's end-of-epoch rows at (global step - 1); rows at the checkpoint's global step were
    # logged when the next, interrupted, epoch began, and the resumed run logs them again.
    return [r for r in rows if r.get("step", step) < step]


def _loggers(paths: Paths, run_log: RunLog, fp: dict[str, str], run_id: str | None, resumed_step: int | None
             ) -> list[Any]:
    kept = [] if resumed_step is None else _metrics_until(paths.train_metrics, resumed_step)
    table = CSVLogger(save_dir=str(paths.reports), name="train", version="", flush_logs_every_n_steps=1)
    if kept and _is_main_process():  # Lightning empties the file on start; a resumed run keeps its epochs
        table.experiment.metrics[:0] = kept
    mlf = MLFlowLogger(experiment_name=run_log.experiment, tracking_uri=run_log.tracking_uri,
                       run_name=f"train data {fp['data_version'][:12]}", run_id=run_id,
                       artifact_location=run_log.artifact_location,
                       tags={"retrain.stage": "train", "retrain.data_version": fp["data_version"],
                             "retrain.params_hash": fp["params"]})
    return [mlf, table]


def _score(module: Any, loader: Any, dm: MasterDataModule, sd: dict[str, torch.Tensor], p: TrainParams
           ) -> MetricsRecord:
    module.model.load_state_dict(_model_state(sd))
    dets = predict_loader(module.model, loader, dm.val_image_ids, dm.master.category_ids,
                          p.nms_conf, p.nms_iou, p.max_det)
    return score(module.gt, dets).record()


def _export(paths: Paths, master: Master, p: TrainParams, sd: dict[str, torch.Tensor], yaml: dict[str, Any],
            meta: dict[str, Any]) -> Path:
    staging = paths.staging / f"candidate-{time.time_ns()}"
    save_model_file(staging / "model.pt", ModelFile(_model_state(sd), yaml, master.names, p.imgsz, meta))
    replace_dir(staging, paths.candidate)
    return paths.candidate / "model.pt"


def train(paths: Paths, params: Params, champion: RegisteredModel | None, run_log: RunLog,
          callbacks: list[Any] | None = None) -> TrainResult | None:
    """Train a candidate on ``data/master`` and export it to ``models/candidate/model.pt``.

    Args:
        paths: The workspace.
        params: All params (``train``; ``runtime`` for threads, loaders and the image cache).
        champion: The registry's champion to warm-start from, or ``None``.
        run_log: Where the MLflow run goes.
        callbacks: More Lightning callbacks (the throughput benchmark's timer, for instance).

    Returns:
        The result on the main process; ``None`` on the other ranks of a multi-process run.

    Raises:
        RetrainError: No master, an unsafe or damaged model file, every checkpoint damaged.
    """
    require_workspace(paths)
    p = params.train
    torch.set_num_threads(cpu_threads(params.runtime))  # importing ultralytics set OMP_NUM_THREADS=1
    keep_freed_memory()  # steady training steps without page faults
    log.info(hugepages.describe(params.runtime.hugepages))
    master = load_master(paths.master, paths.data)
    require_validated(paths, master.version)
    log.info("data: %d images re-hashed, all as ingested", verify_images(master))
    base, base_info = resolve_base(paths, params, champion)
    fp = fingerprint(master.version, p, base_info)
    resume, meta = find_resume(paths.checkpoints, fp)
    if resume is None and _is_main_process():
        shutil.rmtree(paths.checkpoints, ignore_errors=True)  # a fresh run: nothing of an older one may be read
    pl.seed_everything(p.seed, workers=True, verbose=False)  # the initial weights and fresh head rows too
    model = build_model(p.model, master.names)
    transfer = warm_start(model, base) if base is not None and resume is None else None
    sched = schedule(p, base_info, base, master.names)
    dm = MasterDataModule(master, sched, params.runtime, paths.cache, known_batches(p, base, base_info, master.names))
    dm.setup("fit")
    channels_last = use_channels_last(p, model, paths.cache / "memory-format.json", machine_cache())
    run_p = sched.model_copy(update={"channels_last": "on" if channels_last else "off"})
    if base is not None and p.warmup_bias_lr:
        # A warm start's biases are fitted already: a high warm-up LR on them (50x lr for AdamW) undid most of a
        # champion's old-class AP in the first epoch (bench/RESULTS.md, "measured in development"). They warm up from 0.
        log.info("warm start: biases warm up from 0, not from warmup_bias_lr %g", p.warmup_bias_lr)
        run_p = run_p.model_copy(update={"warmup_bias_lr": 0.0})
    module = DetectorModule(model, master, run_p)
    module.image_ids = dm.val_image_ids
    # Forward passes left (a resumed run's global step counts optimizer steps, each `accumulate` batches).
    steps = len(dm.train_dataloader()) * sched.epochs - int(meta.get("global_step", 0)) * p.accumulate
    module.compiled_forward, compile_info = compiled.choose(paths.cache, params.runtime.compile, run_p, model,
                                                            len(master.names), channels_last, max(0, steps),
                                                            _is_main_process())
    loggers = _loggers(paths, run_log, fp, meta.get("mlflow_run_id"), meta.get("global_step"))
    module.run_meta = {**fp, "mlflow_run_id": loggers[0].run_id}
    trainer = build_trainer(run_p, paths.checkpoints, loggers, callbacks, params.runtime.checkpoint_every_s)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=str(resume) if resume else None)
    seconds = time.perf_counter() - t0
    if not trainer.is_global_zero:
        return None
    best = paths.checkpoints / "best.ckpt"
    ck = torch.load(best if best.is_file() else paths.checkpoints / LAST, map_location="cpu", weights_only=True)
    loader = dm.eval_dataloader()  # one loader (its worker processes start once) for both scorings
    ema, raw = _score(module, loader, dm, ck["state_dict"], p), _score(module, loader, dm, ck["current_model_state"], p)
    report = TrainReport(
        data_version=master.version, params_hash=fp["params"], warm_start=base_info,
        transferred=None if transfer is None else vars(transfer) | {"kept_classes": list(transfer.kept_classes),
                                                                    "new_classes": list(transfer.new_classes)},
        resumed_from=str(resume.name) if resume else None, epochs=trainer.current_epoch,
        best_epoch=int(ck["epoch"]) + 1, seconds=round(seconds, 1), ema=ema, raw=raw,
        mlflow_run_id=loggers[0].run_id, precision=str(trainer.precision), classes=list(master.names),
        batches=[str(b) for b in master.doc.get("info", {}).get("batches", [])],
        schedule={"warm": sched is not p, "epochs": sched.epochs, "lr": sched.lr},
        class_runs=next_class_runs(base, master.names),
        replay=None if dm.replay is None else {
            "new_batches": dm.replay.new_batches, "new_images": len(dm.replay.new), "old_images": len(dm.replay.old),
            "old_per_epoch": dm.replay.old_per_epoch, "min_per_class": dm.replay.min_per_class},
        compile=compile_info)
    candidate = _export(paths, master, p, ck["state_dict"], dict(model.yaml), report.to_json())  # type: ignore[arg-type]
    report.write(paths.train_report)
    loggers[0].log_metrics({"final/ema_mAP50-95": ema.map, "final/raw_mAP50-95": raw.map})
    for name in (LAST, PREVIOUS):  # finished: nothing left to resume; best.ckpt stays for inspection
        (paths.checkpoints / name).unlink(missing_ok=True)
    log.debug("candidate %s: EMA mAP50-95 %.4f (raw %.4f), mAP50 %.4f, best epoch %d of %d", candidate,
             ema.map, raw.map, ema.map50, report.best_epoch, report.epochs)
    return TrainResult(candidate, report)
