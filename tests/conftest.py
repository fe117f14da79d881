"""Shared fixtures: tiny generated batches and real git + DVC workspaces in temp folders."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrain.data.sample import generate
from retrain.paths import Paths
from retrain.workspace import init_workspace

os.environ.setdefault("YOLO_OFFLINE", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")


@pytest.fixture(scope="session")
def sample_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three generated COCO batches of 12 images (seed 0). Read-only by convention: copy before changing."""
    root = tmp_path_factory.mktemp("samples")
    generate(root, batches=3, images_per_batch=12, seed=0)
    return root


@pytest.fixture(scope="session")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three generated COCO batches of 16 images (seed 0), for the flow and fault tests. Read-only by convention."""
    root = tmp_path_factory.mktemp("samples16")
    generate(root, batches=3, images_per_batch=16, seed=0)
    return root


@pytest.fixture
def workspace(tmp_path: Path) -> Paths:
    """A fresh workspace (git + DVC) whose DVC remote is a temp folder."""
    return init_workspace(tmp_path / "ws", remote=str(tmp_path / "remote"))


@pytest.fixture(scope="session")
def harness() -> Iterator[None]:
    """Prefect's test harness: a temporary local API with its own database, for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
