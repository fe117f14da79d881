"""``retrain promote``: the gate decides, and the registry records it.

Promote reads the evaluation and the training reports, lets the gate (``gate.py``, pure) decide, exports the
candidate to ONNX and checks the export against PyTorch on the val images (``export.onnx_for_version``), logs the
candidate as a pyfunc model in its training run (with the ONNX model when it matched), registers it as a new version
of the registered model with its lineage as tags (data version, git revision, params hash, parent version, metrics,
decision and reasons, ONNX sha256 and parity figures), checks that the version as the registry returns it loads and
serves (``registry.serving_check``, when the gate passed), and then, last, moves the aliases: ``challenger`` always,
``champion`` only when the gate and the serving check say so.  A failure before that leaves ``champion`` where it was.
The MLflow writes are ``registry.versions``'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from retrain.config import Params
from retrain.data.master import load_master
from retrain.device import cpu_threads
from retrain.errors import RetrainError
from retrain.evaluation.report import EvalReport
from retrain.faults import fault_point
from retrain.paths import Paths
from retrain.promotion.export import OnnxAttachment, onnx_for_version
from retrain.promotion.gate import Decision, ModelMetrics, decide
from retrain.promotion.report import PromotionReport
from retrain.registry.serving_check import serving_check
from retrain.registry.tracking import CHAMPION, WEIGHTS_NAME, client, current_champion, registry_call, tracking_uri
from retrain.registry.versions import (
    CHALLENGER,
    TAG,
    ModelSource,
    VersionRun,
    log_version,
    record_champion_move,
    redact,
    registered_version,
)
from retrain.training.report import TrainReport
from retrain.workspace import master_dvc_md5, require_workspace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromotionResult:
    """A registered candidate.

    Attributes:
        version: Its model version.
        decision: The gate's decision.
        report: What ``reports/promotion.json`` holds.
    """

    version: str
    decision: Decision
    report: PromotionReport


def metrics_from_report(report: EvalReport) -> tuple[ModelMetrics | None, ModelMetrics]:
    """The gate's view of ``reports/eval.json``: (champion or None, candidate)."""
    instances = dict(report.instances)

    def view(m: Any, ci: tuple[float, float] | None = None) -> ModelMetrics:
        return ModelMetrics(m.map, dict(m.per_class), {k: v.map for k, v in m.slices.items()}, instances, ci,
                            dict(m.sizes), {k: dict(v) for k, v in m.per_class_size.items()},
                            {k: dict(v) for k, v in report.size_instances.items()})

    ci = report.delta.ci if report.delta else None
    champ = report.champion
    return (view(champ.metrics) if champ else None), view(report.candidate.metrics, ci)


def data_lineage(root: Path) -> dict[str, str]:
    """DVC's md5 of ``data/master`` (from ``dvc.lock``) and the workspace's git revision."""
    md5 = master_dvc_md5(Paths(root)) or "not in dvc.lock"
    git = ["git", "-C", str(root)]
    rev = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return {"data_dvc_md5": md5, "git_rev": rev or "none", "git_dirty": str(bool(dirty)).lower()}


