"""The stage task on its own, with real DVC and Prefect: DVC's order, transient failures retried, others not."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_dvc

DVC_YAML = """\
stages:
  second:            # listed first, but it reads what `first` writes: DVC runs it after
    cmd: python -c "open('b.txt', 'w').write(open('a.txt').read())"
    deps: [a.txt]
    outs: [b.txt]
  first:
    cmd: python flaky.py
    outs: [a.txt]
  broken:
    cmd: python broken.py
"""
BROKEN = """\
import sys
print("error: batch x: y.jpg: [rule] bad data")
sys.exit(1)
"""
FLAKY = """\
import pathlib, sys
tries = pathlib.Path("tries")
n = int(tries.read_text()) if tries.exists() else 0
tries.write_text(str(n + 1))
if n == 0:
    print("error: unavailable, try again later: registry down", flush=True)
    sys.exit(75)
pathlib.Path("a.txt").write_text("a")
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    run_dvc("init", "-q", cwd=root)
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "flaky.py").write_text(FLAKY)
    (root / "broken.py").write_text(BROKEN)
    (root / ".gitignore").write_text("tries\n")
    return root


def _runs(state: Any) -> dict[str, Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    return {r.name: r for r in runs}


def test_stage_order_is_dvcs_and_a_transient_failure_is_retried_but_bad_data_is_not(harness: None,
                                                                                   repo: Path) -> None:
    from prefect import flow

    from tasks.stages import StageFailed, run_stage, stage_order

    assert stage_order(repo) == ["first", "second", "broken"]

    @flow
    def pipeline(stages: list[str]) -> list[bool]:
        return [run_stage.with_options(retries=2, retry_delay_seconds=0)(str(repo), s).ran for s in stages]

    state = pipeline(["first", "second"], return_state=True)
    assert state.is_completed() and state.result() == [True, True]
    runs = _runs(state)
    assert runs["first"].run_count == 2 and runs["second"].run_count == 1  # exit 75 once, then it ran
    assert (repo / "b.txt").read_text() == "a" and "first" in (repo / "dvc.lock").read_text()

    state = pipeline(["broken"], return_state=True)
    error = state.result(raise_on_failure=False)
    assert isinstance(error, StageFailed) and error.lines()[0] == "batch x: y.jpg: [rule] bad data"  # sans "error: "
    assert _runs(state)["broken"].run_count == 1  # bad data: no retry

    state = pipeline(["first"], return_state=True)  # up to date now: DVC says so, nothing runs
    assert state.result() == [False] and (repo / "tries").read_text() == "2"
