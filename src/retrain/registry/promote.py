"""``retrain promote``, ``rollback`` and ``status``: the only code that writes the MLflow model registry.

Promote logs the candidate as a pyfunc model (weights, class names, imgsz) in its training run, registers it
as a new version of the registered model with its lineage as tags (data version, git revision, params hash,
parent version, metrics, decision and reasons), and then, last, moves the aliases: ``challenger`` always,
``champion`` only when the gate says so.  A failure before that leaves ``champion`` where it was.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.config import Params
from retrain.errors import RetrainError
from retrain.evaluation.compare import Decision, ModelMetrics, decide
from retrain.faults import fault_point
from retrain.fsutil import dumps_canonical, write_atomic
from retrain.paths import Paths
from retrain.registry.tracking import (
    CHAMPION,
    WEIGHTS_NAME,
    busy_or_down,
    client,
    current_champion,
    registry_call,
    tracking_uri,
)
from retrain.workspace import require_workspace

log = logging.getLogger(__name__)

CHALLENGER = "challenger"
TAG = "retrain."
HISTORY_TAG = "retrain.champion_history"  # registered-model tag: the champion's moves, newest last


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
    report: dict[str, Any]


def metrics_from_report(report: dict[str, Any]) -> tuple[ModelMetrics | None, ModelMetrics]:
    """The gate's view of ``reports/eval.json``: (champion or None, candidate)."""

    def view(m: dict[str, Any], ci: tuple[float, float] | None = None) -> ModelMetrics:
        return ModelMetrics(float(m["mAP50-95"]), dict(m["per_class"]),
                            {k: float(v["mAP50-95"]) for k, v in m["slices"].items()},
                            dict(report["instances"]), ci)

    delta = report.get("delta") or {}
    ci = tuple(delta["ci"]) if delta.get("ci") else None
    champ = report.get("champion")
    return (view(champ["metrics"]) if champ else None), view(report["candidate"]["metrics"], ci)


def data_lineage(root: Path) -> dict[str, str]:
    """DVC's md5 of ``data/master`` (from ``dvc.lock``) and the workspace's git revision."""
    from retrain.workspace import master_version

    md5 = master_version(Paths(root)) or "not in dvc.lock"
    git = ["git", "-C", str(root)]
    rev = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return {"data_dvc_md5": md5, "git_rev": rev or "none", "git_dirty": str(bool(dirty)).lower()}


