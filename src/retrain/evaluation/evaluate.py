"""``retrain evaluate``: the champion and the candidate on the same images, scored by the same code.

Both models predict on the master's val split (ultralytics' NMS with the ``evaluate`` settings, boxes mapped
back to each original image), pycocotools scores them overall, per class and per origin batch (the per-image
matches are reused for the slices and for a paired bootstrap of the mAP50-95 delta).  Writes
``reports/eval.json`` (DVC metrics), ``reports/eval.md`` and PNG plots in ``reports/plots/``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from retrain.config import Params
from retrain.errors import RetrainError
from retrain.evaluation.bootstrap import matches, paired_delta_interval
from retrain.evaluation.coco_eval import ground_truth, run_cocoeval, summarize
from retrain.fsutil import dumps_canonical, replace_dir, write_atomic
from retrain.paths import Paths
from retrain.training.data import Master, MasterDataModule, load_master
from retrain.training.weights import ModelFile, load_model_file
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    """A finished evaluation.

    Attributes:
        report: What ``reports/eval.json`` holds.
    """

    report: dict[str, Any]


def category_ids_for(model_names: tuple[str, ...], master: Master) -> list[int]:
    """The master's category id of each of a model's classes, matched by name (-1: the master has no such class)."""
    by_name = dict(zip(master.names, master.category_ids, strict=True))
    return [by_name.get(n, -1) for n in model_names]


@torch.no_grad()
def predict_val(mf: ModelFile, master: Master, params: Params, cache_dir: Path) -> list[dict[str, Any]]:
    """One model's detections on the master's val images, as COCO result dicts.

    The images are letterboxed to the model's own ``imgsz``; its classes are mapped to the master's by name.
    """
    from retrain.evaluation.predict import predict_loader
    from retrain.training.trainer import on_cuda

    e = params.evaluate
    tp = params.train.model_copy(update={"imgsz": mf.imgsz, "batch": e.batch, "cache": "none"})
    dm = MasterDataModule(master, tp, cache_dir)
    dm.setup("validate")
    model = mf.build()
    if on_cuda(tp):
        model = model.cuda()
    return predict_loader(model, dm.eval_dataloader(), dm.val_image_ids, category_ids_for(mf.names, master),
                          e.conf, e.iou, e.max_det)


def _slices(master: Master) -> dict[str, list[int]]:
    """Origin batch -> its val image ids."""
    out: dict[str, list[int]] = {}
    for im in master.images("val"):
        out.setdefault(str(im.get("batch", "unknown")), []).append(int(im["id"]))
    return dict(sorted(out.items()))


def _score(gt: Any, dets: list[dict[str, Any]], slices: dict[str, list[int]]) -> tuple[Any, dict[str, Any]]:
    ev = run_cocoeval(gt, dets)
    parts = {name: summarize(gt, ev, ids).to_json() for name, ids in slices.items()}
    overall = summarize(gt, ev).to_json()  # last: ev.eval then holds all images' curves (for the plots)
    overall["slices"] = parts
    overall["detections"] = len(dets)
    return ev, overall


def evaluate_models(paths: Paths, params: Params) -> EvalResult:
    """Evaluate the candidate (``models/candidate``) and the registry's champion on the master's val split.

    Args:
        paths: The workspace.
        params: All params (``evaluate``, ``train`` for devices and threads, ``registry``).

    Returns:
        The report (also written to ``reports/eval.json``, ``reports/eval.md`` and ``reports/plots``).

    Raises:
        RetrainError: No master or candidate, a candidate trained on another master, an unsafe model file.
    """
    from retrain.evaluation.report import markdown, plots
    from retrain.registry.tracking import champion, tracking_uri
    from retrain.training.trainer import cpu_threads

    require_workspace(paths)
    torch.set_num_threads(cpu_threads(params.train))
    master = load_master(paths.master, paths.data)
    candidate_file = paths.candidate / "model.pt"
    if not candidate_file.is_file():
        raise RetrainError(f"{candidate_file}: no candidate; run 'retrain train' (or 'dvc repro') first")
    candidate = load_model_file(candidate_file)
    trained_on = candidate.meta.get("data_version")
    if trained_on != master.version:
        raise RetrainError(f"{candidate_file}: trained on data {str(trained_on)[:12]}, but the master is "
                           f"{master.version[:12]}; run 'retrain train' on this master first")
    champ = champion(tracking_uri(paths.root), params.registry.model_name, paths.cache / "champion",
                     params.retrain.registry_wait)
    gt = ground_truth(master.doc, "val")
    slices = _slices(master)
    instances = Counter(gt.cats[a["category_id"]]["name"] for a in gt.dataset["annotations"])
    t0 = time.perf_counter()
    cand_ev, cand = _score(gt, predict_val(candidate, master, params, paths.cache), slices)
    report: dict[str, Any] = {
        "data_version": master.version, "images": len(gt.getImgIds()),
        "instances": {n: instances.get(n, 0) for n in master.names},
        "candidate": {"classes": list(candidate.names), "imgsz": candidate.imgsz, "metrics": cand,
                      "sha256": hashlib.sha256(candidate_file.read_bytes()).hexdigest()},
        "champion": None, "delta": None}
    champ_ev = None
    if champ is not None:
        champ_file = load_model_file(champ.weights)
        champ_ev, champ_metrics = _score(gt, predict_val(champ_file, master, params, paths.cache), slices)
        report["champion"] = {"version": champ.version, "classes": list(champ_file.names), "imgsz": champ_file.imgsz,
                              "metrics": champ_metrics}
        report["delta"] = _delta(champ_ev, cand_ev, champ_metrics, cand, params)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    _write(paths, report, markdown(report), lambda folder: plots(report, champ_ev, cand_ev, folder))
    if champ is not None:
        log.info("champion (version %s) mAP50-95 %.4f", champ.version, report["champion"]["metrics"]["mAP50-95"])
    log.info("candidate mAP50-95 %.4f on %d val images", cand["mAP50-95"], report["images"])
    return EvalResult(report)


def _delta(champ_ev: Any, cand_ev: Any, champ: dict[str, Any], cand: dict[str, Any], params: Params
           ) -> dict[str, Any]:
    e = params.evaluate
    out: dict[str, Any] = {k: cand[k] - champ[k] for k in ("mAP50-95", "mAP50", "mAP75", "AR100")}
    # A model that detected nothing has no matches: it scores 0 in every resample.
    ci = paired_delta_interval(None if champ_ev is None else matches(champ_ev),
                               None if cand_ev is None else matches(cand_ev), cand["images"], e.bootstrap,
                               e.confidence, e.seed)
    out["ci"] = [ci.low, ci.high]
    out["confidence"], out["resamples"] = e.confidence, e.bootstrap
    return out


def _write(paths: Paths, report: dict[str, Any], md: str, draw: Any) -> None:
    """Plots into a fresh folder swapped in whole; then the markdown; the metrics last (DVC reads them)."""
    staging = paths.staging / f"plots-{time.time_ns()}"
    staging.mkdir(parents=True)
    draw(staging)
    replace_dir(staging, paths.eval_plots)
    write_atomic(paths.eval_markdown, md)
    write_atomic(paths.eval_report, dumps_canonical(report))
