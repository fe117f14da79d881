"""A workspace with a champion, built once, restored at the same absolute path before each fault test.

MLflow's sqlite store records absolute artifact paths and the DVC remote is an absolute path, so a copy elsewhere
would still write into the original: each test gets the pristine tree back at the very same path instead.

- ``champion``: batch 1 ingested and run through ``dvc repro`` (version 1 is the champion), committed, pushed;
  batch 2 not yet delivered.
- ``evaluated``: then batch 2 ingested and ``dvc repro evaluate``: a candidate trained and evaluated against
  the champion, not yet promoted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from retrain.paths import Paths
from tests.helpers import git, run_dvc, tree_hash


def cli(*args: str | Path, cwd: Path, prefect_home: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``python -m retrain ARGS`` with exactly this environment (its own local Prefect API when it runs the flow)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RETRAIN_FAULT", "MLFLOW_"))}
    full = {**base, "YOLO_OFFLINE": "true", "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", ""), **(env or {})}
    if prefect_home is not None:
        full["PREFECT_HOME"] = str(prefect_home)
    # Files, not pipes: a killed run's orphans (Prefect's local API server) would hold a pipe open for good.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "retrain", *map(str, args)], cwd=cwd, env=full, text=True,
                                stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            reap(proc.pid)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def reap(pgid: int) -> None:
    """Kill what a killed run left in its process group (Prefect's local API server is not ours to keep)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def state(root: Path) -> dict[str, Any]:
    """What must be unchanged (or completed, never half): data/master, dvc.lock, the .dvc files, the aliases."""
    dvc_files = sorted(p for p in (root / "data").rglob("*.dvc") if ".ingested" not in p.parts)
    h = hashlib.sha256()
    for p in dvc_files:
        h.update(p.relative_to(root).as_posix().encode() + hashlib.sha256(p.read_bytes()).digest())
    lock = root / "dvc.lock"
    return {"master": tree_hash(root / "data" / "master"),
            "dvc.lock": hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else "",
            "dvc_files": h.hexdigest(), **registry_tables(root)}


def registry_tables(root: Path, name: str = "retrain-detector") -> dict[str, Any]:
    """The registry's versions and alias table, read from ``mlflow.db`` with a fresh sqlite connection.

    (MLflow's client keeps a pooled connection per URI: after a restore replaced the file it would read the old one.)
    """
    db = root / "mlflow.db"
    if not db.exists():
        return {"versions": [], "aliases": {}}
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        versions = sorted(int(v) for (v,) in con.execute("select version from model_versions where name = ?",
                                                          (name,)))
        aliases = {a: str(v) for a, v in con.execute("select alias, version from registered_model_aliases "
                                                      "where name = ?", (name,))}
    return {"versions": versions, "aliases": aliases}


def leftovers(root: Path) -> list[str]:
    """Half-written things a killed process may leave: staged batches/masters, temp checkpoints, temp files."""
    found = [p for p in (root / ".cache" / "staging").glob("*")] if (root / ".cache" / "staging").is_dir() else []
    found += list((root / "models").rglob(".*.tmp")) if (root / "models").is_dir() else []
    return [str(p.relative_to(root)) for p in found]


class Stores:
    """The pristine trees and the fixed path they are restored to."""

    def __init__(self, base: Path, samples: Path) -> None:
        self.base, self.samples = base, samples
        self.work = base / "work"
        self.root = self.work / "ws"
        self.saved: dict[str, Path] = {}

    def save(self, name: str) -> None:
        dst = self.base / f"store-{name}"
        shutil.copytree(self.work, dst, symlinks=True)
        self.saved[name] = dst

    def restore(self, name: str) -> Paths:
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.copytree(self.saved[name], self.work, symlinks=True)
        return Paths.at(self.root)

    def deliver(self, batch: str) -> Path:
        dst = self.root / "data" / "incoming" / batch
        shutil.copytree(self.samples / batch, dst)
        return dst


@pytest.fixture(scope="session")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Stores:
    from retrain.data.sample import generate
    from tests.integration.test_flow import tiny_workspace

    base = tmp_path_factory.mktemp("faults")
    generate(base / "samples", batches=3, images_per_batch=16, seed=0)
    s = Stores(base, base / "samples")
    tiny_workspace(s.work)
    ok(cli("ingest", s.samples / "batch-1", cwd=s.root))
    run_dvc("repro", cwd=s.root)
    run_dvc("push", cwd=s.root)
    git("add", "-A", cwd=s.root)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "batch-1, champion v1", cwd=s.root)
    assert registry_tables(s.root)["aliases"].get("champion") == "1"
    s.save("champion")
    ok(cli("ingest", s.samples / "batch-2", cwd=s.root))
    run_dvc("repro", "evaluate", cwd=s.root)
    s.save("evaluated")
    return s


@pytest.fixture
def restore(stores: Stores) -> Callable[[str], Paths]:
    return stores.restore
