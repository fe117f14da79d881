"""Versioning after a run: commit what DVC recorded to git, push the data to the DVC remote (retried)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from retrain.errors import ExternalToolError, TransientError
from retrain.faults import fault_point
from retrain.paths import Paths
from retrain.workspace import commit, dvc, git
from tasks.stages import _transient_only


@task(name="git-commit", task_run_name="git-commit", cache_policy=NO_CACHE)
def git_commit(root: str, message: str) -> str | None:
    """Commit ``dvc.lock``, params, the batches' ``.dvc`` files and the metrics; the new HEAD, or None."""
    paths = Paths.at(root)
    if not commit(paths, message):
        get_run_logger().info("nothing to commit")
        return None
    sha = git(["rev-parse", "--short", "HEAD"], paths.root, "git rev-parse").strip()
    get_run_logger().info("git commit %s: %s", sha, message)
    return sha


@task(name="dvc-push", task_run_name="dvc-push", retry_condition_fn=_transient_only, cache_policy=NO_CACHE)
def dvc_push(root: str) -> None:
    """``dvc push`` to the default remote; an unreachable remote is transient (retried with backoff)."""
    fault_point("push.before")
    try:
        dvc(["push"], Paths.at(root).root, "dvc push")  # not -q: that silences DVC's ERROR line too
    except ExternalToolError as e:
        raise TransientError(str(e)) from e
    get_run_logger().info("data pushed to the DVC remote")
