"""The deployments of the retrain flow, for ``retrain serve`` (one machine) and in ``prefect.yaml`` (a work pool).

- ``retrain/weekly``: the whole loop on the cron in ``params.yaml`` (``retrain.schedule``, Monday 03:00).
- ``retrain/on-new-batch``: every ``retrain.poll_interval`` seconds, the same flow with ``only_if_new``: it ends at
  once when ``data/incoming/`` is empty, and runs the loop when a batch landed.  A polling schedule rather than an
  event trigger: nothing emits a Prefect event when files appear in a folder (a watcher would itself poll), and
  event triggers need a server's automations service, which the local ephemeral API does not run.

Both allow one run at a time (``concurrency_limit`` 1, queued); the workspace lock in the flow covers runs
started any other way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import EntrypointType
from prefect.schedules import Cron, Interval

from flows.retrain import retrain
from retrain.config import Params

WEEKLY = "weekly"
ON_NEW_BATCH = "on-new-batch"


def deployments(root: Path, params: Params) -> list[Any]:
    """The two deployments of the workspace at ``root`` (``RunnerDeployment`` objects)."""
    p = params.retrain
    one = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    common: dict[str, Any] = {"entrypoint_type": EntrypointType.MODULE_PATH, "concurrency_limit": one,
                              "tags": ["retrain"]}
    return [
        retrain.to_deployment(name=WEEKLY, schedule=Cron(p.schedule, timezone=p.timezone),
                              parameters={"project": str(root)},
                              description="Retrain on the whole master, evaluate, promote: every week.", **common),
        retrain.to_deployment(name=ON_NEW_BATCH, schedule=Interval(p.poll_interval),
                              parameters={"project": str(root), "only_if_new": True},
                              description="Retrain when a batch lands in data/incoming/.", **common),
    ]


def serve_workspace(root: Path, params: Params) -> None:
    """Register both deployments with the Prefect API and run their flow runs here until interrupted."""
    serve(*deployments(root, params))
