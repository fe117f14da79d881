"""Where MLflow lives, and the champion's weights for a warm start.

The tracking URI comes from ``MLFLOW_TRACKING_URI``; the embedded default is a sqlite store in the
workspace (``mlflow.db``) with artifacts in ``mlartifacts/``.  A real ``mlflow server`` (PostgreSQL, S3)
is a change of URI (README: production deployment).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.exceptions import MlflowException

from retrain.detector.registered import RegisteredModel
from retrain.errors import RetrainError, TransientError, transient_reason

log = logging.getLogger(__name__)

T = TypeVar("T")

CHAMPION = "champion"
WEIGHTS_NAME = "model.pt"


def tracking_uri(root: Path) -> str:
    """``MLFLOW_TRACKING_URI``, else ``sqlite:///<root>/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root.resolve() / 'mlflow.db'}"


def artifact_root(root: Path, uri: str) -> str | None:
    """Artifact location for experiments made in a local store (``mlartifacts/`` in the workspace).

    ``None`` for a tracking server: it decides (``--artifacts-destination``, S3 ...), so that every machine
    reads the artifacts through it rather than from a path on the machine that made the experiment.
    """
    if uri.split(":", 1)[0] in ("http", "https", "databricks"):
        return None
    return (root.resolve() / "mlartifacts").as_uri()


def client(uri: str) -> Any:
    """An ``MlflowClient`` on ``uri`` for both tracking and the registry."""
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def busy_or_down(exc: BaseException) -> str | None:
    """Why ``exc`` means the store is busy or unreachable for now (worth retrying), or ``None``.

    MLflow's SQL store reports a locked sqlite database (another writer) as ``TEMPORARILY_UNAVAILABLE``; its REST
    client raises an ``MlflowException`` whose chain holds the connection error once its own retries are spent.
    """
    code = getattr(exc, "error_code", None)
    if code in ("TEMPORARILY_UNAVAILABLE", "RESOURCE_EXHAUSTED"):
        return _first_line(exc)
    return transient_reason(exc)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", "") or exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def registry_call(what: str, fn: Callable[[], T], wait: float, first_delay: float = 1.0) -> T:
    """``fn()``, retried with exponential backoff for ``wait`` seconds after a failure while the store is busy or down.

    Args:
        what: What the call does, for the log and the error (``register retrain-detector``).
        fn: One MLflow call (or a short sequence that is safe to repeat).
        wait: Seconds to keep retrying (``runtime.registry_wait``).
        first_delay: The first pause; it doubles each time.

    Raises:
        TransientError: Still busy or down after ``wait`` seconds (exit 75: the flow retries the stage).
        Exception: Anything else ``fn`` raised, unchanged.
    """
    deadline: float | None = None
    delay = first_delay
    while True:
        try:
            return fn()
        except Exception as e:
            reason = busy_or_down(e)
            if reason is None:
                raise
            if deadline is None:  # counted from the first failure (a locked sqlite has waited 20 s in it already)
                deadline = time.monotonic() + wait
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransientError(f"model registry: {what}: still busy or unreachable after {wait:g} s "
                                     f"({reason})") from e
            pause = min(delay, left)
            log.warning("model registry busy or unreachable (%s); %s again in %.1f s", reason, what, pause)
            time.sleep(pause)
            delay *= 2


def experiment(mc: Any, name: str, artifact_location: str | None) -> str:
    """The id of the experiment ``name``, made (with ``artifact_location``) when the store has none yet.

    A second process making it at the same moment (another rank) gets the first one's.  One sequence of calls that
    is safe to repeat (for ``registry_call``).
    """
    found = mc.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(mc.create_experiment(name, artifact_location))
    except MlflowException as e:
        if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
        return str(mc.get_experiment_by_name(name).experiment_id)


