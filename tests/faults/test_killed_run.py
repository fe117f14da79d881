"""Fault: the flow's process SIGKILLed in the middle of training (a real `retrain run` process).

Nothing of the run may go on behind the next one's back (the stage processes die with the flow), its Prefect
flow run is left `Running` until the next run marks it `Crashed`, and the next run finishes the job once: it resumes
the training from the last checkpoint and registers one version.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import git, load_json, registry_state, run_cli, run_dvc, set_params
from tests.integration.test_flow import arrive, cli_env, tiny_workspace

pytestmark = [pytest.mark.faults, pytest.mark.slow]

READ_RUNS = """
import json
from prefect import get_client
with get_client(sync_client=True) as client:
    runs = sorted(client.read_flow_runs(), key=lambda r: r.created)
    print(json.dumps([[str(r.id), r.state.type.value if r.state else None] for r in runs]))
"""


def _flow_runs(env: dict[str, str]) -> list[list[str]]:
    proc = subprocess.run([sys.executable, "-c", READ_RUNS], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stage_processes(root: psutil.Process) -> list[psutil.Process]:
    """The flow's stage processes (dvc and the `retrain <stage>` it runs), not Prefect's local API server."""
    out = []
    for p in root.children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "dvc" in line or "retrain" in line.split("prefect")[0]:
            out.append(p)
    return out


def test_a_run_killed_in_training_leaves_nothing_running_and_the_next_run_finishes_the_job(tmp_path: Path) -> None:
    from retrain.data.sample import generate

    generate(tmp_path / "samples", batches=1, images_per_batch=16, seed=0)
    paths = tiny_workspace(tmp_path)
    set_params(paths.root, "train", epochs=30)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qam", "30 epochs", cwd=paths.root)
    arrive(tmp_path / "samples", "batch-1", paths)
    env = cli_env(tmp_path / "prefect")
    full_env = {**env, "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"]}
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "retrain", "run"], cwd=paths.root, env=full_env, stdout=log,
                            stderr=subprocess.STDOUT)
    leftovers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while not (paths.checkpoints / "last.ckpt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.5)
        leftovers = psutil.Process(proc.pid).children(recursive=True)
        stage = _stage_processes(psutil.Process(proc.pid))
        assert any("train" in " ".join(p.cmdline()) for p in stage), [p.cmdline() for p in stage]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(stage, timeout=20)
        assert not alive, [p.cmdline() for p in alive]  # dvc and `retrain train` died with the flow
    finally:
        log.close()
        for p in leftovers:  # Prefect's local API server of the killed process is an orphan: not ours to keep
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    assert registry_state(paths.root)["versions"] == []
    killed = _flow_runs(full_env)
    assert [state for _, state in killed] == ["RUNNING"], killed

    again = run_cli("run", "--json", cwd=paths.root, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["ingested"] == [] and summary["stages"]["train"] is True and summary["version"] == "1"
    assert "resuming from" in again.stderr and "marked Crashed" in again.stderr, again.stderr[-3000:]
    runs = dict(_flow_runs(full_env))
    assert runs[killed[0][0]] == "CRASHED" and sorted(runs.values()) == ["COMPLETED", "CRASHED"], runs
    assert registry_state(paths.root)["versions"] == [1]  # the job done once
    assert load_json(paths.merge_report)["totals"]["batches"] == 1
    assert "up to date" in run_dvc("status", cwd=paths.root)
