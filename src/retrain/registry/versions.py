"""Writing the model registry: a model version (its pyfunc model, lineage tags, metrics), aliases, the champion's
history.  The promote stage, ``registry-copy`` and ``rollback`` write through these; nothing else writes MLflow.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

from retrain.errors import RetrainError
from retrain.faults import fault_point
from retrain.registry.pyfunc import DEFAULT_PARAMS, example_input
from retrain.registry.tracking import CHAMPION, artifact_root, busy_or_down, experiment

CHALLENGER = "challenger"
TAG = "retrain."
HISTORY_TAG = "retrain.champion_history"  # registered-model tag: the champion's moves, newest last


def registered_version(mc: Any, name: str, key: str) -> str | None:
    """The version already registered for this promotion (tag ``retrain.promotion_key``), if any."""
    try:
        found = mc.search_model_versions(f"name = '{name}' and tags.`{TAG}promotion_key` = '{key}'")
    except MlflowException as e:
        if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return str(min(int(v.version) for v in found)) if found else None


def redact(uri: str) -> str:
    """A URI without its password (``user:secret@host`` -> ``user:***@host``): no secrets in reports."""
    parts = urlsplit(uri)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


@dataclass(frozen=True)
class ModelSource:
    """The model a version serves: its retrain model file, class names and data version (pyfunc metadata), and its
    ONNX export when it matched the PyTorch model (served by onnxruntime then)."""

    weights: Path
    classes: Any
    data_version: Any
    onnx: Path | None = None


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
    try:
        with fluent_uri(uri):
            run_id = _run_for(mlflow.MlflowClient(uri, uri), where, uri)
            with mlflow.start_run(run_id=run_id):
                fault_point("promote.log-model", where.root / "mlartifacts")  # where a local store writes
                artifacts = {"weights": str(model.weights)} | ({"onnx": str(model.onnx)} if model.onnx else {})
                info = mlflow.pyfunc.log_model(
                    name="model", python_model=str(Path(__file__).with_name("serving.py")),
                    artifacts=artifacts, signature=_signature(), input_example=example_input(),
                    pip_requirements=_requirements(onnx=model.onnx is not None),
                    metadata={"retrain": {"classes": model.classes, "data_version": model.data_version}})
                for path, folder in extra or []:
                    if path.is_dir():
                        mlflow.log_artifacts(str(path), artifact_path=folder)
                    else:
                        mlflow.log_artifact(str(path), artifact_path=folder)
                mlflow.log_metrics(metrics)
            ensure_registered_model(mlflow.MlflowClient(uri, uri), name)
            mv = mlflow.register_model(info.model_uri, name, tags=tags)
    except MlflowException as e:
        if busy_or_down(e):
            raise  # registry_call retries it
        raise RetrainError(f"model registry {redact(uri)}: cannot register {name} ({e.message}); "
                           f"{name}@{CHAMPION} has not moved") from e
    return str(mv.version)


@contextmanager
def fluent_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (``log_model``, ``register_model``) on ``uri``, then exactly the state before.

    ``mlflow.set_tracking_uri``/``set_registry_uri`` also export ``MLFLOW_TRACKING_URI``/``MLFLOW_REGISTRY_URI``
    (and ``set_registry_uri(None)`` never removes its variable), which would send every later subprocess of this
    process to this store; the variables are put back as they were.
    """
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
    if where.run_id:
        try:
            mc.get_run(where.run_id)
            return where.run_id
        except MlflowException:
            pass  # trained against another store: a run of its own here
    exp_id = experiment(mc, where.experiment, artifact_root(where.root, uri))
    return str(mc.create_run(exp_id, tags={"mlflow.runName": where.run_name}).info.run_id)


def ensure_registered_model(mc: Any, name: str) -> None:
    try:
        mc.get_registered_model(name)
    except MlflowException:
        mc.create_registered_model(name, description="retrain's detector: champion = in production")


def _signature() -> Any:
    out = Schema([ColSpec("long", "image"), *(ColSpec("double", c) for c in ("x_min", "y_min", "x_max", "y_max",
                                                                             "score")),
                  ColSpec("long", "class_id"), ColSpec("string", "class_name")])
    params = ParamSchema([ParamSpec("conf", "double", DEFAULT_PARAMS["conf"]),
                          ParamSpec("iou", "double", DEFAULT_PARAMS["iou"]),
                          ParamSpec("max_det", "long", DEFAULT_PARAMS["max_det"])])
    return ModelSignature(inputs=Schema([ColSpec("binary", "image")]), outputs=out, params=params)


def _requirements(onnx: bool = False) -> list[str]:
    """Pinned to this environment (never inferred: that would load the model in a subprocess)."""
    pkgs = ("retrain", "mlflow", "torch", "torchvision", "ultralytics", "pandas", "pillow",
            *(("onnxruntime",) if onnx else ()))
    return [f"{pkg}=={version(pkg).split('+')[0]}" for pkg in pkgs]


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
