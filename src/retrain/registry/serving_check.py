"""The serving check before ``champion`` moves: the version as the registry returns it, loaded and asked.

A version is downloaded from ``models:/<name>/<N>`` into a clean folder (as ``mlflow models serve`` on a machine with no
local files would: through the registry's artifact store, S3 included), loaded as a pyfunc model with the backend a
server would pick (``RETRAIN_SERVE_BACKEND``), and asked for detections of a few val images.  It passes when the files
that came back are the ones registered (sha256) and the answer has the served schema.  MLflow's artifact-location bugs
with some stores (a version whose files are not where its URI says) fail here, before the alias moves, not in
production.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from retrain.registry.pyfunc import COLUMNS
from retrain.registry.tracking import busy_or_down
from retrain.registry.versions import fluent_uri, redact


@dataclass(frozen=True)
class ServingCheck:
    """The outcome.

    Attributes:
        passed: Loaded from the registry and answered as served models do.
        reason: Why not (one line), when it did not pass.
        backend: The backend the loaded model ran (``onnx`` or ``torch``).
        images: Images asked.
        detections: Detections answered.
        seconds: Download, load and predict.
    """

    passed: bool
    reason: str = ""
    backend: str = ""
    images: int = 0
    detections: int = 0
    seconds: float = 0.0

    def tag(self) -> str:
        """The ``retrain.serving_check`` tag value."""
        if not self.passed:
            return f"failed: {self.reason}"[:5000]
        return (f"passed: loaded from the registry, {self.backend} answered {self.detections} detections on "
                f"{self.images} val images in {self.seconds:.1f} s")


def serving_check(uri: str, name: str, version: str, images: list[Path], sha256: dict[str, str]) -> ServingCheck:
    """Download ``models:/name/version`` into a clean folder, load it as a pyfunc, predict on ``images``.

    Args:
        uri: Tracking and registry URI.
        name: Registered model name.
        version: The version to check.
        images: Image files to ask it about.
        sha256: Expected sha256 of the version's files by name (``model.pt``, ``model.onnx``).

    Returns:
        Whether it passed and why not.

    Raises:
        MlflowException: The store is busy or unreachable (not the version's fault: ``registry_call`` retries it).
    """
    import mlflow
    import pandas as pd

    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="retrain-serving-check-") as tmp, fluent_uri(uri):
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=tmp))
            for file, want in sha256.items():
                found = sorted(local.rglob(file))
                if not found:
                    return ServingCheck(False, f"{name} version {version} from {redact(uri)} has no {file}")
                if hashlib.sha256(found[0].read_bytes()).hexdigest() != want:
                    return ServingCheck(False, f"{name} version {version} from {redact(uri)}: {file} is not the "
                                               "file registered (sha256 differs)")
            model = mlflow.pyfunc.load_model(str(local))
            backend = str(getattr(model.unwrap_python_model(), "backend", "?"))
            out = model.predict(pd.DataFrame({"image": [p.read_bytes() for p in images]}), params={"conf": 0.001})
    except Exception as e:  # whatever the download or the model does: the check fails, with why
        if busy_or_down(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return ServingCheck(False, f"{name} version {version} from {redact(uri)}: {type(e).__name__}: {first}"[:2000])
    if list(out.columns) != list(COLUMNS):
        return ServingCheck(False, f"answered columns {list(out.columns)}, not {list(COLUMNS)}")
    if len(out) and not out["image"].between(0, len(images) - 1).all():
        return ServingCheck(False, "answered detections of rows that were not asked")
    return ServingCheck(True, "", backend, len(images), len(out), round(time.perf_counter() - start, 2))
