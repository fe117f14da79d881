"""The ``retrain`` flow: ingest what is waiting, then the ``dvc.yaml`` stages as Prefect tasks, then report.

The stage list and its order come from DVC (``dvc.yaml``), never from here; each stage runs through DVC, which
decides whether it is stale and records it in ``dvc.lock``.  Prefect adds the schedule, the retries of transient
failures, one run at a time per workspace, the artifacts and the UI.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from uuid import UUID

from prefect import flow, get_client, get_run_logger, runtime
from prefect.client.schemas import filters as f
from prefect.states import Crashed
from prefect.tasks import exponential_backoff

from flows.api import whereabouts
from flows.automations import champion_moved
from flows.summary import RunSummary
from retrain import codeversions
from retrain.config import Params, load_params
from retrain.errors import RetrainError
from retrain.evaluation.report import EvalReport
from retrain.nodata import no_batch_yet
from retrain.paths import Paths
from retrain.runlock import describe, repair_dvc_locks, run_lock
from retrain.workspace import master_dvc_md5, require_workspace
from tasks.artifacts import (
    publish_audit,
    publish_evaluation,
    publish_history,
    publish_summary,
    publish_validation,
)
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


@flow(name="retrain", log_prints=False)
def retrain(project: str = ".", batches: list[str] | None = None, only_if_new: bool = False) -> dict[str, Any]:
    """Ingest the waiting batches, run the DVC stages, version the result.

    Args:
        project: The workspace (a folder holding ``dvc.yaml``, ``params.yaml``, ``.dvc/``).
        batches: Batch folders to ingest; default: every folder waiting in ``data/incoming/``.
        only_if_new: End at once when no batch is waiting (the ``on-new-batch`` deployment's poll).

    Returns:
        What the run did: a ``RunSummary`` as a plain dict (``flows/summary.py``).
    """
    quiet_expected_failures()
    logger = get_run_logger()
    paths = Paths.at(project)
    logger.info("workspace %s, on %s", paths.root, whereabouts())
    require_workspace(paths)
    params = load_params(paths.params)
    summary = RunSummary(model=params.registry.model_name, batches=batches)
    duplicate = _duplicate_of()
    if duplicate:
        summary = summary.model_copy(update={"nothing_to_retrain": True, "duplicate_of": duplicate, "batches": None})
        logger.info(summary.headline())
        return summary.model_dump()
    if only_if_new and not waiting(paths, batches):
        logger.info("no batch waiting in %s: nothing to do", paths.incoming)
        return summary.model_copy(update={"nothing_to_retrain": True, "batches": None}).model_dump()

    def on_wait(holder: dict[str, Any]) -> None:
        logger.warning("another retrain run holds %s (%s); waiting up to %g s", paths.root, describe(holder),
                       params.retrain.lock_timeout)

    with run_lock(paths, {"flow_run_id": str(runtime.flow_run.id)}, params.retrain.lock_timeout, on_wait) as previous:
        summary.held = [time.time(), None]  # when this run owned the workspace (wall clock, for the overlap test)
        try:
            _mark_crashed(previous)
            for line in repair_dvc_locks(paths.root):
                logger.warning(line)
            _loop(paths, load_params(paths.params), summary)  # params as they are now that this run owns it
        finally:
            summary.held[1] = time.time()
    logger.info(summary.headline())
    return summary.model_dump()


def _loop(paths: Paths, params: Params, summary: RunSummary) -> None:
    """Ingest, the stages in DVC's order, then versioning; fills ``summary``."""
    asked, summary.batches = summary.batches, None
    for source in waiting(paths, asked):  # looked at again: a run we waited for may have taken them
        r = ingest_batch(str(paths.root), str(source), source.name)
        summary.seconds[f"ingest-{r['name']}"] = r["seconds"]
        if r["added"]:
            summary.ingested.append(r["name"])
    if no_batch_yet(paths):  # a schedule that starts before the first delivery: nothing to do, nothing changed
        summary.nothing_to_retrain = summary.no_batch_yet = True
        return
    changed = codeversions.record(paths)  # before DVC plans: new installed code makes its stages stale
    if changed:
        get_run_logger().info("the installed code of %s changed since the last run (%s)", ", ".join(changed),
                              codeversions.FILE)
    for stage in stage_order(paths.root):
        _stage(paths, params, stage, summary)
    summary.data_dvc_md5 = master_dvc_md5(paths)
    evaluation = EvalReport.find(paths.eval_report) if summary.stages.get("evaluate") else None
    if evaluation is not None:
        summary.candidate_map = evaluation.candidate.metrics.map
        summary.champion_map = evaluation.champion.metrics.map if evaluation.champion else None
    summary.nothing_to_retrain = not summary.ingested and not any(summary.stages.values())
    if params.retrain.commit and not summary.nothing_to_retrain:
        summary.commit = git_commit(str(paths.root), summary.headline())
    if params.retrain.push:  # every run: it also sends what an earlier run failed to push (nothing else: ~1 s)
        dvc_push.with_options(**_stage_options(params))(str(paths.root))
    if not summary.nothing_to_retrain:
        publish_summary(summary.markdown())


def _stage(paths: Paths, params: Params, stage: str, summary: RunSummary) -> None:
    """One stage through DVC, and what the UI shows of it."""
    epochs = params.train.epochs if stage == "train" else None
    try:
        run = run_stage.with_options(**_stage_options(params))(str(paths.root), stage, epochs)
    except StageFailed:
        if stage == "validate":
            publish_validation(paths, failed=True)
        if stage == "audit":
            publish_audit(paths)
        raise
    summary.stages[stage] = run.ran
    summary.seconds[stage] = run.seconds
    if run.ran and stage == "validate":
        publish_validation(paths, failed=False)
    if run.ran and stage == "audit":
        publish_audit(paths)
    if run.ran and stage == "promote":
        promotion = publish_evaluation(paths, params.retrain.mlflow_ui)
        if promotion is not None:
            summary.version, summary.promoted = promotion.version, promotion.promoted
            summary.reasons = list(promotion.reasons)
            if promotion.promoted:  # the automation 'retrain: champion moved' notifies a team's server
                champion_moved(promotion, EvalReport.find(paths.eval_report))
            publish_history(paths, params.registry.model_name, params.retrain.mlflow_ui)


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
