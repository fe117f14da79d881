"""Pydantic models of ``params.yaml``: one section per stage, unknown keys rejected.

``params.yaml`` is the only place for knobs.  ``load_params`` turns every problem
(missing file, YAML error, unsafe tag, unknown key, bad value) into a ``ConfigError``
whose message names the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from retrain.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IngestParams(_Section):
    """Knobs of ``retrain ingest`` (the batch half of validation)."""

    box_tolerance_px: float = Field(
        default=1.0, ge=0, description="How far (pixels) a box may stick out of its image before it is refused; "
        "boxes within the tolerance are clipped to the image."
    )
    workers: int = Field(default=0, ge=0, description="Threads decoding images; 0 means one per CPU core.")
    max_problems_shown: int = Field(default=50, ge=1, description="Problem lines printed for a refused batch.")


class MergeParams(_Section):
    """Knobs of ``retrain merge``."""

    val_fraction: float = Field(
        default=0.2, gt=0, lt=1, description="Share of images assigned to val, by content hash (stable forever)."
    )
    split_salt: str = Field(
        default="retrain-split-v1", min_length=1, description="Mixed into the content hash that picks an image's split."
    )
    box_conflict_tolerance_px: float = Field(
        default=0.5, ge=0, description="Two labellings of one image are the same when every box agrees to this."
    )


class Params(_Section):
    """All of ``params.yaml``."""

    ingest: IngestParams = IngestParams()
    merge: MergeParams = MergeParams()


def _format_validation_error(path: Path, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "(top level)"
        parts.append(f"{key}: {e['msg']}")
    return f"{path.name}: " + "; ".join(parts)


def read_yaml(path: Path) -> Any:
    """Read a YAML file safely (no Python tags).

    Args:
        path: The file.

    Returns:
        The parsed document.

    Raises:
        ConfigError: The file is missing or is not safe, valid YAML.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: file not found") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({e})") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not safe YAML ({first})") from e


def parse_params(data: Any, source: Path = Path("params.yaml")) -> Params:
    """Validate an already-parsed params document.

    Args:
        data: The parsed YAML (``None`` for an empty file).
        source: Where it came from, for messages.

    Returns:
        The validated params.

    Raises:
        ConfigError: Unknown key or bad value; the message names the key.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source.name}: expected a mapping of sections, got {type(data).__name__}")
    try:
        return Params.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(source, e)) from e


def load_params(path: Path) -> Params:
    """Load and validate ``params.yaml``.

    Args:
        path: Path to ``params.yaml``.

    Returns:
        The validated params.

    Raises:
        ConfigError: The file is missing, unsafe, or has an unknown key or a bad value.
    """
    return parse_params(read_yaml(path), path)
