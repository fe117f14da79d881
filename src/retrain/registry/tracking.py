"""Where MLflow lives, and the champion's weights for a warm start.

The tracking URI comes from ``MLFLOW_TRACKING_URI``; the embedded default is a sqlite store in the
workspace (``mlflow.db``) with artifacts in ``mlartifacts/``.  A real ``mlflow server`` (Postgres, S3)
is a change of URI.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.errors import RetrainError

log = logging.getLogger(__name__)

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
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def current_champion(mc: Any, model_name: str) -> str | None:
    """The version behind ``<model_name>@champion``; ``None`` when there is no such model or alias.

    Raises:
        RetrainError: The registry cannot be reached.
    """
    from mlflow.exceptions import MlflowException

    try:
        return str(mc.get_model_version_by_alias(model_name, CHAMPION).version)
    except MlflowException as e:
        if getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise RetrainError(f"model registry: cannot read {model_name}@{CHAMPION} ({e.message})") from e


@dataclass(frozen=True)
class Champion:
    """The registry's champion, downloaded.

    Attributes:
        version: Its model version.
        weights: A local copy of its retrain model file.
    """

    version: str
    weights: Path


def champion(uri: str, model_name: str, dest: Path) -> Champion | None:
    """Download the weights of ``models:/<model_name>@champion``; ``None`` when there is no champion yet.

    Args:
        uri: Tracking URI.
        model_name: Registered model name.
        dest: Folder to download into.

    Raises:
        RetrainError: The registry cannot be reached, or the champion has no retrain model file.
    """
    from mlflow.artifacts import download_artifacts

    version = current_champion(client(uri), model_name)
    if version is None:
        return None
    shutil.rmtree(dest, ignore_errors=True)  # only this version's files: no stale weights are ever picked up
    where = dest / f"v{version}"
    where.mkdir(parents=True)
    local = Path(download_artifacts(artifact_uri=f"models:/{model_name}/{version}", dst_path=str(where),
                                    tracking_uri=uri))
    found = sorted(local.rglob(WEIGHTS_NAME))
    if not found:
        raise RetrainError(f"model registry: {model_name} version {version} has no {WEIGHTS_NAME}")
    log.info("champion: %s version %s", model_name, version)
    return Champion(version, found[0])
