"""``reports/train.json``: what ``retrain train`` wrote, as the other stages and the flow read it."""

from __future__ import annotations

from typing import Any, ClassVar

from retrain.metrics.coco import MetricsRecord
from retrain.reports import Report


class TrainReport(Report):
    """A finished training (DVC metrics).

    Attributes:
        data_version: sha256 of the master's ``annotations.json`` it trained on (``Master.version``).
        params_hash: Hash of the ``train`` params that change results (with the warm start).
        warm_start: Where the first weights came from: ``{"kind": "champion"|"file"|"scratch", ...}``.
        transferred: What the warm start carried over (tensors, kept and new classes); ``None`` when resumed or
            from scratch.
        resumed_from: The checkpoint it resumed from, if any.
        epochs: Epochs trained (early stopping may end sooner than ``train.epochs``).
        best_epoch: The epoch of the best val mAP50-95 (the exported weights).
        seconds: Wall time of the fit.
        ema: The best checkpoint's EMA weights on the val split (exported as the candidate).
        raw: Its raw weights on the same images.
        mlflow_run_id: The MLflow run of this training.
        precision: Lightning's precision (``32-true``, ``bf16-mixed``).
        classes: Class names, in class-index order.
        batches: The batches of the master it trained on (the candidate's model file keeps this report: as the
            champion, it tells the audit which batches are new to it); ``None`` in reports of an earlier retrain.
        schedule: The run's schedule: ``{"warm": bool, "epochs", "lr"}`` (``train.warm`` applies to a warm start
            from the champion).
        class_runs: Per class that arrived new to a champion, the runs it has trained in since (this one
            included); ``train.warm.new_class_runs`` reads it from the champion's model file.
        replay: Replay sampling, when it applied: the new batches, new and older train images, older images per
            epoch, boxes kept per older class.
        compile: ``runtime.compile``'s choice: ``{"compiled": bool, "reason": str, "compile_s": float | None}``
            (``compile_s``: what this run spent compiling, from the cache or not).
    """

    what: ClassVar[str] = "train report"

    data_version: str
    params_hash: str
    warm_start: dict[str, Any]
    transferred: dict[str, Any] | None
    resumed_from: str | None
    epochs: int
    best_epoch: int
    seconds: float
    ema: MetricsRecord
    raw: MetricsRecord
    mlflow_run_id: str | None
    precision: str
    classes: list[str]
    batches: list[str] | None = None
    schedule: dict[str, Any] | None = None
    class_runs: dict[str, int] | None = None
    replay: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
