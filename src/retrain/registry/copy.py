"""``retrain registry-copy``: the champion from one model registry into another, as its champion there.

Moving a workspace from the embedded defaults (``sqlite:///mlflow.db``) to a team's tracking server, or back,
changes ``MLFLOW_TRACKING_URI``; the registry behind the new URI does not have the champion yet, so the next run
would train from scratch and promote whatever it gets.  This copies the champion's version over: its model file
(checked as a retrain model file first: nothing in it is run), its ONNX export (when its sha256 is the one the source
version's tags name), its lineage tags and the ``champion`` alias, so the
next run warm-starts from it and is judged against it.  Copying again is a no-op (the same weights are found by
their sha256, tag ``retrain.candidate_sha256``, whether copied or promoted there).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException

from retrain.detector.files import ModelFileError, load_model_file
from retrain.errors import RetrainError
from retrain.registry.tracking import CHAMPION, champion, client, current_champion, registry_call
from retrain.registry.versions import (
    CHALLENGER,
    TAG,
    ModelSource,
    VersionRun,
    log_version,
    record_champion_move,
    redact,
)

log = logging.getLogger(__name__)

COPIED_FROM = f"{TAG}copied_from"


@dataclass(frozen=True)
class Copied:
    """A champion copied.

    Attributes:
        source_version: The champion's version in the source registry.
        version: Its version in the target registry (now its champion).
        new: False when the target already had these weights (the alias was moved, nothing registered).
    """

    source_version: str
    version: str
    new: bool


def copy_champion(source: str, target: str, name: str, experiment: str, root: Path, wait: float = 0.0) -> Copied:
    """Copy ``name@champion`` from the registry at ``source`` into the one at ``target`` and make it champion there.

    Args:
        source: Tracking URI to copy from.
        target: Tracking URI to copy into.
        name: Registered model name (the same in both).
        experiment: The target's experiment for the run the copy is logged in.
        root: The workspace (a local target store keeps its artifacts in ``mlartifacts/`` there).
        wait: Seconds to retry a busy or unreachable registry.

    Raises:
        RetrainError: The two URIs are one registry, the source has no champion, or its model file is refused.
    """
    if source.rstrip("/") == target.rstrip("/"):
        raise RetrainError(f"registry-copy: source and target are the same registry ({redact(source)})")
    with tempfile.TemporaryDirectory(prefix="retrain-registry-copy-") as tmp:
        got = champion(source, name, Path(tmp), wait)
        if got is None:
            raise RetrainError(f"model registry {redact(source)}: {name} has no champion to copy")
        try:
            model = load_model_file(got.weights)  # a file from elsewhere: checked before it is registered here
        except ModelFileError as e:
            raise RetrainError(f"registry-copy: {name} version {got.version} of {redact(source)}: {e}") from e
        sha = hashlib.sha256(got.weights.read_bytes()).hexdigest()
        src_tags = dict(client(source).get_model_version(name, got.version).tags)
        mc = client(target)
        found = registry_call(f"look for {name} in {redact(target)}", lambda: mc.search_model_versions(
            f"name = '{name}' and tags.`{TAG}candidate_sha256` = '{sha}'"), wait) if _has_model(mc, name) else []
        parent = current_champion(mc, name, wait)
        if found:
            version, new = str(min(int(v.version) for v in found)), False
        else:
            tags = {**{k: v for k, v in src_tags.items() if k.startswith(TAG)}, f"{TAG}candidate_sha256": sha,
                    COPIED_FROM: f"{redact(source)} {name} version {got.version}",
                    f"{TAG}parent_version": parent or "none"}
            onnx = _onnx_of(Path(tmp), src_tags)
            if onnx is None and src_tags.get(f"{TAG}onnx") == "attached":
                tags |= {f"{TAG}onnx": "refused", f"{TAG}onnx.reason": "not copied: the source's model.onnx is missing "
                         "or not the file its tags name"}
            where = VersionRun(experiment, "", root, run_name=f"copied from {redact(source)} version {got.version}")
            version = registry_call(f"register {name} in {redact(target)}", lambda: log_version(
                target, name, ModelSource(got.weights, list(model.names), src_tags.get(f"{TAG}data_version"), onnx),
                tags, {}, where), wait)
            new = True

    def move() -> None:
        mc.set_registered_model_alias(name, CHALLENGER, version)
        mc.set_registered_model_alias(name, CHAMPION, version)
        record_champion_move(mc, name, {"champion": version, "from": parent, "by": "registry-copy"})

    if parent != version:
        registry_call(f"move {name}@{CHAMPION} in {redact(target)}", move, wait)
    log.info("%s@%s of %s is version %s (version %s of %s)", name, CHAMPION, redact(target), version, got.version,
             redact(source))
    return Copied(got.version, version, new)


def _onnx_of(download: Path, tags: dict[str, str]) -> Path | None:
    """The downloaded version's ONNX export, when the source attached one and it is the file its sha256 tag names."""
    want = tags.get(f"{TAG}onnx.sha256")
    if not want or tags.get(f"{TAG}onnx") != "attached":
        return None
    for path in sorted(download.rglob("model.onnx")):
        if hashlib.sha256(path.read_bytes()).hexdigest() == want:
            return path
    return None


def _has_model(mc: object, name: str) -> bool:
    try:
        mc.get_registered_model(name)  # type: ignore[attr-defined]
        return True
    except MlflowException:
        return False

