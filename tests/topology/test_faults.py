"""Faults of the production topology, each on the real stack: PostgreSQL restarted under promote, the S3 endpoint
stopped during the artifact upload and during `dvc push`, a worker host killed in training, a duplicate run for a
schedule slot, objects lost from the DVC remote.

One workspace is built once (batch 1 ingested, a candidate trained and evaluated on the stack, no champion) and
restored at the same path before each test; each test registers under a model name of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from retrain.paths import Paths
from stack.services import BUCKETS, Stack
from tests.faults.conftest import error_lines
from tests.helpers import git, run_cli, run_dvc, set_params
from tests.topology.conftest import client_env, deploy, stack_workspace, until

pytestmark = [pytest.mark.topology, pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(2400)]


def _versions(stack: Stack, name: str) -> tuple[list[int], dict[str, int]]:
    import psycopg

    with psycopg.connect(stack.pg_dsn("mlflow")) as db:
        versions = sorted(v for (v,) in db.execute("SELECT version FROM model_versions WHERE name = %s", (name,)))
        aliases = dict(db.execute("SELECT alias, version FROM registered_model_aliases WHERE name = %s",
                                  (name,)).fetchall())
    return versions, aliases


@pytest.fixture(scope="module")
def built(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from retrain.data.sample import generate

    base = tmp_path_factory.mktemp("topology-faults")
    generate(base / "samples", batches=2, images_per_batch=16, seed=0)
    paths = stack_workspace(stack, base / "work", "ws-fault")
    env = client_env(stack, base / "prefect")
    run_cli("ingest", base / "samples" / "batch-1", cwd=paths.root, env=env, check=True)
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "evaluate"], cwd=paths.root, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    git("add", "-A", cwd=paths.root)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "evaluated", cwd=paths.root)
    shutil.copytree(base / "work", base / "saved", symlinks=True)
    return {"base": base, "paths": paths, "env": env}


@pytest.fixture
def restore(built: dict[str, Any]) -> Callable[[str], Paths]:
    def go(model: str) -> Paths:
        base = built["base"]
        shutil.rmtree(base / "work")
        shutil.copytree(base / "saved", base / "work", symlinks=True)
        paths: Paths = built["paths"]
        set_params(paths.root, "registry", model_name=model)
        git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qam", f"model {model}", cwd=paths.root)
        return paths
    return go


def _promote_stalled(paths: Paths, env: dict[str, str], flag: Path) -> subprocess.Popen[str]:
    full = {**env, "RETRAIN_FAULT": "promote.log-model:stall", "RETRAIN_FAULT_FLAG": str(flag),
            "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"]}
    proc = subprocess.Popen([sys.executable, "-m", "retrain", "promote"], cwd=paths.root, env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    until("promote to reach the artifact upload", lambda: flag.exists() or proc.poll() is not None, 300, 0.2)
    assert proc.poll() is None, proc.communicate()
    return proc


def test_postgres_down_and_back_while_promote_runs_registers_once(stack: Stack, built: dict[str, Any],
                                                                  restore: Callable[[str], Paths],
                                                                  tmp_path: Path) -> None:
    paths = restore("det-pg")
    flag = tmp_path / "stalled"
    proc = _promote_stalled(paths, built["env"], flag)
    stack.stop_postgres()  # every connection of the MLflow server is dropped; new ones are refused
    flag.unlink()
    time.sleep(15)  # promote's calls fail meanwhile, and are retried
    stack.start_postgres_again()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err[-4000:]
    assert "registered and promoted" in out
    assert _versions(stack, "det-pg") == ([1], {"champion": 1, "challenger": 1})
    import json

    import mlflow

    tags = mlflow.MlflowClient(tracking_uri=stack.mlflow_url).get_registered_model("det-pg").tags
    history = json.loads(tags.get("retrain.champion_history", "[]"))
    assert len(history) == 1, history  # the alias moved once


def test_s3_down_during_the_artifact_upload_registers_nothing_then_once(stack: Stack, built: dict[str, Any],
                                                                       restore: Callable[[str], Paths],
                                                                       tmp_path: Path) -> None:
    paths = restore("det-s3")
    set_params(paths.root, "runtime", registry_wait=20)  # bounded: the test waits for the give-up
    env = {**built["env"], "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    flag = tmp_path / "stalled"
    proc = _promote_stalled(paths, env, flag)
    stack.stop_endpoint()
    try:
        flag.unlink()
        out, err = proc.communicate(timeout=600)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        errors = error_lines(result)
        assert proc.returncode == 75 and len(errors) == 1, err[-4000:]
        assert stack.mlflow_url in errors[0] and "Traceback" not in err, errors
        assert _versions(stack, "det-s3") == ([], {})  # no version points at artifacts that are not there
    finally:
        stack.start_endpoint()
    again = run_cli("promote", cwd=paths.root, env=built["env"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert _versions(stack, "det-s3") == ([1], {"champion": 1, "challenger": 1})
    import mlflow

    # Read back through the server, as a machine with no local files would (its registry is the server too).
    source = mlflow.MlflowClient(stack.mlflow_url, stack.mlflow_url).get_model_version_download_uri("det-s3", "1")
    got = mlflow.artifacts.download_artifacts(source, dst_path=str(tmp_path / "dl"), tracking_uri=stack.mlflow_url)
    assert any(p.name == "model.pt" for p in Path(got).rglob("*")), list(Path(got).rglob("*"))


def test_s3_down_during_dvc_push_fails_the_run_naming_the_endpoint_and_the_next_run_pushes(
        stack: Stack, built: dict[str, Any], restore: Callable[[str], Paths], tmp_path: Path) -> None:
    paths = restore("det-push")
    set_params(paths.root, "retrain", retries=1, retry_delay=1)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qam", "retries 1", cwd=paths.root)
    flag = tmp_path / "stalled"
    env = {**built["env"], "RETRAIN_FAULT": "push.before:stall", "RETRAIN_FAULT_FLAG": str(flag),
           "AWS_MAX_ATTEMPTS": "2", "PATH": os.path.dirname(sys.executable) + os.pathsep + built["env"]["PATH"]}
    proc = subprocess.Popen([sys.executable, "-m", "retrain", "run"], cwd=paths.root, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    until("the run to reach dvc push", lambda: flag.exists() or proc.poll() is not None, 600, 0.5)
    assert proc.poll() is None, proc.communicate()
    stack.stop_endpoint()
    try:
        flag.unlink()
        out, err = proc.communicate(timeout=600)
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1, err[-4000:]
        assert stack.s3_url in errors[0] and "dvc push" in errors[0], errors
    finally:
        stack.start_endpoint()
    assert _versions(stack, "det-push")[0] == [1]  # promote ran before the push
    proc2 = run_cli("run", cwd=paths.root, env={**built["env"], "RETRAIN_FAULT": ""})
    assert proc2.returncode == 0 and "nothing to retrain" in proc2.stdout, proc2.stderr[-3000:]
    assert _versions(stack, "det-push")[0] == [1]  # registered once
    check = run_cli("check-remote", cwd=paths.root, env=built["env"])
    assert check.returncode == 0 and "restores" in check.stdout, check.stderr


def test_objects_lost_from_the_remote_pass_dvc_s_own_view_and_are_caught_by_a_fresh_pull(
        stack: Stack, built: dict[str, Any], restore: Callable[[str], Paths]) -> None:
    paths = restore("det-remote")
    env = built["env"]
    proc = subprocess.run([sys.executable, "-m", "dvc", "push", "-q"], cwd=paths.root, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    ok = run_cli("check-remote", cwd=paths.root, env=env)
    assert ok.returncode == 0, ok.stderr

    s3 = stack.s3_client()
    import hashlib
    import json

    image = json.loads((paths.master / "annotations.json").read_text())["images"][0]["file_name"]
    md5 = hashlib.md5((paths.data / image).read_bytes()).hexdigest()
    key = f"ws-fault/files/md5/{md5[:2]}/{md5[2:]}"
    s3.delete_object(Bucket=BUCKETS[1], Key=key)  # what a push cut off after the manifests leaves
    for args, says in ((["push"], "Everything is up to date."), (["status", "--cloud"], "in sync")):
        proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=paths.root, env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0 and says in proc.stdout, proc.stdout + proc.stderr  # DVC's own view: complete
    lost = run_cli("check-remote", cwd=paths.root, env=env)
    errors = error_lines(lost)
    assert lost.returncode == 1 and len(errors) == 1 and "cannot restore" in errors[0], lost.stderr
    assert f"data/{image}" in errors[0] or f"data/master/{Path(image).name}" in errors[0], errors

    s3.put_object(Bucket=BUCKETS[1], Key=key, Body=b"not what was pushed")  # an object damaged in the bucket
    damaged = run_cli("check-remote", cwd=paths.root, env=env)
    assert damaged.returncode == 1 and "cannot restore" in damaged.stderr, damaged.stderr
    assert run_dvc("remote", "list", cwd=paths.root)


def test_a_worker_host_killed_in_training_is_crashed_by_the_server_and_the_next_run_resumes(
        stack: Stack, built: dict[str, Any], restore: Callable[[str], Paths], tmp_path: Path, prefect: Any) -> None:
    paths = restore("det-zombie")
    set_params(paths.root, "train", epochs=30)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qam", "30 epochs", cwd=paths.root)
    made = run_cli("automations", cwd=paths.root, env=built["env"])
    assert made.returncode == 0 and "crash zombie runs" in made.stdout, made.stderr
    deploy(stack, paths)
    stack.workers(2)
    shutil.copytree(built["base"] / "samples" / "batch-2", paths.incoming / "batch-2")
    weekly = prefect.read_deployment_by_name("retrain/weekly")
    run = prefect.create_flow_run_from_deployment(weekly.id)
    until("an epoch's checkpoint", lambda: (paths.checkpoints / "last.ckpt").is_file(), 600, 0.5)
    host = next(h for h in ("w1", "w2") if any("prefect.engine" in _cmdline(p) for p in stack.net.pids(h)))
    stack.net.kill(host, grace=0)  # the worker, the flow run and its stages, as a host losing power
    t0 = time.monotonic()
    crashed = until("the server to mark the run Crashed", lambda: (s := prefect.read_flow_run(run.id).state)
                    and s.is_crashed() and s, 300, every=2)
    took = time.monotonic() - t0
    assert "heartbeat" in (crashed.message or ""), crashed
    print(f"marked Crashed {took:.0f} s after the host died")

    nxt = prefect.create_flow_run_from_deployment(weekly.id)  # the slot is free: it starts on the other worker
    final = until("the next run", lambda: (s := prefect.read_flow_run(nxt.id).state) and s.is_final() and s, 900, 2)
    assert final.is_completed(), final
    from tests.topology.test_stack import _logs

    other = stack.net.address("w2" if host == "w1" else "w1")
    logs = until("the next run's logs", lambda: (ms := _logs(prefect, nxt.id)) and any(
        m.startswith("retrain: data ") for m in ms) and ms, 60)  # the flow's last line
    assert any(f", {other} -> " in m for m in logs), [m for m in logs if "workspace" in m]
    assert any("resuming from" in m for m in logs), logs[-30:]
    assert _versions(stack, "det-zombie")[0] == [1]

    # A duplicate run for a schedule slot (a redeploy can make one) does nothing.
    from prefect.states import Scheduled

    slot = prefect.read_flow_run(nxt.id).expected_start_time
    assert slot is not None
    dup = prefect.create_flow_run_from_deployment(weekly.id, state=Scheduled(scheduled_time=slot))
    done = until("the duplicate", lambda: (s := prefect.read_flow_run(dup.id).state) and s.is_final() and s, 300, 2)
    assert done.is_completed(), done
    # A run's last log lines reach the server after its final state (Prefect ships logs in batches).
    until("the duplicate's log line", lambda: any("a duplicate run for the slot" in m for m in _logs(prefect, dup.id)),
          60)
    stack.workers(2)  # the dead host's worker back for the tests after this one


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
