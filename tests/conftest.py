"""Shared fixtures: tiny generated batches and real git + DVC workspaces in temp folders."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrain.data.sample import generate
from retrain.paths import Paths
from retrain.workspace import init_workspace
from tests.helpers import GATE, git, load_json, run_cli, run_dvc, set_params, set_train_params

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


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`dvc repro` of the whole pipeline (merge .. promote) on 2 x 40 generated images; its first model is v1 and the
    champion. Read-only by convention: copy the workspace before changing anything."""
    base = tmp_path_factory.mktemp("promote")
    generate(base / "samples", batches=2, images_per_batch=40, seed=0)
    paths = init_workspace(base / "ws", remote=str(base / "remote"))
    for b in ("batch-1", "batch-2"):
        run_cli("ingest", base / "samples" / b, cwd=paths.root, check=True)
    set_train_params(paths.root, imgsz=128, epochs=40, batch=8, cache="ram", use_champion=False, lr=0.004,
                     eval_interval=20, workers=0, augment={"close_mosaic": 5})
    set_params(paths.root, "evaluate", bootstrap=50)
    set_params(paths.root, "promote", **GATE)
    git("add", "-A", cwd=paths.root)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "params for the test", cwd=paths.root)
    out = run_dvc("repro", cwd=paths.root)
    for stage in ("merge", "validate", "audit", "train", "evaluate", "promote"):
        assert f"Running stage '{stage}'" in out, out
    assert "promote" not in run_dvc("status", cwd=paths.root)  # every stage, promote included, is up to date
    assert load_json(paths.root / "reports" / "promotion.json")["promoted"] is True
    # No champion yet: the audit said so and let the master through.
    audit = load_json(paths.root / "reports" / "audit.json")
    assert audit["champion"] is None and "no champion yet" in audit["notes"][0], audit
    assert load_json(paths.root / "reports" / "audited.json")["master"] == audit["data_version"]
    return paths.root