def ensure_experiment(uri: str, name: str, artifact_location: str | None, wait: float = 0.0) -> None:
    """Make the experiment before training, so that Lightning's logger finds it (it warns when it makes one).

    Raises:
        TransientError: The store is still busy or down after ``wait`` seconds.
        RetrainError: The store refused.
    """
    try:
        registry_call(f"find or make experiment {name}", lambda: experiment(client(uri), name, artifact_location),
                      wait)
    except MlflowException as e:
        raise RetrainError(f"tracking store: cannot make experiment {name} ({e.message})") from e


def current_champion(mc: Any, model_name: str, wait: float = 0.0, alias: str = CHAMPION) -> str | None:
    """The version behind ``<model_name>@champion`` (or ``@alias``); ``None`` when there is no such model or alias.

    Args:
        mc: An ``MlflowClient``.
        model_name: Registered model name.
        wait: Seconds to retry while the store is busy or down (see ``registry_call``).
        alias: Another alias (``challenger``).

    Raises:
        TransientError: The registry is still busy or unreachable after ``wait`` seconds.
        RetrainError: The registry refused the read.
    """
    def read() -> str | None:
        try:
            return str(mc.get_model_version_by_alias(model_name, alias).version)
        except MlflowException as e:
            if getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    try:
        return registry_call(f"read {model_name}@{alias}", read, wait)
    except MlflowException as e:
        raise RetrainError(f"model registry: cannot read {model_name}@{alias} ({e.message})") from e


def champion(uri: str, model_name: str, dest: Path, wait: float = 0.0) -> RegisteredModel | None:
    """The champion's model file, downloaded once per version into ``dest``; ``None`` when there is no champion yet.

    The download of a version is kept (``dest/v<N>``, marked complete with its file's sha256), so the stages of one
    cycle (train, then evaluate) fetch it once; a folder of another version, or one whose file changed, is replaced.

    Args:
        uri: Tracking URI.
        model_name: Registered model name.
        dest: Folder to download into (the workspace's ``.cache/champion``).
        wait: Seconds to retry while the registry is busy or unreachable.

    Raises:
        RetrainError: The registry cannot be reached, or the champion has no retrain model file.
    """
    version = current_champion(client(uri), model_name, wait)
    return None if version is None else fetch_version(uri, model_name, version, dest, wait)


def fetch_version(uri: str, model_name: str, version: str, dest: Path, wait: float = 0.0) -> RegisteredModel:
    """A registered version's model file, downloaded once into ``dest`` (``dest/v<N>``, kept while its sha256 holds).

    Raises:
        RetrainError: The registry cannot be reached, has no such version, or the version has no retrain model file.
    """
    mc = client(uri)
    where = dest / f"v{version}"
    done = where / ".complete"
    if done.is_file():
        kept = where / done.read_text().split(" ", 1)[-1].strip()
        if kept.is_file() and hashlib.sha256(kept.read_bytes()).hexdigest() == done.read_text().split(" ", 1)[0]:
            log.info("%s version %s: downloaded before", model_name, version)
            return RegisteredModel(model_name, version, kept)
    shutil.rmtree(dest, ignore_errors=True)  # only this version's files: no stale weights are ever picked up
    where.mkdir(parents=True)
    # The version's own artifact URI from this registry: a ``models:/`` URI would be resolved against MLflow's
    # default registry (MLFLOW_REGISTRY_URI, else ./mlflow.db of the current folder), not necessarily ``uri``.
    try:
        source = registry_call(f"locate {model_name} version {version}",
                               lambda: mc.get_model_version_download_uri(model_name, version), wait)
    except MlflowException as e:
        raise RetrainError(f"model registry: {model_name} has no version {version} ({_first_line(e)})") from e
    local = Path(registry_call(f"download {model_name} version {version}", lambda: download_artifacts(
        artifact_uri=source, dst_path=str(where), tracking_uri=uri), wait))
    found = sorted(local.rglob(WEIGHTS_NAME))
    if not found:
        raise RetrainError(f"model registry: {model_name} version {version} has no {WEIGHTS_NAME}")
    done.write_text(f"{hashlib.sha256(found[0].read_bytes()).hexdigest()} {found[0].relative_to(where)}")
    log.info("%s version %s: downloaded", model_name, version)
    return RegisteredModel(model_name, version, found[0])
