"""Faults of the model registry during promotion: ``mlflow.db`` held by another writer, the MLflow server stopped.

Each test restores the workspace whose candidate is trained and evaluated against champion version 1
(``conftest.py``) and runs the real ``retrain promote`` stage in a subprocess.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from retrain.paths import Paths
from tests.faults.conftest import cli, error_lines, ok, reap, state
from tests.helpers import set_params
from tests.integration.test_promote import _port, _server, _stop, _wait

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(1800)]  # the workspaces' build too

HOLD = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")  # another writer: no one else reads or writes until it commits
print("held", flush=True)
if sys.argv[2] == "stdin":
    sys.stdin.readline()
else:
    time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
"""


def _hold(db: Path, how: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(db), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_mlflow_db_held_by_another_writer_for_10_s_is_waited_for_and_the_version_registered_once(
        restore: Callable[[str], Paths]) -> None:
    paths = restore("evaluated")
    before = state(paths.root)
    holder = _hold(paths.root / "mlflow.db", "10")
    t0 = time.monotonic()
    done = ok(cli("promote", cwd=paths.root))
    took = time.monotonic() - t0
    holder.wait(30)
    assert took >= 9, took  # it waited for the writer (sqlite's busy timeout, MLflow sets 20 s) ...
    after = state(paths.root)  # ... and then registered exactly one version
    assert after["versions"] == [1, 2] and after["aliases"]["challenger"] == "2", (after, done.stderr[-2000:])
    assert after["master"] == before["master"] and after["dvc.lock"] == before["dvc.lock"]


def test_mlflow_db_held_past_the_bounded_wait_fails_cleanly_with_exit_75_and_registers_nothing(
        restore: Callable[[str], Paths]) -> None:
    paths = restore("evaluated")
    set_params(paths.root, "runtime", registry_wait=2)
    before = state(paths.root)
    holder = _hold(paths.root / "mlflow.db", "stdin")
    try:
        t0 = time.monotonic()
        busy = cli("promote", cwd=paths.root)
        took = time.monotonic() - t0
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(30)
    assert busy.returncode == 75 and "Traceback" not in busy.stderr, busy.stderr[-3000:]
    [line] = error_lines(busy)
    assert "model registry" in line and "still busy or unreachable after 2 s" in line, line
    assert "model registry busy or unreachable" in busy.stderr  # the retry, with its pause, in the log
    assert took < 120, took  # bounded: sqlite's 20 s busy timeout per try, and runtime.registry_wait
    assert state(paths.root) == before  # no version, no alias: nothing half-registered
    names = [r[0] for r in sqlite3.connect(paths.root / "mlflow.db").execute("select version from model_versions")]
    assert names == [1]


def test_the_mlflow_server_stopped_during_promotion_fails_the_stage_after_retries_and_the_champion_stays(
        restore: Callable[[str], Paths], tmp_path: Path) -> None:
    paths = restore("evaluated")
    set_params(paths.root, "runtime", registry_wait=4)
    before = state(paths.root)
    port = _port()
    args = ["server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{paths.root / 'mlflow.db'}"]
    server = _server(args, tmp_path / "server.log")
    flag = tmp_path / "at-the-point"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RETRAIN_FAULT", "MLFLOW_"))}
    env |= {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "YOLO_OFFLINE": "true",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"],
            # MLflow's own HTTP retries, short for the test (its defaults back off for minutes)
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
            "RETRAIN_FAULT": "promote.after-register:stall", "RETRAIN_FAULT_FLAG": str(flag)}
    try:
        _wait(f"http://127.0.0.1:{port}/health", server)
        proc = subprocess.Popen([sys.executable, "-m", "retrain", "promote"], cwd=paths.root, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 300
        while not flag.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        _stop(server)  # version 2 is registered; the aliases are not moved yet
        flag.unlink()
        out, err = proc.communicate(timeout=300)
        reap(proc.pid)
    finally:
        if server.poll() is None:
            _stop(server)
    assert proc.returncode == 75 and "Traceback" not in err, err[-3000:]
    [line] = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "move the aliases" in line and "still busy or unreachable after 4 s" in line, line
    assert err.count("model registry busy or unreachable") >= 2, err[-3000:]  # retried with backoff
    after = state(paths.root)
    assert after["aliases"] == before["aliases"] == {"champion": "1", "challenger": "1"}  # the champion stayed
    assert after["versions"] == [1, 2]  # registered before the server went away
    # The server back: the next promotion finds version 2 for this candidate and moves the aliases, no version 3.
    server = _server(args, tmp_path / "server2.log")
    try:
        _wait(f"http://127.0.0.1:{port}/health", server)
        env.pop("RETRAIN_FAULT")
        again = subprocess.run([sys.executable, "-m", "retrain", "promote"], cwd=paths.root, env=env, text=True,
                               capture_output=True, timeout=300)
    finally:
        _stop(server)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is this candidate already" in again.stderr
    final = state(paths.root)
    assert final["versions"] == [1, 2] and final["aliases"]["challenger"] == "2"
