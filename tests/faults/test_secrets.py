"""Fault: secrets in the environment and in params.yaml must not leak into what the pipeline stores.

One real `retrain run` (the Prefect flow on its own local Prefect API, DVC, sqlite MLflow, training, promotion)
with a canary in ``AWS_SECRET_ACCESS_KEY`` and another in a comment of params.yaml.  Afterwards neither canary
may appear in any byte of mlflow.db, the MLflow artifacts, the Prefect home (its database holds the flow's logs),
reports/, models/, the DVC cache and remote, anything else the run wrote in the workspace, or the process's own
output.  Only params.yaml itself (the user's file) and git's history of it may hold the comment.
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest

from tests.helpers import load_json, registry_state, run_cli
from tests.integration.test_flow import arrive, cli_env, tiny_workspace

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def _forms(secret: str) -> list[bytes]:
    return [secret.encode(), secret.encode("utf-16-le"), secret.encode().hex().encode()]


def _leaks(where: Path, secrets: list[str], skip: set[Path]) -> list[str]:
    """``file: secret`` for every file under ``where`` (or ``where`` itself) holding a secret in any form."""
    files = [where] if where.is_file() else sorted(p for p in where.rglob("*") if p.is_file() and not p.is_symlink())
    found = []
    for f in files:
        if f in skip or any(part == ".git" for part in f.relative_to(where.parent).parts):
            continue
        data = f.read_bytes()
        found += [f"{f}: {s}" for s in secrets if any(form in data for form in _forms(s))]
    return found


def test_canary_secrets_reach_no_store_log_or_report(tmp_path: Path) -> None:
    from retrain.data.sample import generate

    aws, token = f"AWSCANARY{uuid.uuid4().hex}", f"TOKENCANARY{uuid.uuid4().hex}"
    generate(tmp_path / "samples", batches=1, images_per_batch=16, seed=0)
    paths = tiny_workspace(tmp_path)
    params = paths.root / "params.yaml"
    params.write_text(f"# token: {token}\n" + params.read_text())
    arrive(tmp_path / "samples", "batch-1", paths)
    prefect_home = tmp_path / "prefect"
    env = {**cli_env(prefect_home), "AWS_SECRET_ACCESS_KEY": aws}

    proc = run_cli("run", "--json", cwd=paths.root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert registry_state(paths.root)["aliases"].get("champion") == "1"  # the run did store things: a real test
    assert load_json(paths.root / "reports" / "promotion.json")["promoted"] is True

    secrets = [aws, token]
    assert _leaks(params, secrets, set()) == [f"{params}: {token}"]  # the scan finds what is there
    assert aws not in proc.stdout + proc.stderr and token not in proc.stdout + proc.stderr
    places = [paths.root, tmp_path / "ws-remote", prefect_home]
    assert (paths.root / "mlflow.db").is_file() and any((paths.root / "mlartifacts").rglob("model.pt"))
    assert any((paths.root / ".dvc" / "cache").rglob("*")) and any((tmp_path / "ws-remote").rglob("*"))
    dbs = sorted(prefect_home.rglob("*.db"))
    assert dbs, list(prefect_home.rglob("*"))
    with sqlite3.connect(dbs[0]) as db:  # the flow's logs are in it (and in the bytes scanned below)
        logs = [m for (m,) in db.execute("select message from log")]
    assert logs and any("retrain" in m or "stage" in m for m in logs), logs[:20]
    assert not [m for m in logs if aws in m or token in m]
    leaks = [hit for place in places for hit in _leaks(place, secrets, {params})]
    assert leaks == [], leaks
