"""The pipeline on the production stack: deployments of the `retrain` work pool, run by workers on other hosts.

One workspace (DVC remote in S3, the registry on the PostgreSQL-backed MLflow server, artifacts in S3, flow runs in
the PostgreSQL-backed Prefect server) is deployed with `prefect deploy --all`; two workers, each in a network
namespace of its own, pick up two runs triggered at once.  Every check reads the real store back.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from stack.services import BUCKETS, Stack
from tests.helpers import flow_run_logs, git, run_cli, run_dvc
from tests.integration.test_flow import STAGES
from tests.topology.conftest import client_env, deploy, stack_workspace, until

pytestmark = pytest.mark.topology


def _logs(client: Any, run_id: Any) -> list[str]:
    return flow_run_logs(run_id)


def _task_runs(client: Any, run_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return sorted(runs, key=lambda r: r.start_time or r.expected_start_time)


def test_two_runs_at_once_on_two_workers_take_turns_use_every_store_and_notify(stack: Stack, prefect: Any,
                                                                               receiver: Any, tmp_path: Path) -> None:
    import psycopg

    from retrain.data.sample import generate

    paths = stack_workspace(stack, tmp_path, "ws-one")
    name = "det-ws-one"
    deploy(stack, paths)
    made = run_cli("automations", "--notify-url", receiver.url, cwd=paths.root, env=client_env(stack, tmp_path / "p"))
    assert made.returncode == 0 and made.stdout.count("automation ready") == 3, made.stdout + made.stderr
    stack.workers(2)
    generate(tmp_path / "samples", batches=1, images_per_batch=16, seed=0)
    shutil.copytree(tmp_path / "samples" / "batch-1", paths.incoming / "batch-1")

    deployments = [prefect.read_deployment_by_name(f"retrain/{d}") for d in ("on-new-batch", "weekly")]
    assert {d.work_pool_name for d in deployments} == {"retrain"}
    # At once, on two workers; two deployments, so only the workspace lock makes them take turns.
    runs = [prefect.create_flow_run_from_deployment(d.id, parameters={"project": ".", "only_if_new": False})
            for d in deployments]
    finals = [until(f"flow run {r.name}", lambda r=r: (s := prefect.read_flow_run(r.id).state) and s.is_final()
                    and s, 420, every=2) for r in runs]
    for run, final in zip(runs, finals, strict=True):
        assert final.is_completed(), (final, _logs(prefect, run.id)[-20:], stack.log("worker-w1").read_text()[-3000:])

    # Each ran on a worker host and reached the servers over the link from that host's own address.
    hosts = set()
    for run in runs:
        where = [m for m in _logs(prefect, run.id) if m.startswith(f"workspace {paths.root}, on ")]
        m = re.search(r", (\d+\.\d+\.\d+\.\d+) -> " + re.escape(stack.prefect_api), where[0] if where else "")
        assert m, where
        hosts.add(m.group(1))
    assert hosts <= {stack.net.address("w1"), stack.net.address("w2")}, hosts

    # They took turns: one trained, the other found nothing to do, and their task runs do not interleave.
    tasks = [_task_runs(prefect, r.id) for r in runs]
    trained, idle = (0, 1) if any(t.name == "ingest-batch-1" for t in tasks[0]) else (1, 0)
    assert [t.name for t in tasks[trained]] == ["ingest-batch-1", *STAGES, "git-commit", "dvc-push"]
    assert [t.name for t in tasks[idle]] == [*STAGES, "dvc-push"]
    first, second = sorted(tasks, key=lambda ts: ts[0].start_time)
    assert max(t.end_time for t in first) <= min(t.start_time for t in second), "the two runs overlapped"

    # Prefect server (PostgreSQL): both flow runs, their logs and the trained run's artifacts.
    with psycopg.connect(stack.pg_dsn("prefect")) as db:
        states = dict(db.execute("SELECT id::text, state_type FROM flow_run WHERE id = ANY(%s::uuid[])",
                                 ([str(r.id) for r in runs],)).fetchall())
        logged = db.execute("SELECT count(*) FROM log WHERE flow_run_id = %s", (str(runs[trained].id),)).fetchone()
        keys = {k for (k,) in db.execute("SELECT key FROM artifact WHERE flow_run_id = %s",
                                         (str(runs[trained].id),)).fetchall()}
    assert set(states.values()) == {"COMPLETED"} and logged is not None and logged[0] > 50
    assert {"retrain-validation", "retrain-evaluation", "retrain-model-version", "retrain-run"} <= keys

    # MLflow server (PostgreSQL): the version and its aliases; its artifacts are objects in the S3 bucket.
    with psycopg.connect(stack.pg_dsn("mlflow")) as db:
        versions = db.execute("SELECT version, run_id FROM model_versions WHERE name = %s", (name,)).fetchall()
        aliases = dict(db.execute("SELECT alias, version FROM registered_model_aliases WHERE name = %s",
                                  (name,)).fetchall())
    assert [v for v, _ in versions] == [1] and aliases == {"champion": 1, "challenger": 1}
    s3 = stack.s3_client()
    objects = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKETS[0]).get("Contents", [])]
    assert any(versions[0][1] in k for k in objects), objects[:10]

    # DVC remote (S3): the master's objects; a clone on another host pulls them with an empty cache, verified.
    lock = yaml.safe_load((paths.root / "dvc.lock").read_text())
    master_md5 = next(o["md5"] for o in lock["stages"]["merge"]["outs"] if o["path"] == "data/master")
    dvc_keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKETS[1], Prefix="ws-one/").get("Contents", [])}
    assert f"ws-one/files/md5/{master_md5[:2]}/{master_md5[2:]}" in dvc_keys
    clone = tmp_path / "clone"
    git("clone", "-q", str(paths.root), str(clone), cwd=tmp_path)
    pull = stack.popen("n0", [sys.executable, "-m", "dvc", "pull", "-q"], cwd=clone, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    out, _ = pull.communicate(timeout=180)
    assert pull.returncode == 0, out
    assert (clone / "data" / "master" / "annotations.json").read_bytes() == \
        (paths.master / "annotations.json").read_bytes()
    assert "Data and pipelines are up to date." in run_dvc("status", cwd=paths.root)

    # The champion moved: promote's event reached the server, whose automation POSTed to the receiver.
    moved = until("the champion-moved notification", lambda: [r for r in receiver.received
                                                              if f"{name}@champion is version 1" in r["subject"]], 60)
    assert "replaced none" in moved[0]["body"], moved

    # A run that fails (a refused batch) is a notification too, naming the run and its state.
    bad = paths.incoming / "bad"
    shutil.copytree(tmp_path / "samples" / "batch-1", bad)
    (bad / "annotations.json").write_text("{not json")
    run = prefect.create_flow_run_from_deployment(deployments[0].id)
    final = until("the failing run", lambda: (s := prefect.read_flow_run(run.id).state) and s.is_final() and s, 180)
    assert final.is_failed(), final
    failed = until("the failure notification", lambda: [r for r in receiver.received
                                                        if f"retrain run {run.name}: Failed" in r["subject"]], 60)
    assert "bad" in failed[0]["body"], failed
    shutil.rmtree(bad)

    # Back to the embedded defaults: the champion comes out of the server (its file from S3, through the server's
    # proxy) into a local sqlite registry, as its champion there.
    back = f"sqlite:///{tmp_path / 'back' / 'mlflow.db'}"
    (tmp_path / "back").mkdir()
    copied = run_cli("registry-copy", "--from", stack.mlflow_url, "--to", back, cwd=paths.root,
                     env=client_env(stack, tmp_path / "p"))
    assert copied.returncode == 0 and "version 1 (registered; version 1 of" in copied.stdout, copied.stderr[-2000:]
    import mlflow

    local, server = mlflow.MlflowClient(back, back), mlflow.MlflowClient(stack.mlflow_url, stack.mlflow_url)
    assert local.get_model_version_by_alias(name, "champion").tags["retrain.data_version"] == \
        server.get_model_version(name, "1").tags["retrain.data_version"]

    # No secret of the stack (PostgreSQL passwords, either S3 secret key) is in any store, log, report or DVC file.
    found = secrets_in(stack, [paths.root, stack.state / "logs", tmp_path / "p", tmp_path / "back"])
    assert found == {}, found


def secrets_in(stack: Stack, folders: list[Path]) -> dict[str, list[str]]:
    """Where the stack's secrets appear: both databases (pg_dump), every object of both buckets, files in folders."""
    canaries = {k: v for k, v in stack.secrets.items() if k in ("pg_mlflow", "pg_prefect", "mlflow_secret",
                                                                  "dvc_secret")}
    places: dict[str, bytes] = {}
    for db in ("mlflow", "prefect"):
        places[f"postgresql:{db}"] = stack.dump_database(db)
    s3 = stack.s3_client()
    for bucket in BUCKETS:
        for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            places[f"s3://{bucket}/{o['Key']}"] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    for folder in folders:
        for f in folder.rglob("*"):
            if f.is_file() and ".git" not in f.parts[len(folder.parts):][:1] and f.stat().st_size < 50_000_000:
                places[str(f)] = f.read_bytes()
    git_log = git("log", "-p", "--all", cwd=folders[0]).encode()
    places["git history"] = git_log
    return {name: [where for where, data in places.items() if value.encode() in data]
            for name, value in canaries.items() if any(value.encode() in d for d in places.values())}