def params_hash(params: Params) -> str:
    """sha256 (16 hex) of every param, canonical JSON."""
    text = json.dumps(params.model_dump(mode="json", by_alias=True), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise RetrainError(f"{path}: no {what}; run 'dvc repro' (or 'retrain {what.split()[0]}') first") from e
    except (OSError, ValueError) as e:
        raise RetrainError(f"{path}: cannot read the {what} ({e})") from e
    if not isinstance(doc, dict):
        raise RetrainError(f"{path}: the {what} is not a JSON object")
    return doc


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
    from retrain.training.data import load_master

    require_workspace(paths)
    evaluation = _read_json(paths.eval_report, "evaluate report")
    train = _read_json(paths.train_report, "train report")
    weights = paths.candidate / WEIGHTS_NAME
    master = load_master(paths.master, paths.data)
    if evaluation.get("data_version") != master.version or train.get("data_version") != master.version:
        raise RetrainError(f"{paths.eval_report}: evaluated on another master than data/master; run "
                           "'retrain evaluate' again (dvc repro does)")
    if not weights.is_file():
        raise RetrainError(f"{weights}: no candidate; run 'retrain train' first")
    if evaluation.get("candidate", {}).get("sha256") != hashlib.sha256(weights.read_bytes()).hexdigest():
        raise RetrainError(f"{paths.eval_report}: evaluated another candidate than {weights}; run "
                           "'retrain evaluate' again (dvc repro does)")
    uri, name, wait = tracking_uri(paths.root), params.registry.model_name, params.retrain.registry_wait
    mc = registry_call("open the model registry", lambda: client(uri), wait)  # a sqlite store connects here
    parent = current_champion(mc, name, wait)
    evaluated = (evaluation.get("champion") or {}).get("version")
    if parent != evaluated:
        raise RetrainError(f"registry: {name}@{CHAMPION} is version {parent or 'none'} but the evaluation compared "
                           f"against {evaluated or 'none'}; run 'retrain evaluate' again")
    try:
        champ_metrics, cand_metrics = metrics_from_report(evaluation)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RetrainError(f"{paths.eval_report}: not a complete evaluate report ({type(e).__name__}: {e}); run "
                           "'retrain evaluate' again") from e
    decision = decide(champ_metrics, cand_metrics, params.promote)
    tags = _lineage_tags(paths, params, evaluation, train, parent, decision)
    key = tags[f"{TAG}promotion_key"]

    def register_once() -> str:  # repeated after a failure or a kill: never a second version of one promotion
        found = registered_version(mc, name, key)
        if found is not None:
            log.info("%s version %s is this candidate already, with this evaluation and params (registered by a "
                     "run that stopped before moving the aliases); moving them now", name, found)
            for tag, value in tags.items():  # the lineage as of now (git revision ...)
                mc.set_model_version_tag(name, found, tag, value)
            return found
        return _register(uri, name, params.registry.experiment, weights, paths, train, tags,
                         _eval_metrics(evaluation))

    version = registry_call(f"register {name}", register_once, wait)
    fault_point("promote.after-register")
    # Last: every failure above leaves champion untouched.
    registry_call(f"move the aliases of {name}", lambda: _move_aliases(mc, name, version, parent, decision), wait)
    report = {"model": name, "version": version, "promoted": decision.promote, "reasons": list(decision.reasons),
              "notes": list(decision.notes), "parent_version": parent, "champion": version if decision.promote
              else parent, "tags": tags, "tracking_uri": redact(uri)}
    write_atomic(paths.promotion_report, dumps_canonical(report))
    return PromotionResult(version, decision, report)


def promotion_key(candidate_sha256: str, eval_report: bytes, params_hash: str) -> str:
    """What makes one promotion: the candidate file, its evaluation (champion, metrics) and the params (the gate).

    The same key again is the same promotion cut short (a kill or a failure between registering and moving the
    aliases): its version is reused.  Another key (the gate's params changed, another champion) is a new version,
    even of the same weights.
    """
    text = json.dumps([candidate_sha256, hashlib.sha256(eval_report).hexdigest(), params_hash])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def registered_version(mc: Any, name: str, key: str) -> str | None:
    """The version already registered for this promotion (tag ``retrain.promotion_key``), if any."""
    from mlflow.exceptions import MlflowException

    try:
        found = mc.search_model_versions(f"name = '{name}' and tags.`{TAG}promotion_key` = '{key}'")
    except MlflowException as e:
        if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return str(min(int(v.version) for v in found)) if found else None


def _eval_metrics(evaluation: dict[str, Any]) -> dict[str, float]:
    """The evaluation's headline numbers as run metrics (``eval/candidate/mAP50-95`` ...)."""
    out = {f"eval/candidate/{k}": float(evaluation["candidate"]["metrics"][k]) for k in ("mAP50-95", "mAP50")}
    if evaluation.get("champion"):
        out |= {f"eval/champion/{k}": float(evaluation["champion"]["metrics"][k]) for k in ("mAP50-95", "mAP50")}
        out["eval/delta/mAP50-95"] = float(evaluation["delta"]["mAP50-95"])
    return out


def redact(uri: str) -> str:
    """A URI without its password (``user:secret@host`` -> ``user:***@host``): no secrets in reports."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def _lineage_tags(paths: Paths, params: Params, evaluation: dict[str, Any], train: dict[str, Any],
                  parent: str | None, decision: Decision) -> dict[str, str]:
    cand = evaluation["candidate"]["metrics"]
    tags = {
        "data_version": str(evaluation["data_version"]), **data_lineage(paths.root),
        "params_hash": params_hash(params), "train_params_hash": str(train.get("params_hash")),
        "parent_version": parent or "none", "warm_start": json.dumps(train.get("warm_start"), sort_keys=True),
        "train_run_id": str(train.get("mlflow_run_id")),
        "candidate_sha256": str(evaluation["candidate"]["sha256"]),
        "promotion_key": promotion_key(str(evaluation["candidate"]["sha256"]), paths.eval_report.read_bytes(),
                                       params_hash(params)),
        "decision": "promote" if decision.promote else "reject",
        "reasons": "; ".join(decision.reasons) or "every rule of the gate holds",
        "classes": ",".join(evaluation["candidate"]["classes"]),
        **{f"metric.{k}": f"{cand[k]:.6f}" for k in ("mAP50-95", "mAP50", "mAP75", "AR100")},
    }
    delta = evaluation.get("delta")
    if delta:
        tags["metric.delta_mAP50-95"] = f"{delta['mAP50-95']:.6f}"
        if delta.get("ci"):
            tags["metric.delta_ci"] = f"[{delta['ci'][0]:.6f}, {delta['ci'][1]:.6f}]"
    return {f"{TAG}{k}": v[:5000] for k, v in tags.items()}


def _register(uri: str, name: str, experiment: str, weights: Path, paths: Paths, train: dict[str, Any],
              tags: dict[str, str], metrics: dict[str, float]) -> str:
    """Log the candidate's pyfunc model (in the training run when this store has it) and register it; its version."""
    reports = [(paths.eval_report, "evaluation"), (paths.eval_markdown, "evaluation")]
    if paths.eval_plots.is_dir():
        reports.append((paths.eval_plots, "evaluation/plots"))
    return log_version(uri, name, ModelSource(weights, train.get("classes"), train.get("data_version")), tags,
                       metrics, VersionRun(experiment, str(train.get("mlflow_run_id")), paths.root), reports)


@dataclass(frozen=True)
class ModelSource:
    """The model a version serves: its retrain model file, class names and data version (pyfunc metadata)."""

    weights: Path
    classes: Any
    data_version: Any


@dataclass(frozen=True)
class VersionRun:
    """Where a version is logged: ``run_id`` when this store has that run, else a new run of ``experiment``."""

    experiment: str
    run_id: str
    root: Path
    run_name: str = "promote (training run not in this store)"


def log_version(uri: str, name: str, model: ModelSource, tags: dict[str, str], metrics: dict[str, float],
                where: VersionRun, extra: list[tuple[Path, str]] | None = None) -> str:
    """Log ``model`` as the pyfunc model served by ``serving.py`` and register it as a new version of ``name``.

    Args:
        uri: Tracking and registry URI.
        name: Registered model name (made if missing).
        model: The weights and what the pyfunc's metadata says of them.
        tags: The version's tags.
        metrics: Run metrics to log beside it.
        where: The run to log it in.
        extra: More files or folders to log in the run (path, artifact folder).

    Returns:
        The new version.

    Raises:
        RetrainError: The registry refused (``champion`` has not moved).
        MlflowException: The store is busy or down (``registry_call`` retries it).
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    from retrain.registry.pyfunc import example_input

    try:
        with _fluent_uri(uri):
            run_id = _run_for(mlflow.MlflowClient(uri, uri), where, uri)
            with mlflow.start_run(run_id=run_id):
                fault_point("promote.log-model", where.root / "mlartifacts")  # where a local store writes
                info = mlflow.pyfunc.log_model(
                    name="model", python_model=str(Path(__file__).with_name("serving.py")),
                    artifacts={"weights": str(model.weights)}, signature=_signature(), input_example=example_input(),
                    pip_requirements=_requirements(),
                    metadata={"retrain": {"classes": model.classes, "data_version": model.data_version}})
                for path, folder in extra or []:
                    if path.is_dir():
                        mlflow.log_artifacts(str(path), artifact_path=folder)
                    else:
                        mlflow.log_artifact(str(path), artifact_path=folder)
                mlflow.log_metrics(metrics)
            _ensure_registered_model(mlflow.MlflowClient(uri, uri), name)
            mv = mlflow.register_model(info.model_uri, name, tags=tags)
    except MlflowException as e:
        if busy_or_down(e):
            raise  # registry_call retries it
        raise RetrainError(f"model registry {redact(uri)}: cannot register {name} ({e.message}); "
                           f"{name}@{CHAMPION} has not moved") from e
    return str(mv.version)


@contextmanager
def _fluent_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (``log_model``, ``register_model``) on ``uri``, then exactly the state before.

    ``mlflow.set_tracking_uri``/``set_registry_uri`` also export ``MLFLOW_TRACKING_URI``/``MLFLOW_REGISTRY_URI``
    (and ``set_registry_uri(None)`` never removes its variable), which would send every later subprocess of this
    process to this store; the variables are put back as they were.
    """
    import mlflow

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # None: back to "not set" (documented)
        mlflow.set_registry_uri(None)  # type: ignore[arg-type]
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_for(mc: Any, where: VersionRun, uri: str) -> str:
    """The given run when this store has it (the version then links to its curves), else a new run."""
    from mlflow.exceptions import MlflowException

    from retrain.registry.tracking import artifact_root

    if where.run_id:
        try:
            mc.get_run(where.run_id)
            return where.run_id
        except MlflowException:
            pass  # trained against another store: a run of its own here
    exp = mc.get_experiment_by_name(where.experiment)
    exp_id = exp.experiment_id if exp else mc.create_experiment(where.experiment, artifact_root(where.root, uri))
    return str(mc.create_run(exp_id, tags={"mlflow.runName": where.run_name}).info.run_id)


def _ensure_registered_model(mc: Any, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mc.get_registered_model(name)
    except MlflowException:
        mc.create_registered_model(name, description="retrain's detector: champion = in production")


def _signature() -> Any:
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    from retrain.registry.pyfunc import DEFAULT_PARAMS

    out = Schema([ColSpec("long", "image"), *(ColSpec("double", c) for c in ("x_min", "y_min", "x_max", "y_max",
                                                                             "score")),
                  ColSpec("long", "class_id"), ColSpec("string", "class_name")])
    params = ParamSchema([ParamSpec("conf", "double", DEFAULT_PARAMS["conf"]),
                          ParamSpec("iou", "double", DEFAULT_PARAMS["iou"]),
                          ParamSpec("max_det", "long", DEFAULT_PARAMS["max_det"])])
    return ModelSignature(inputs=Schema([ColSpec("binary", "image")]), outputs=out, params=params)


def _requirements() -> list[str]:
    """Pinned to this environment (never inferred: that would load the model in a subprocess)."""
    from importlib.metadata import version

    return [f"{pkg}=={version(pkg).split('+')[0]}" for pkg in
            ("retrain", "mlflow", "torch", "torchvision", "ultralytics", "pandas", "pillow")]


def _move_aliases(mc: Any, name: str, version: str, parent: str | None, decision: Decision) -> None:
    mc.set_registered_model_alias(name, CHALLENGER, version)
    if decision.promote:
        mc.set_registered_model_alias(name, CHAMPION, version)
        record_champion_move(mc, name, {"champion": version, "from": parent, "by": "promote"})
        log.info("%s version %s is the champion (was %s)", name, version, parent or "none")
    else:
        log.info("%s version %s registered as challenger, not promoted: %s", name, version,
                 "; ".join(decision.reasons))


def record_champion_move(mc: Any, name: str, entry: dict[str, Any]) -> None:
    """Append to the champion's history (a registered-model tag, the last 50 moves)."""
    history = json.loads(mc.get_registered_model(name).tags.get(HISTORY_TAG, "[]"))
    if history and all(history[-1].get(k) == v for k, v in entry.items()):
        return  # this move is recorded already (a retried call)
    history.append({**entry, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    text = json.dumps(history[-50:])
    while len(text) > 4900:  # the tag value limit
        history = history[1:]
        text = json.dumps(history[-50:])
    mc.set_registered_model_tag(name, HISTORY_TAG, text)