def params_hash(params: Params) -> str:
    """sha256 (16 hex) of every param, canonical JSON."""
    text = json.dumps(params.model_dump(mode="json", by_alias=True), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def promote(paths: Paths, params: Params) -> PromotionResult:
    """Register the candidate as a new model version; move ``champion`` to it only when the gate passes.

    Args:
        paths: The workspace.
        params: All params (``promote`` is the gate, ``registry`` names the model).

    Returns:
        The version, the decision and the report written to ``reports/promotion.json``.

    Raises:
        RetrainError: No evaluation or candidate, an evaluation of another candidate or champion, or the
            registry cannot be written (``champion`` has not moved then).
    """
    require_workspace(paths)
    # Threads for the ONNX export's check and the serving check, as evaluate sets them: a process started by one that
    # had imported ultralytics inherits its OMP_NUM_THREADS=1.
    torch.set_num_threads(cpu_threads(params.runtime))
    evaluation = EvalReport.read(paths.eval_report)
    train = TrainReport.read(paths.train_report)
    weights = paths.candidate / WEIGHTS_NAME
    master = load_master(paths.master, paths.data)
    if evaluation.data_version != master.version or train.data_version != master.version:
        raise RetrainError(f"{paths.eval_report}: evaluated on another master than data/master; run "
                           "'retrain evaluate' again (dvc repro does)")
    if not weights.is_file():
        raise RetrainError(f"{weights}: no candidate; run 'retrain train' first")
    if evaluation.candidate.sha256 != hashlib.sha256(weights.read_bytes()).hexdigest():
        raise RetrainError(f"{paths.eval_report}: evaluated another candidate than {weights}; run "
                           "'retrain evaluate' again (dvc repro does)")
    uri, name, wait = tracking_uri(paths.root), params.registry.model_name, params.runtime.registry_wait
    mc = registry_call("open the model registry", lambda: client(uri), wait)  # a sqlite store connects here
    parent = current_champion(mc, name, wait)
    evaluated = evaluation.champion.version if evaluation.champion else None
    if parent != evaluated:
        raise RetrainError(f"registry: {name}@{CHAMPION} is version {parent or 'none'} but the evaluation compared "
                           f"against {evaluated or 'none'}; run 'retrain evaluate' again")
    champ_metrics, cand_metrics = metrics_from_report(evaluation)
    decision = decide(champ_metrics, cand_metrics, params.promote)
    tags = _lineage_tags(paths, params, evaluation, train, parent, decision)
    key = tags[f"{TAG}promotion_key"]

    with tempfile.TemporaryDirectory(prefix="retrain-promote-") as tmp:
        exported: list[OnnxAttachment] = []

        def onnx() -> OnnxAttachment:  # once, also when the registry call is retried
            if not exported:
                exported.append(onnx_for_version(params, weights, master, paths.cache, Path(tmp)))
            return exported[0]

        def register_once() -> str:  # repeated after a failure or a kill: never a second version of one promotion
            found = registered_version(mc, name, key)
            if found is not None:
                log.info("%s version %s is this candidate already, with this evaluation and params (registered by a "
                         "run that stopped before moving the aliases); moving them now", name, found)
                for tag, value in tags.items():  # the lineage as of now (git revision ...)
                    mc.set_model_version_tag(name, found, tag, value)
                return found
            reports = [(paths.eval_report, "evaluation"), (paths.eval_markdown, "evaluation")]
            if paths.eval_plots.is_dir():
                reports.append((paths.eval_plots, "evaluation/plots"))
            attached = onnx()
            return log_version(uri, name, ModelSource(weights, train.classes, train.data_version, attached.path),
                               tags | attached.tags, _eval_metrics(evaluation),
                               VersionRun(params.registry.experiment, str(train.mlflow_run_id), paths.root), reports)

        version = registry_call(f"register {name}", register_once, wait)
    fault_point("promote.after-register")
    tags |= exported[0].tags if exported else {}
    if decision.promote:
        decision, updates = _check_serving(mc, uri, name, version, master, decision, wait)
        tags |= updates
    # Last: every failure above leaves champion untouched.
    registry_call(f"move the aliases of {name}", lambda: _move_aliases(mc, name, version, parent, decision), wait)
    report = PromotionReport(model=name, version=version, promoted=decision.promote, reasons=list(decision.reasons),
                             notes=list(decision.notes), parent_version=parent,
                             champion=version if decision.promote else parent, tags=tags, tracking_uri=redact(uri))
    report.write(paths.promotion_report)
    log_history(uri, name, version, paths.reports / "history.png")
    return PromotionResult(version, decision, report)


def _check_serving(mc: Any, uri: str, name: str, version: str, master: Any, decision: Decision,
                   wait: float) -> tuple[Decision, dict[str, str]]:
    """The gate passed: only a version that loads from the registry and serves may become champion.

    Returns:
        The decision (not to promote when the check failed) and the tags written to the version.
    """
    tags = registry_call(f"read {name} version {version}", lambda: dict(mc.get_model_version(name, version).tags),
                         wait)
    sha = {WEIGHTS_NAME: tags.get(f"{TAG}candidate_sha256", "")}
    if tags.get(f"{TAG}onnx") == "attached":
        sha["model.onnx"] = tags.get(f"{TAG}onnx.sha256", "")
    images = (master.images("val") or master.doc["images"])[:8]
    files = [master.data_root / im["file_name"] for im in images]
    check = registry_call(f"check that {name} version {version} serves",
                          lambda: serving_check(uri, name, version, files, sha), wait)
    if not check.passed:
        log.warning("%s version %s failed the serving check: %s", name, version, check.reason)
        decision = replace(decision, promote=False, reasons=(f"serving check: {check.reason}",))
    updates = {f"{TAG}serving_check": check.tag(), f"{TAG}decision": "promote" if decision.promote else "reject",
               f"{TAG}reasons": "; ".join(decision.reasons) or "every rule of the gate holds"}

    def write() -> None:
        for tag, value in updates.items():
            mc.set_model_version_tag(name, version, tag, value)

    registry_call(f"tag {name} version {version}", write, wait)
    return decision, updates


def log_history(uri: str, name: str, version: str, out: Path) -> None:
    """The model's quality history (``registry.history_plot``) drawn once to ``out`` (``reports/history.png``, which
    the flow's ``retrain-history`` artifact then shows) and logged as ``history/history.png`` of the version's run.

    A view of what the registry holds, drawn after the promotion is complete: a failure here is a warning, never a
    failed promotion (and leaves no older drawing at ``out``).
    """
    from retrain.registry.history import status
    from retrain.registry.history_plot import save

    try:
        out.unlink(missing_ok=True)
        mc = client(uri)
        run_id = mc.get_model_version(name, version).run_id
        png = save(status(uri, name), name, out)
        if run_id:
            mc.log_artifact(run_id, str(png), "history")
    except Exception as e:  # a view: the promotion above is done whatever happens here
        log.warning("the quality history of %s was not logged to MLflow (%s: %s)", name, type(e).__name__, e)


def promotion_key(candidate_sha256: str, eval_report: bytes, params_hash: str) -> str:
    """What makes one promotion: the candidate file, its evaluation (champion, metrics) and the params (the gate).

    The same key again is the same promotion cut short (a kill or a failure between registering and moving the
    aliases): its version is reused.  Another key (the gate's params changed, another champion) is a new version,
    even of the same weights.
    """
    text = json.dumps([candidate_sha256, hashlib.sha256(eval_report).hexdigest(), params_hash])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _eval_metrics(evaluation: EvalReport) -> dict[str, float]:
    """The evaluation's headline numbers as run metrics (``eval/candidate/mAP50-95`` ...)."""
    cand = evaluation.candidate.metrics
    out = {"eval/candidate/mAP50-95": cand.map, "eval/candidate/mAP50": cand.map50}
    if evaluation.champion and evaluation.delta:
        champ = evaluation.champion.metrics
        out |= {"eval/champion/mAP50-95": champ.map, "eval/champion/mAP50": champ.map50,
                "eval/delta/mAP50-95": evaluation.delta.map}
    if evaluation.val is not None:  # beside, never judged: val chose the candidate's checkpoint
        out["eval/val/candidate/mAP50-95"] = evaluation.val.candidate.map
        if evaluation.val.champion is not None:
            out["eval/val/champion/mAP50-95"] = evaluation.val.champion.map
    return out


def _lineage_tags(paths: Paths, params: Params, evaluation: EvalReport, train: TrainReport, parent: str | None,
                  decision: Decision) -> dict[str, str]:
    cand = evaluation.candidate.metrics
    tags = {
        "data_version": evaluation.data_version, **data_lineage(paths.root),
        "params_hash": params_hash(params), "train_params_hash": train.params_hash,
        "parent_version": parent or "none", "warm_start": json.dumps(train.warm_start, sort_keys=True),
        "train_run_id": str(train.mlflow_run_id),
        "candidate_sha256": evaluation.candidate.sha256,
        "promotion_key": promotion_key(evaluation.candidate.sha256, paths.eval_report.read_bytes(),
                                       params_hash(params)),
        "decision": "promote" if decision.promote else "reject", "judged_on": evaluation.split,
        "reasons": "; ".join(decision.reasons) or "every rule of the gate holds",
        "classes": ",".join(evaluation.candidate.classes),
        **{f"metric.{k}": f"{v:.6f}" for k, v in (("mAP50-95", cand.map), ("mAP50", cand.map50),
                                                  ("mAP75", cand.map75), ("AR100", cand.ar100))},
        # AP50-95 per class, for the history plot (80 classes fit the tag's 5000 characters; more are left out)
        "metric.per_class": _per_class_tag(cand.per_class),
    }
    if evaluation.delta:
        tags["metric.delta_mAP50-95"] = f"{evaluation.delta.map:.6f}"
        lo, hi = evaluation.delta.ci
        tags["metric.delta_ci"] = f"[{lo:.6f}, {hi:.6f}]"
    return {f"{TAG}{k}": v[:5000] for k, v in tags.items()}


def _per_class_tag(per_class: dict[str, float]) -> str:
    text = json.dumps({k: round(v, 4) for k, v in per_class.items()})
    return text if len(text) <= 5000 else "{}"


def _move_aliases(mc: Any, name: str, version: str, parent: str | None, decision: Decision) -> None:
    mc.set_registered_model_alias(name, CHALLENGER, version)
    if decision.promote:
        mc.set_registered_model_alias(name, CHAMPION, version)
        record_champion_move(mc, name, {"champion": version, "from": parent, "by": "promote"})
        log.debug("%s version %s is the champion (was %s)", name, version, parent or "none")
    else:
        log.debug("%s version %s registered as challenger, not promoted: %s", name, version,
                 "; ".join(decision.reasons))


