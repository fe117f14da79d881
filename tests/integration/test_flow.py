"""The retrain flow for real: Prefect (``prefect_test_harness``), DVC in a temp git repo, sqlite MLflow, Lightning.

One workspace (3 generated batches of 16 images, yolo11n at imgsz 64 for 3 epochs) is driven through the flow:
batch 1 (the first champion), a run with nothing new, a bad batch, batch 2; a clone of the same workspace is driven
by `retrain ingest` + `dvc repro` alone and must end in the same data versions and registry decisions.  Two
`retrain run` processes started together must take turns.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from retrain.paths import Paths
from retrain.workspace import master_dvc_md5
from tests.helpers import (
    flow_run_contents,
    flow_run_logs,
    git,
    load_json,
    registry_state,
    run_cli,
    run_dvc,
    set_params,
    set_train_params,
    tree_hash,
)

STAGES = ["merge", "validate", "audit", "train", "evaluate", "promote"]
TINY_TRAIN = {"imgsz": 64, "epochs": 3, "batch": 8, "cache": "ram", "eval_interval": 1, "workers": 0,
              "augment": {"close_mosaic": 1}}


def tiny_workspace(base: Path, name: str = "ws") -> Paths:
    """A workspace with a tiny training config, committed, with its DVC remote under ``base``."""
    from retrain.workspace import init_workspace

    paths = init_workspace(base / name, remote=str(base / f"{name}-remote"))
    set_train_params(paths.root, **TINY_TRAIN)
    set_params(paths.root, "evaluate", bootstrap=20)
    set_params(paths.root, "promote", min_map=0.0)
    git("add", "-A", cwd=paths.root)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "tiny params", cwd=paths.root)
    return paths


def arrive(samples: Path, batch: str, paths: Paths) -> None:
    shutil.copytree(samples / batch, paths.incoming / batch)


def cli_env(prefect_home: Path) -> dict[str, str]:
    """A `retrain` process on its own local (ephemeral) Prefect API, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return {**env, "PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


@pytest.fixture(scope="module")
def first(harness: Any, samples: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The workspace after the flow's first run (batch 1 waiting in data/incoming/)."""
    from flows.retrain import outcome, retrain

    base = tmp_path_factory.mktemp("flow")
    paths = tiny_workspace(base)
    rev0 = git("rev-parse", "HEAD", cwd=paths.root).strip()
    arrive(samples, "batch-1", paths)
    (paths.root / "export.csv").write_text("left here by the user: not the run's to commit\n")
    state = retrain(project=str(paths.root), return_state=True)
    return SimpleNamespace(paths=paths, base=base, rev0=rev0, state=state, summary=outcome(state))


def test_the_flow_runs_the_dvc_stages_then_has_nothing_to_retrain(first: SimpleNamespace) -> None:
    from flows.retrain import outcome, retrain

    paths, s = first.paths, first.summary
    assert s["ingested"] == ["batch-1"] and s["stages"] == dict.fromkeys(STAGES, True)
    assert s["version"] == "1" and s["promoted"] is True and s["data_dvc_md5"] == master_dvc_md5(paths)
    assert not (paths.incoming / "batch-1").exists() and (paths.incoming / ".ingested" / "batch-1").is_dir()

    names, artifacts = flow_run_contents(first.state.state_details.flow_run_id)
    assert names == ["ingest-batch-1", *STAGES, "git-commit", "dvc-push"]
    assert {"retrain-validation", "retrain-training", "retrain-evaluation", "retrain-per-class-ap",
            "retrain-model-version", "retrain-mlflow-run", "retrain-run"} <= set(artifacts)
    assert float(artifacts["retrain-training"].data) == 100.0
    assert "## Decision" in artifacts["retrain-evaluation"].data and "promoted" in artifacts["retrain-evaluation"].data
    table = json.loads(artifacts["retrain-per-class-ap"].data)
    assert {r["class"] for r in table} == set(load_json(paths.eval_report)["candidate"]["metrics"]["per_class"])
    assert "/#/models/retrain-detector/versions/1)" in artifacts["retrain-model-version"].data
    assert "/runs/" in artifacts["retrain-mlflow-run"].data
    assert "| 1 (champion) | " in artifacts["retrain-history"].data  # the quality history: one row per version
    assert (paths.reports / "history.png").is_file()

    # What the UI's log shows a user: no library noise, and no stage line twice (a log record and the command's
    # printed result saying the same).
    logs = flow_run_logs(first.state.state_details.flow_run_id)
    noise = ("litlogger", "LeafSpec", "non-deterministic", "Overriding model.yaml", "Experiment logs directory",
             "Add type hints", "Warning", "warn(", "not found. Creating it")
    assert not [m for m in logs if any(n in m for n in noise)], [m for m in logs if any(n in m for n in noise)]
    records = {m.split(": ", 1)[1] for m in logs if re.match(r"^(INFO|WARNING) retrain[.a-z_]*: ", m)}
    twice = [m for m in logs if m in records or any(m.startswith(r) and len(r) > 20 for r in records)]
    assert not twice, twice

    # Versioned: one commit naming the data version and the decision; nothing left uncommitted; data pushed.
    message = git("log", "-1", "--format=%s", cwd=paths.root)
    assert s["data_dvc_md5"][:12] in message and "retrain-detector v1 promoted" in message, message
    assert git("status", "--porcelain", cwd=paths.root).strip() == "?? export.csv"  # the user's stray file
    assert "up to date" in run_dvc("status", cwd=paths.root)
    assert "Running stage" not in run_dvc("repro", cwd=paths.root)
    assert "in sync" in run_dvc("status", "--cloud", cwd=paths.root)

    # Nothing new: the next run does nothing, and touches neither the registry nor the data. (How long it takes is
    # printed, not asserted: a wall-clock bound failed on a loaded CI machine, and timings belong to bench/.)
    def state_now() -> tuple[Any, ...]:
        return (tree_hash(paths.master), tree_hash(paths.root / "dvc.lock"), registry_state(paths.root),
                git("rev-parse", "HEAD", cwd=paths.root))

    before = state_now()
    t0 = time.perf_counter()
    state = retrain(project=str(paths.root), return_state=True)
    print(f"a run with nothing to retrain: {time.perf_counter() - t0:.1f} s")
    again = outcome(state)
    assert again["nothing_to_retrain"] is True and not any(again["stages"].values()), again
    names, _ = flow_run_contents(state.state_details.flow_run_id)
    assert names == [*STAGES, "dvc-push"]  # each stage asked DVC, which said it is up to date; push is a no-op
    assert state_now() == before

    # The same from the command line, on its own local Prefect API, as a user types it (most of its time is that API
    # starting in a new process; then each stage asks DVC, a process each).
    t0 = time.perf_counter()
    proc = run_cli("run", cwd=paths.root, env=cli_env(first.base / "prefect-cli"))
    print(f"`retrain run` with nothing to retrain, a new local Prefect API included: {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0 and "nothing to retrain" in proc.stdout, proc.stdout + proc.stderr
    assert "Running stage" not in proc.stdout + proc.stderr
    assert state_now() == before


def test_a_bad_batch_fails_the_run_at_ingest_and_changes_nothing(first: SimpleNamespace, samples: Path) -> None:
    from flows.retrain import retrain
    from retrain.errors import BatchRejected

    paths = first.paths
    bad = paths.incoming / "bad-batch"
    shutil.copytree(samples / "batch-2", bad)
    doc = load_json(bad / "annotations.json")
    doc["annotations"][0]["bbox"][0] = 10_000.0  # far outside its image
    (bad / "annotations.json").write_text(json.dumps(doc))
    before = (tree_hash(paths.data / "batches"), tree_hash(paths.master), tree_hash(paths.root / "dvc.lock"),
              registry_state(paths.root), git("rev-parse", "HEAD", cwd=paths.root),
              git("status", "--porcelain", cwd=paths.root))

    state = retrain(project=str(paths.root), return_state=True)
    assert state.is_failed()
    assert isinstance(state.result(raise_on_failure=False), BatchRejected)
    names, artifacts = flow_run_contents(state.state_details.flow_run_id)
    assert names == ["ingest-bad-batch"]  # failed at ingest: no stage ran
    assert "box-inside-image" in artifacts["retrain-ingest-refused"].data

    proc = run_cli("run", cwd=paths.root, env=cli_env(first.base / "prefect-cli"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: batch bad-batch: annotations.json annotation 1: [box-inside-image]" in proc.stderr, proc.stderr

    after = (tree_hash(paths.data / "batches"), tree_hash(paths.master), tree_hash(paths.root / "dvc.lock"),
             registry_state(paths.root), git("rev-parse", "HEAD", cwd=paths.root),
             git("status", "--porcelain", cwd=paths.root))
    assert after == before
    assert bad.is_dir()  # left waiting, for a person to fix or remove
    shutil.rmtree(bad)


def test_a_validation_failure_stops_the_run_before_training_with_the_summary(first: SimpleNamespace) -> None:
    from flows.retrain import retrain
    from tasks.stages import StageFailed

    paths = first.paths
    params = (paths.root / "params.yaml").read_text()
    set_params(paths.root, "validate", val_fraction_min=0.45, val_fraction_level="fail")  # the master has ~20% in val
    before = (tree_hash(paths.master), tree_hash(paths.candidate), registry_state(paths.root))
    try:
        state = retrain(project=str(paths.root), return_state=True)
    finally:
        (paths.root / "params.yaml").write_text(params)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, StageFailed) and error.stage == "validate", error
    names, artifacts = flow_run_contents(state.state_details.flow_run_id)
    assert names == ["merge", "validate"]  # failed at once: no retry, nothing after it
    summary = artifacts["retrain-validation"].data
    assert "FAILED" in summary and "val-fraction" in summary and "index.html" in summary, summary
    assert (tree_hash(paths.master), tree_hash(paths.candidate), registry_state(paths.root)) == before
    # Only the validation report changed (it says what failed), and the pass record of this master is gone.
    changed = {line[3:] for line in git("status", "--porcelain", cwd=paths.root).splitlines()} - {"export.csv"}
    assert changed == {"reports/validation.json", "reports/validated.json"}, changed


def test_an_unreachable_dvc_remote_is_retried_with_backoff_then_fails_with_the_reason(first: SimpleNamespace) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.retrain import retrain
    from retrain.errors import TransientError

    paths = first.paths
    params = (paths.root / "params.yaml").read_text()
    set_params(paths.root, "retrain", retries=2, retry_delay=0.2)
    run_dvc("remote", "modify", "--local", "store", "url", "http://127.0.0.1:9/dvc-remote", cwd=paths.root)
    try:
        state = retrain(project=str(paths.root), return_state=True)
    finally:
        (paths.root / "params.yaml").write_text(params)
        (paths.root / ".dvc" / "config.local").unlink()
    assert state.is_failed() and isinstance(state.result(raise_on_failure=False), TransientError)
    assert "dvc push" in state.message, state.message
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    push = next(r for r in runs if r.name == "dvc-push")
    assert push.run_count == 3 and push.state is not None and push.state.is_failed()  # 1 try + 2 retries
    assert all(r.run_count == 1 for r in runs if r.name in STAGES)


def test_dvc_repro_alone_gives_the_same_data_versions_and_registry_decisions(first: SimpleNamespace,
                                                                            samples: Path) -> None:
    from flows.retrain import outcome, retrain

    paths = first.paths
    arrive(samples, "batch-2", paths)
    second = outcome(retrain(project=str(paths.root), return_state=True))
    assert second["ingested"] == ["batch-2"] and second["version"] == "2"

    # A clone of the workspace as it was before the first run; no flow, only the CLI and DVC.
    clone = first.base / "clone"
    git("clone", "-q", str(paths.root), str(clone), cwd=first.base)
    git("reset", "-q", "--hard", first.rev0, cwd=clone)
    for batch, flow_run in (("batch-1", first.summary), ("batch-2", second)):
        run_cli("ingest", samples / batch, cwd=clone, check=True)
        out = run_dvc("repro", cwd=clone)
        assert all(f"Running stage '{st}'" in out for st in STAGES), out
        promotion = load_json(clone / "reports" / "promotion.json")
        assert master_dvc_md5(Paths.at(clone)) == flow_run["data_dvc_md5"]
        assert (promotion["version"], promotion["promoted"], promotion["reasons"]) == \
            (flow_run["version"], flow_run["promoted"], flow_run["reasons"]), (promotion, flow_run)
        assert load_json(clone / "reports" / "eval.json")["candidate"]["metrics"]["mAP50-95"] == \
            pytest.approx(flow_run["candidate_map"], abs=0.02)
    assert registry_state(clone) == registry_state(paths.root)


def test_two_runs_started_together_take_turns(samples: Path, tmp_path: Path) -> None:
    paths = tiny_workspace(tmp_path)
    env = cli_env(tmp_path / "prefect")
    run_cli("run", "--only-if-new", cwd=paths.root, env=env, check=True)  # nothing waits: this only makes Prefect's db
    arrive(samples, "batch-1", paths)
    cmd = [sys.executable, "-m", "retrain", "run", "--json"]
    full_env = {**env, "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"]}
    procs = [subprocess.Popen(cmd, cwd=paths.root, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    runs = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    (a, b) = sorted(runs, key=lambda r: r["held"][0])
    assert a["held"][1] <= b["held"][0], runs  # never at the same time
    assert a["ingested"] == ["batch-1"] and a["version"] == "1"
    assert b["nothing_to_retrain"] is True  # it waited, then found the batch taken and every stage up to date
    waited = outs[runs.index(b)][1]
    assert "another retrain run holds" in waited, waited
    assert registry_state(paths.root)["versions"] == [1]
    log = git("log", "--format=%s", cwd=paths.root).splitlines()
    assert sum(m.startswith("retrain: data") for m in log) == 1, log
