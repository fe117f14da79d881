"""The production stack for the topology tests: started once for the session in a folder of its own, then stopped.

It is the same stack ``scripts/stack up`` starts (``stack/services.py``), under another prefix and network so that a
developer's own stack can run beside it.  Every test here is marked ``topology`` (its module's ``pytestmark``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from retrain.paths import Paths
from stack.net import Net
from stack.services import Stack
from tests.helpers import set_params, set_train_params
from tests.integration.test_flow import TINY_TRAIN

PREFIX, NET = "rtt", "10.231.77"


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """PostgreSQL, S3, the MLflow and Prefect servers on host ``srv``; nothing of it is left after the session."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the stack needs root and iproute2 (network namespaces)")
    Stack(Path("/nonexistent"), Net(PREFIX, NET)).net.remove_all()  # what a killed earlier session left
    state = Path(tempfile.mkdtemp(prefix="retrain-topology-"))
    s = Stack.at(state, PREFIX, NET)
    t0 = time.perf_counter()
    s.up()
    print(f"stack up in {time.perf_counter() - t0:.1f} s")
    try:
        yield s
    finally:
        logs = state / "logs"
        keep = Path(os.environ.get("RETRAIN_TOPOLOGY_LOGS", ""))
        if keep.name and logs.is_dir():
            shutil.copytree(logs, keep, dirs_exist_ok=True)
        s.down()
        left = {h: s.net.pids(h) for h in s.net.hosts()}
        assert not left and not state.exists(), f"the stack left {left}"
        assert subprocess.run(["ip", "link", "show", s.net.bridge], capture_output=True).returncode != 0


def stack_workspace(stack: Stack, base: Path, name: str) -> Paths:
    """A workspace on the stack: DVC remote ``s3://retrain-dvc/NAME``, its own registered model, tiny training."""
    from retrain.workspace import init_workspace
    from tests.helpers import git

    paths = init_workspace(base / name, remote=f"{stack.client_env()['RETRAIN_DVC_REMOTE']}/{name}")
    set_train_params(paths.root, **TINY_TRAIN)
    set_params(paths.root, "evaluate", bootstrap=20)
    set_params(paths.root, "promote", min_map=0.0)
    set_params(paths.root, "registry", model_name=f"det-{name}", experiment=f"retrain-{name}")
    git("add", "-A", cwd=paths.root)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "stack params", cwd=paths.root)
    return paths


def client_env(stack: Stack, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
    return {**env, **stack.client_env(), "PREFECT_HOME": str(home), "YOLO_OFFLINE": "true",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"]}


def deploy(stack: Stack, paths: Paths) -> None:
    """``prefect deploy --all`` from the workspace (its prefect.yaml), as a user does."""
    stack.prefect_cli("deploy", "--all", cwd=paths.root)


def until(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


@pytest.fixture
def prefect(stack: Stack) -> Iterator[Any]:
    """A Prefect client of the stack's server (sync)."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.prefect_api}), get_client(sync_client=True) as client:
        yield client


@pytest.fixture
def receiver(stack: Stack) -> Iterator[Any]:
    """A small HTTP receiver on the machine's own address on the bridge; ``.received`` is what was POSTed."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append(json.loads(body or b"{}"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((stack.net.gateway, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.received = received  # type: ignore[attr-defined]
    server.url = f"http://{stack.net.gateway}:{server.server_address[1]}/hook"  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
