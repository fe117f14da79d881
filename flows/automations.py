"""Prefect automations for a team's server: who hears about a failed run or a new champion, and what crashes a zombie.

``retrain automations`` (also run by ``retrain serve``) creates or updates, by name, on the Prefect server:

- ``retrain: run failed`` -- a flow run of ``retrain`` enters Failed or Crashed: a notification;
- ``retrain: champion moved`` -- the custom event ``retrain.champion.moved`` that the flow emits when promote moves
  the alias (payload: model, version, previous version, the data's sha256 and DVC md5, mAP50-95 delta): a notification;
- ``retrain: crash zombie runs`` -- a running ``retrain`` flow run that sent no heartbeat for three heartbeat
  periods (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``) is set Crashed, which frees its deployment's concurrency slot;
  its host or worker died with it, so nothing else would ever end it.

Notifications go to a ``CustomWebhookNotificationBlock`` (``retrain-notify``) that POSTs ``{"subject", "body"}`` as
JSON to ``RETRAIN_NOTIFY_URL``; without a URL only the zombie automation is made.  Automations need a Prefect
server (``PREFECT_API_URL``): the local ephemeral API runs no triggers between runs.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from prefect.automations import Automation, ChangeFlowRunState, EventTrigger, Posture, SendNotification
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.schemas.objects import StateType
from prefect.events import emit_event
from prefect.settings import get_current_settings

from retrain.evaluation.report import EvalReport
from retrain.promotion.report import PromotionReport

NOTIFY_ENV = "RETRAIN_NOTIFY_URL"
BLOCK = "retrain-notify"
FLOW = "retrain"
CHAMPION_MOVED = "retrain.champion.moved"
FAILED, MOVED, ZOMBIES = "retrain: run failed", "retrain: champion moved", "retrain: crash zombie runs"


def _upsert(automation: Any) -> Any:
    try:
        existing: Any = Automation.read(name=automation.name)  # sync here (no running event loop)
    except ValueError:
        return automation.create()
    automation.id = existing.id
    automation.update()
    return automation


def _notify_block(url: str) -> Any:
    block = CustomWebhookNotificationBlock(name=BLOCK, url=url, method="POST",
                                           json_data={"subject": "{{subject}}", "body": "{{body}}"},
                                           headers=None, cookies=None)
    return block.save(BLOCK, overwrite=True)


def heartbeat_seconds() -> int:
    """The flow engine's heartbeat period (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, Prefect's default 180 s)."""
    value = get_current_settings().flows.heartbeat_frequency
    return int(value) if value else 180


def ensure_automations(url: str | None = None) -> list[str]:
    """Create or update retrain's automations on the Prefect server; their names.

    Args:
        url: Where notifications go; default ``RETRAIN_NOTIFY_URL``; none: only the zombie automation.
    """
    url = url or os.environ.get(NOTIFY_ENV) or None
    flow: dict[str, str | list[str]] = {"prefect.resource.role": "flow", "prefect.resource.name": FLOW}
    made = [_upsert(Automation(
        name=ZOMBIES, description="a running retrain flow run that stopped sending heartbeats is Crashed",
        trigger=EventTrigger(after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.*"},
                             match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=flow,
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=timedelta(seconds=3 * heartbeat_seconds())),
        actions=[ChangeFlowRunState(name=None, force=False, state=StateType.CRASHED,
                                    message="no heartbeat for three heartbeat periods: its process, worker or "
                                            "host died")]))]
    if url:
        block = _notify_block(url)
        made.append(_upsert(Automation(
            name=FAILED, description="a retrain flow run failed or crashed",
            trigger=EventTrigger(expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                                 match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=flow,
                                 for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1),
            actions=[SendNotification(block_document_id=block,
                                      subject="retrain run {{ flow_run.name }}: {{ flow_run.state.name }}",
                                      body="{{ flow_run.state.message }} ({{ flow_run|ui_url }})")])))
        made.append(_upsert(Automation(
            name=MOVED, description="promote moved the champion alias",
            trigger=EventTrigger(expect={CHAMPION_MOVED}, match={"prefect.resource.id": "retrain.model.*"},
                                 posture=Posture.Reactive, threshold=1),
            actions=[SendNotification(
                block_document_id=block,
                subject="{{ event.payload.model }}@champion is version {{ event.payload.version }}",
                body="version {{ event.payload.version }} replaced {{ event.payload.previous or 'none' }} on data "
                     "{{ event.payload.data_dvc_md5 }}: mAP50-95 {{ event.payload.candidate_map }} "
                     "(delta {{ event.payload.delta }})")])))
    return [a.name for a in made]


def champion_moved(promotion: PromotionReport, evaluation: EvalReport | None) -> None:
    """Emit ``retrain.champion.moved`` for a promotion that moved the alias (from inside the flow run)."""
    cand = evaluation.candidate.metrics.map if evaluation else None
    champ = evaluation.champion.metrics.map if evaluation and evaluation.champion else None
    emit_event(CHAMPION_MOVED, resource={"prefect.resource.id": f"retrain.model.{promotion.model}",
                                         "prefect.resource.name": promotion.model},
               payload={"model": promotion.model, "version": promotion.version,
                        "previous": promotion.parent_version,
                        "data_version": promotion.tags.get("retrain.data_version"),  # annotations' sha256
                        "data_dvc_md5": promotion.tags.get("retrain.data_dvc_md5"),
                        "candidate_map": None if cand is None else round(cand, 4),
                        "delta": None if cand is None or champ is None else round(cand - champ, 4)})
