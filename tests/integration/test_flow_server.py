"""Against a real `prefect server start` on 127.0.0.1: `retrain serve` registers the deployments, a deployment run
goes through the DVC stages, the Prefect client reads its task runs and artifacts, and the UI shows them
(headless Chromium: a screenshot and the rendered page's text)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers import flow_run_contents, registry_state
from tests.integration.test_flow import STAGES, arrive, tiny_workspace


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(what: str, check: Any, timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # not up yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """`prefect server start` on a free port with its own database; stopped after the test."""
    port = _port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_API_URL=api, PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"])
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _until("the Prefect server", lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 180)
        yield SimpleNamespace(api=api, ui=f"http://127.0.0.1:{port}", env={**env, "PREFECT_API_URL": api})
    finally:
        _stop(proc)
        log.close()


def test_a_served_deployment_runs_the_stages_on_a_real_prefect_server(prefect_server: SimpleNamespace,
                                                                      tmp_path: Path) -> None:
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from retrain.data.sample import generate

    generate(tmp_path / "samples", batches=1, images_per_batch=16, seed=0)
    paths = tiny_workspace(tmp_path)
    arrive(tmp_path / "samples", "batch-1", paths)
    log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen([sys.executable, "-m", "retrain", "serve"], cwd=paths.root, env=prefect_server.env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api}), get_client(sync_client=True) as client:
            weekly = _until("retrain/weekly", lambda: client.read_deployment_by_name("retrain/weekly"), 120)
            poll = _until("retrain/on-new-batch", lambda: client.read_deployment_by_name("retrain/on-new-batch"), 60)
            cron = weekly.schedules[0].schedule
            assert (cron.cron, cron.timezone) == ("0 3 * * 1", "UTC")  # params.yaml's retrain.schedule
            assert poll.schedules[0].schedule.interval.total_seconds() == 600
            for d in (weekly, poll):  # one run at a time; a second one queues
                assert d.global_concurrency_limit is not None and d.global_concurrency_limit.limit == 1
                assert d.concurrency_options is not None and d.concurrency_options.collision_strategy == "ENQUEUE"
            assert poll.parameters == {"project": str(paths.root), "only_if_new": True}

            run = client.create_flow_run_from_deployment(poll.id)
            final = _until("the flow run to finish", lambda: (s := client.read_flow_run(run.id).state)
                           and s.is_final() and s, 600, every=2)
            assert final.is_completed(), (final, (tmp_path / "serve.log").read_text()[-3000:])
            names, artifacts = flow_run_contents(run.id)
            flow_run = client.read_flow_run(run.id)
        assert names == ["ingest-batch-1", *STAGES, "git-commit", "dvc-push"]
        assert {"retrain-validation", "retrain-training", "retrain-evaluation", "retrain-per-class-ap",
                "retrain-model-version", "retrain-mlflow-run", "retrain-run"} <= set(artifacts)
        assert "## Decision" in artifacts["retrain-evaluation"].data
        assert registry_state(paths.root)["aliases"] == {"champion": "1", "challenger": "1"}
    finally:
        _stop(serve)
        log.close()

    # The same deployments from the workspace's prefect.yaml, for a process work pool (no worker started here).
    prefect = [sys.executable, "-m", "prefect", "--no-prompt"]
    for args in (["work-pool", "create", "retrain", "--type", "process"], ["deploy", "--all"]):
        proc = subprocess.run([*prefect, *args], cwd=paths.root, env={**prefect_server.env, "PWD": str(paths.root)},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with temporary_settings({PREFECT_API_URL: prefect_server.api}), get_client(sync_client=True) as client:
        deployed = {n: client.read_deployment_by_name(f"retrain/{n}") for n in ("weekly", "on-new-batch")}
    for name, d in deployed.items():
        assert d.work_pool_name == "retrain" and d.entrypoint == "flows.retrain:retrain", (name, d)
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(paths.root)}}]
    assert deployed["weekly"].schedules[0].schedule.cron == "0 3 * * 1"

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no headless Chromium here: the UI page was not looked at (everything above passed)")
    url = f"{prefect_server.ui}/runs/flow-run/{run.id}"
    shot = Path(os.environ.get("RETRAIN_SCREENSHOTS", tmp_path)) / "prefect-flow-run.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    common = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1600,1200", "--virtual-time-budget=20000"]
    subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=False)
    assert shot.is_file() and shot.stat().st_size > 50_000, "no screenshot of the flow run page"
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    shot.with_suffix(".html").write_text(dom)  # what the browser rendered, beside the screenshot
    # The page rendered the run from the API: its name, state and task-run count, and the first page of its logs,
    # tagged with the task runs they came from (the timeline of all task runs is a canvas: see the screenshot).
    assert flow_run.name in dom and "Completed" in dom and "8 Task runs" in dom, dom[-2000:]
    for task_run in ("ingest-batch-1", "merge", "validate", "train"):
        assert task_run in dom, task_run
    assert "Can't connect to Server API" not in dom
