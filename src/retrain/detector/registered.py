"""What a stage receives as the champion: a model file that a registry holds, downloaded (no torch imported)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegisteredModel:
    """A registered model version's retrain model file, as a local copy.

    Attributes:
        name: The registered model's name.
        version: Its version in the registry.
        weights: A local copy of its retrain model file.
    """

    name: str
    version: str
    weights: Path
