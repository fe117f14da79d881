"""A new user's first runs: Prefect's local API on a fresh PREFECT_HOME, an empty workspace, stray files, a kill.

Every `retrain run` here is a real process on its own local (ephemeral) Prefect API, as a user starts it; the
workspaces are real git + DVC projects.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrain.nodata import HOW, NOTHING_YET
from retrain.paths import Paths
from retrain.workspace import commit, init_workspace
from tests.helpers import git, run_cli, run_dvc, snapshot
from tests.integration.test_flow import cli_env


@pytest.fixture
def busy_core() -> Iterator[None]:
    """Another process keeps one of the machine's cores busy for the test's length."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def _processes_with(marker: str) -> list[str]:
    """Command lines of the live processes whose environment holds ``marker`` (a test's own PREFECT_HOME)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def test_five_first_runs_on_fresh_prefect_homes_complete_with_a_core_busy(workspace: Paths, tmp_path: Path,
                                                                         busy_core: None) -> None:
    head = git("rev-parse", "HEAD", cwd=workspace.root)
    for i in range(5):
        home = tmp_path / f"prefect-home-{i}"  # a new user: no database yet
        t0 = time.perf_counter()
        proc = run_cli("run", cwd=workspace.root, env=cli_env(home))
        seconds = time.perf_counter() - t0
        print(f"run {i}: exit {proc.returncode} in {seconds:.1f} s")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip().splitlines() == [f"nothing to retrain: no batch yet; {HOW}"]
        assert "Traceback" not in proc.stderr and "Completed" in proc.stderr, proc.stderr
        assert (home / "prefect.db").is_file()
        assert not _processes_with(str(home)), "the local API outlived its run"
    assert git("rev-parse", "HEAD", cwd=workspace.root) == head  # nothing to commit, nothing committed


def test_an_empty_workspace_ends_cleanly_under_the_flow_and_under_dvc_repro(workspace: Paths, tmp_path: Path) -> None:
    root = workspace.root
    before = snapshot(root)
    proc = run_cli("run", cwd=root, env=cli_env(tmp_path / "prefect"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("nothing to retrain: no batch yet") and "Completed" in proc.stderr
    assert snapshot(root) == before  # the flow ran no stage and committed nothing

    out = run_dvc("repro", cwd=root)
    assert out.count(NOTHING_YET) == 1, out
    assert run_dvc("status", cwd=root).strip() == "Data and pipelines are up to date."
    assert '"no_data": true' in (root / "reports" / "promotion.json").read_text()
    assert "Running stage" not in run_dvc("repro", cwd=root)

    # The first batch makes every stage stale again; a master emptied by hand while a batch exists is refused.
    from retrain.data.sample import generate

    generate(tmp_path / "samples", batches=1, images_per_batch=6, seed=0)
    run_cli("ingest", tmp_path / "samples" / "batch-1", cwd=root, check=True)
    assert "merge" in run_dvc("status", cwd=root)
    proc = run_cli("validate", cwd=root)
    assert proc.returncode == 1 and "the master has no images" in proc.stderr, proc.stderr


def test_a_run_commits_only_the_files_it_owns(workspace: Paths) -> None:
    root = workspace.root
    (root / "credentials.env").write_text("AWS_SECRET_ACCESS_KEY=not-for-git\n")
    (root / "export.csv").write_text("a,b\n")
    git("add", "export.csv", cwd=root)  # staged by the user, still not the run's
    (root / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    (root / "reports").mkdir()
    (root / "reports" / "eval.json").write_text("{}\n")
    (root / "reports" / "scratch.txt").write_text("mine\n")

    assert commit(workspace, "a run") is True
    committed = set(git("show", "--name-only", "--format=", "HEAD", cwd=root).split())
    assert committed == {"dvc.lock", "reports/eval.json"}, committed
    status = git("status", "--porcelain", cwd=root).splitlines()
    assert sorted(status) == ["?? credentials.env", "?? reports/scratch.txt", "A  export.csv"], status
    assert commit(workspace, "again") is False  # nothing of the run's changed since


def test_a_killed_run_leaves_no_prefect_server_behind(tmp_path: Path) -> None:
    from retrain.data.sample import generate

    paths = init_workspace(tmp_path / "ws", remote=str(tmp_path / "remote"))
    generate(paths.incoming, batches=1, images_per_batch=8, seed=0)
    home = tmp_path / "prefect-home"
    log = tmp_path / "run.log"
    env = {**cli_env(home), "YOLO_OFFLINE": "true",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "retrain", "run"], cwd=paths.root, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while b"Beginning flow run" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    assert any("uvicorn" in c for c in _processes_with(str(home))), "no local API server to kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while (left := _processes_with(str(home))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def test_no_prefect_api_is_one_line_and_changes_nothing(workspace: Paths, tmp_path: Path) -> None:
    from retrain.data.sample import generate

    generate(workspace.incoming, batches=1, images_per_batch=4, seed=0)
    before = snapshot(workspace.root)
    down = {**cli_env(tmp_path / "p1"), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    slow = {**cli_env(tmp_path / "p2"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}
    for env, says in ((down, "the Prefect API at http://127.0.0.1:9/api does not answer"),
                      (slow, "Prefect's local API (database under")):
        proc = run_cli("run", cwd=workspace.root, env=env)
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert proc.returncode == 75 and len(errors) == 1 and says in errors[0], proc.stderr
        assert "prefect server start" in errors[0] and "Traceback" not in proc.stderr
        assert snapshot(workspace.root) == before and (workspace.incoming / "batch-1").is_dir()
    assert not _processes_with(str(tmp_path / "p2"))
