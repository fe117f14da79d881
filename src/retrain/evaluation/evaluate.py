"""``retrain evaluate``: the champion and the candidate on the same images, scored by the same code.

Both models predict on the master's test split, the images no training choice looked at (``detector.predict``:
ultralytics' NMS with the ``evaluate`` settings, boxes mapped back to each original image); ``metrics.score``
scores them with pycocotools overall, per class, per object size and per origin batch, and the per-image matches
feed a paired bootstrap of the mAP50-95 delta.  The same two models on val are reported beside: val picked the
candidate's checkpoint, so it flatters the candidate, and the gate never reads it.  A master without test images
(``merge.test_fraction: 0``) is judged on val, and the report says so.  Writes ``reports/eval.json`` (DVC metrics),
``reports/eval.md`` and PNG plots in ``reports/plots/``.  The champion comes in as a model file (the command
resolves it in the registry); this stage reads no registry.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from retrain.config import Params
from retrain.data.master import Master, load_master
from retrain.detector.files import ModelFile, load_model_file
from retrain.detector.predict import Nms, predict_split
from retrain.detector.registered import RegisteredModel
from retrain.device import cpu_threads
from retrain.errors import RetrainError
from retrain.evaluation.render import markdown, plots
from retrain.evaluation.report import Candidate, Champion, Delta, EvalReport, ValSide
from retrain.fsutil import replace_dir, write_atomic
from retrain.metrics.bootstrap import matches, paired_delta_interval
from retrain.metrics.coco import SIZES, Score, SliceMetrics, ground_truth, score, size_of
from retrain.paths import Paths
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)


def _slices(master: Master, split: str) -> dict[str, list[int]]:
    """Origin batch -> its image ids in ``split``."""
    out: dict[str, list[int]] = {}
    for im in master.images(split):
        out.setdefault(str(im.get("batch", "unknown")), []).append(int(im["id"]))
    return dict(sorted(out.items()))


def _predict(mf: ModelFile, master: Master, split: str, params: Params, cache_dir: Path) -> list[dict[str, Any]]:
    e = params.evaluate
    return predict_split(mf, master, split, Nms(e.conf, e.iou, e.max_det), e.batch, params.train, params.runtime,
                         cache_dir)


def _score(mf: ModelFile, master: Master, split: str, gt: Any, params: Params, cache_dir: Path) -> Score:
    """``mf`` on ``split``, scored against ``gt`` (that split's ground truth, built once for both models)."""
    return score(gt, _predict(mf, master, split, params, cache_dir), _slices(master, split))


def judged_split(master: Master) -> str:
    """``test`` when the master has test images, else ``val``."""
    return "test" if master.images("test") else "val"


def evaluate_models(paths: Paths, params: Params, champion: RegisteredModel | None) -> EvalReport:
    """Evaluate the candidate (``models/candidate``) and ``champion`` on the master's test split (val beside).

    Args:
        paths: The workspace.
        params: All params (``evaluate``; ``train`` for the device; ``runtime`` for threads and loaders).
        champion: The registry's champion as a local model file, or ``None`` when there is none.

    Returns:
        The report (also written to ``reports/eval.json``, ``reports/eval.md`` and ``reports/plots``).

    Raises:
        RetrainError: No master or candidate, a candidate trained on another master, an unsafe model file.
    """
    require_workspace(paths)
    torch.set_num_threads(cpu_threads(params.runtime))
    master = load_master(paths.master, paths.data)
    candidate_file = paths.candidate / "model.pt"
    if not candidate_file.is_file():
        raise RetrainError(f"{candidate_file}: no candidate; run 'retrain train' (or 'dvc repro') first")
    candidate = load_model_file(candidate_file)
    trained_on = candidate.meta.get("data_version")
    if trained_on != master.version:
        raise RetrainError(f"{candidate_file}: trained on data {str(trained_on)[:12]}, but the master is "
                           f"{master.version[:12]}; run 'retrain train' on this master first")
    split = judged_split(master)
    gt = ground_truth(master.doc, split)
    instances = Counter(gt.cats[a["category_id"]]["name"] for a in gt.dataset["annotations"])
    sized = Counter((gt.cats[a["category_id"]]["name"], size_of(a["area"])) for a in gt.dataset["annotations"])
    gt_val = ground_truth(master.doc, "val") if split != "val" else None
    t0 = time.perf_counter()
    cand = _score(candidate, master, split, gt, params, paths.cache)
    cand_val = _score(candidate, master, "val", gt_val, params, paths.cache) if gt_val is not None else None
    champ = champ_val = None
    champ_entry = delta = None
    if champion is not None:
        champ_file = load_model_file(champion.weights)
        champ = _score(champ_file, master, split, gt, params, paths.cache)
        champ_val = _score(champ_file, master, "val", gt_val, params, paths.cache) if gt_val is not None else None
        champ_entry = Champion(version=champion.version, classes=list(champ_file.names), imgsz=champ_file.imgsz,
                               metrics=champ.record())
        delta = _delta(champ, cand, params)
    val = None
    if cand_val is not None:
        val = ValSide(images=cand_val.overall.images, candidate=_side(cand_val),
                      champion=None if champ_val is None else _side(champ_val))
    notes = [] if split == "test" else ["the master has no test images (merge.test_fraction is 0, or too few "
                                        "images): judged on val, which chose the candidate's checkpoint and so "
                                        "flatters it"]
    report = EvalReport(
        data_version=master.version, split=split, images=len(gt.getImgIds()),
        instances={n: instances.get(n, 0) for n in master.names},
        size_instances={n: {z: sized.get((n, z), 0) for z in SIZES} for n in master.names},
        candidate=Candidate(classes=list(candidate.names), imgsz=candidate.imgsz, metrics=cand.record(),
                            sha256=hashlib.sha256(candidate_file.read_bytes()).hexdigest()),
        champion=champ_entry, delta=delta, val=val, notes=notes)
    _write(paths, report, lambda folder: plots(report, None if champ is None else champ.ev, cand.ev, folder))
    if report.champion is not None:
        log.debug("champion (version %s) mAP50-95 %.4f", report.champion.version, report.champion.metrics.map)
    log.info("evaluated in %.1f s: candidate mAP50-95 %.4f on %d %s images", time.perf_counter() - t0,
             cand.overall.map, report.images, split)
    return report


def _side(s: Score) -> SliceMetrics:
    """The overall numbers of a score, as the val side of the report holds them."""
    return SliceMetrics.model_validate(s.overall.to_json())


def _delta(champ: Score, cand: Score, params: Params) -> Delta:
    e = params.evaluate
    a, b = champ.overall, cand.overall
    # A model that detected nothing has no matches: it scores 0 in every resample.
    ci = paired_delta_interval(None if champ.ev is None else matches(champ.ev),
                               None if cand.ev is None else matches(cand.ev), b.images, e.bootstrap,
                               e.confidence, e.seed)
    return Delta.model_validate({"map": b.map - a.map, "map50": b.map50 - a.map50, "map75": b.map75 - a.map75,
                                 "ar100": b.ar100 - a.ar100, "ci": (ci.low, ci.high), "confidence": e.confidence,
                                 "resamples": e.bootstrap})


def _write(paths: Paths, report: EvalReport, draw: Any) -> None:
    """Plots into a fresh folder swapped in whole; then the markdown; the metrics last (DVC reads them)."""
    staging = paths.staging / f"plots-{time.time_ns()}"
    staging.mkdir(parents=True)
    draw(staging)
    replace_dir(staging, paths.eval_plots)
    write_atomic(paths.eval_markdown, markdown(report))
    report.write(paths.eval_report)
