"""The ``retrain`` flow: ingest what is waiting, then the ``dvc.yaml`` stages as Prefect tasks, then report.

The stage list and its order come from DVC (``dvc.yaml``), never from here; each stage runs through DVC, which
decides whether it is stale and records it in ``dvc.lock``.  Prefect adds the schedule, the retries of transient
failures, one run at a time per workspace, the artifacts and the UI.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import flow, get_run_logger, runtime
from prefect.tasks import exponential_backoff

from flows.api import whereabouts
from flows.automations import champion_moved
from retrain.config import Params, load_params
from retrain.errors import RetrainError
from retrain.nodata import HOW, no_batch_yet
from retrain.paths import Paths
from retrain.runlock import describe, repair_dvc_locks, run_lock
from retrain.workspace import master_version, require_workspace
from tasks.artifacts import eval_scores, publish_evaluation, publish_summary, publish_validation
from tasks.ingest import ingest_batch, waiting
from tasks.stages import StageFailed, run_stage, stage_order
from tasks.versioning import dvc_push, git_commit


class _NoTracebackForExpectedFailures(logging.Filter):
    """Prefect logs a task's or flow's exception with its traceback; ours (bad data, a failed check) are one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RetrainError):
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_expected_failures() -> None:
    """Install the filter on Prefect's run loggers (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForExpectedFailures) for f in logger.filters):
            logger.addFilter(_NoTracebackForExpectedFailures())


def _mark_crashed(previous: dict[str, Any]) -> None:
    """The previous owner of the workspace was killed: say so, and mark its flow run Crashed if it still runs."""
    if not previous:
        return
    logger = get_run_logger()
    logger.warning("the previous run (%s) ended without releasing the workspace: it was killed", describe(previous))
    run_id = previous.get("flow_run_id")
    if not run_id or run_id == str(runtime.flow_run.id):
        return
    from uuid import UUID

    from prefect import get_client
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(run_id))
            if run.state is not None and not run.state.is_final():
                client.set_flow_run_state(UUID(run_id), Crashed(message=f"its process ({describe(previous)}) was "
                                          "killed; found by the next run"), force=True)
                logger.warning("flow run %s (%s) marked Crashed", run.name, run_id)
    except Exception as e:  # another Prefect API's run, or the API is down: the lock was what mattered
        logger.warning("could not mark flow run %s crashed: %s", run_id, e)


def _duplicate_of() -> str | None:
    """The run that this deployment run duplicates (same deployment, same scheduled slot, made earlier), if any.

    A redeploy can schedule a slot again that a run already has; the earlier run, unless it failed or was cancelled,
    does the slot's work, and this one does nothing.
    """
    from prefect import get_client
    from prefect.client.schemas import filters as f

    run_id = runtime.flow_run.id
    if not runtime.deployment.id or not run_id:
        return None
    with get_client(sync_client=True) as client:
        me = client.read_flow_run(run_id)
        slot = me.expected_start_time
        if me.deployment_id is None or slot is None:
            return None
        others = client.read_flow_runs(flow_run_filter=f.FlowRunFilter(
            deployment_id=f.FlowRunFilterDeploymentId(any_=[me.deployment_id]),
            expected_start_time=f.FlowRunFilterExpectedStartTime(after_=slot, before_=slot)))
    for other in sorted(others, key=lambda r: r.created or slot):
        if other.id == me.id or (other.created and me.created and other.created >= me.created):
            continue
        state = other.state
        if state is not None and not (state.is_failed() or state.is_crashed() or state.is_cancelled()):
            return f"{other.name} ({other.id})"
    return None


def _stage_options(params: Params) -> dict[str, Any]:
    p = params.retrain
    delay = exponential_backoff(backoff_factor=p.retry_delay)(p.retries) if p.retries and p.retry_delay else 0
    return {"retries": p.retries, "retry_delay_seconds": delay}


def nothing_line(summary: dict[str, Any]) -> str:
    """The one line of a run that had nothing to do."""
    if summary.get("no_batch_yet"):
        return f"nothing to retrain: no batch yet; {HOW}"
    return "nothing to retrain: no new batch, and DVC says every stage is up to date"


def _message(summary: dict[str, Any]) -> str:
    data = (summary.get("data_version") or "?")[:12]
    if summary.get("version"):
        decision = (f"{summary['model']} v{summary['version']} "
                    + ("promoted to champion" if summary["promoted"] else "not promoted"))
    else:
        decision = "no new model"
    batches = f" (batches: {', '.join(summary['ingested'])})" if summary["ingested"] else ""
    return f"retrain: data {data}, {decision}{batches}"


@flow(name="retrain", log_prints=False)
def retrain(project: str = ".", batches: list[str] | None = None, only_if_new: bool = False) -> dict[str, Any]:
    """Ingest the waiting batches, run the DVC stages, version the result.

    Args:
        project: The workspace (a folder holding ``dvc.yaml``, ``params.yaml``, ``.dvc/``).
        batches: Batch folders to ingest; default: every folder waiting in ``data/incoming/``.
        only_if_new: End at once when no batch is waiting (the ``on-new-batch`` deployment's poll).

    Returns:
        What the run did: ``ingested``, ``stages`` (name -> ran), ``seconds``, ``data_version``, ``version``,
        ``promoted``, ``reasons``, ``candidate``/``champion`` mAP50-95, ``commit``, ``nothing_to_retrain``.
    """
    quiet_expected_failures()
    logger = get_run_logger()
    paths = Paths.at(project)
    logger.info("workspace %s, on %s", paths.root, whereabouts())
    require_workspace(paths)
    params = load_params(paths.params)
    summary: dict[str, Any] = {"ingested": [], "stages": {}, "seconds": {}, "nothing_to_retrain": False,
                               "model": params.registry.model_name, "version": None, "promoted": False,
                               "reasons": [], "commit": None, "batches": batches}
    duplicate = _duplicate_of()
    if duplicate:
        logger.info("a duplicate run for the slot that %s has: nothing to do", duplicate)
        summary.update(nothing_to_retrain=True, duplicate_of=duplicate)
        summary.pop("batches")
        return summary
    if only_if_new and not waiting(paths, batches):
        logger.info("no batch waiting in %s: nothing to do", paths.incoming)
        summary["nothing_to_retrain"] = True
        summary.pop("batches")
        return summary

    def on_wait(holder: dict[str, Any]) -> None:
        logger.warning("another retrain run holds %s (%s); waiting up to %g s", paths.root, describe(holder),
                       params.retrain.lock_timeout)

    with run_lock(paths, {"flow_run_id": str(runtime.flow_run.id)}, params.retrain.lock_timeout, on_wait) as previous:
        summary["held"] = [time.time(), None]  # when this run owned the workspace (wall clock, for the overlap test)
        try:
            _mark_crashed(previous)
            for line in repair_dvc_locks(paths.root):
                logger.warning(line)
            _loop(paths, load_params(paths.params), summary)  # params as they are now that this run owns it
        finally:
            summary["held"][1] = time.time()
    logger.info(nothing_line(summary) if summary["nothing_to_retrain"] else _message(summary))
    return summary


def _loop(paths: Paths, params: Params, summary: dict[str, Any]) -> None:
    """Ingest, the stages in DVC's order, then versioning; fills ``summary``."""
    for source in waiting(paths, summary.pop("batches")):  # looked at again: a run we waited for may have taken them
        r = ingest_batch(str(paths.root), str(source), source.name)
        summary["seconds"][f"ingest-{r['name']}"] = r["seconds"]
        if r["added"]:
            summary["ingested"].append(r["name"])
    if no_batch_yet(paths):  # a schedule that starts before the first delivery: nothing to do, nothing changed
        summary.update(nothing_to_retrain=True, no_batch_yet=True)
        return
    for stage in stage_order(paths.root):
        epochs = params.train.epochs if stage == "train" else None
        try:
            run = run_stage.with_options(**_stage_options(params))(str(paths.root), stage, epochs)
        except StageFailed:
            if stage == "validate":
                publish_validation(paths, failed=True)
            raise
        summary["stages"][stage] = run.ran
        summary["seconds"][stage] = run.seconds
        if run.ran and stage == "validate":
            publish_validation(paths, failed=False)
        if run.ran and stage == "promote":
            promotion = publish_evaluation(paths, params.retrain.mlflow_ui)
            summary.update(version=promotion.get("version"), promoted=bool(promotion.get("promoted")),
                           reasons=list(promotion.get("reasons") or []))
            if summary["promoted"]:  # the automation 'retrain: champion moved' notifies a team's server
                champion_moved(promotion, eval_scores(paths))
    summary["data_version"] = master_version(paths)
    if summary["stages"].get("evaluate"):
        summary.update(eval_scores(paths))
    summary["nothing_to_retrain"] = not summary["ingested"] and not any(summary["stages"].values())
    if params.retrain.commit and not summary["nothing_to_retrain"]:
        summary["commit"] = git_commit(str(paths.root), _message(summary))
    if params.retrain.push:  # every run: it also sends what an earlier run failed to push (nothing else: ~1 s)
        dvc_push.with_options(**_stage_options(params))(str(paths.root))
    if not summary["nothing_to_retrain"]:
        publish_summary(summary)


def outcome(state: Any) -> dict[str, Any]:
    """A finished run's summary, or its failure raised as a ``RetrainError`` (one line each, no traceback).

    Args:
        state: The final state (``retrain(..., return_state=True)``).

    Raises:
        RetrainError: The run failed, crashed or was cancelled.
    """
    if state.is_completed():
        return dict(state.result())
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, RetrainError):
        raise exc
    raise RetrainError(f"flow run {state.name}: {state.type.value.lower()}: {state.message}")
