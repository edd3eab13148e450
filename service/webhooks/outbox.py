"""The webhook outbox: every job lifecycle event becomes one delivery row per endpoint, atomically.

Lifecycle events are *derived from job events* (the append-only log every part of the system already
writes), by an ORM `after_insert` listener on `JobEvent`. The delivery rows are inserted on the same
connection, inside the same transaction, as the event: if the transition rolls back, nothing is
announced; if it commits, the announcement is durable. No caller has to remember to notify, so the API
(create, cancel, pause, resume), the worker (claim, checkpoint, eval, finish) and the reaper all
announce their changes the same way.

Which job events are lifecycle events (`webhook_event_type`):

    status event to queued|running|paused|succeeded|failed|cancelled  ->  job.<state>
    checkpoint event                                                 ->  job.checkpoint_saved
    metrics event carrying eval/* metrics                            ->  job.eval_completed
    health event (a training-health detector fired)                  ->  job.health
    budget_exhausted event (a budget paused the job)                 ->  job.budget_exhausted

`cancelling` (an intermediate state) is not announced: `job.cancelled` follows when the worker stops.

The listener is registered by `register()`, called explicitly at the start of every process that writes
job events: the API (service.app.create_app), the gRPC server (service.grpc.server.create_grpc_server), the
worker (worker.celery_app.create_celery_app, worker.rank_job) and the reaper (service.execution.reaper.start_reaper_thread);
`grpo serve` runs those. A process that writes job events without it announces nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, insert, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapper

from service.jobs.events import (
    BUDGET_EXHAUSTED_EVENT,
    CHECKPOINT_EVENT,
    EVAL_PREFIX,
    HEALTH_EVENT,
    METRICS_EVENT,
    STATUS_EVENT,
)
from service.jobs.models import Job, JobEvent
from service.kit.db import utcnow
from service.webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint

ANNOUNCED_STATES = ("queued", "running", "paused", "succeeded", "failed", "cancelled")


def webhook_event_type(type_: str, data: dict[str, Any]) -> str | None:
    """The lifecycle event a job event announces, or None for the rest (logs, plain metrics...)."""
    if type_ == STATUS_EVENT:
        to = data.get("to")
        return f"job.{to}" if to in ANNOUNCED_STATES else None
    if type_ == CHECKPOINT_EVENT:
        return "job.checkpoint_saved"
    if type_ == HEALTH_EVENT:
        return "job.health"
    if type_ == BUDGET_EXHAUSTED_EVENT:
        return "job.budget_exhausted"
    if type_ == METRICS_EVENT:
        metrics = data.get("metrics") or {}
        return "job.eval_completed" if any(str(k).startswith(EVAL_PREFIX) for k in metrics) else None
    return None


def event_payload(event_type: str, job_event: JobEvent, tenant_id: str) -> dict[str, Any]:
    """The JSON body receivers get: `{type, timestamp, data}` (the Standard Webhooks convention)."""
    source = dict(job_event.data or {})
    data: dict[str, Any] = {
        "job_id": job_event.job_id,
        "tenant_id": tenant_id,
        "event_id": job_event.id,
        "attempt": job_event.attempt,
        "message": job_event.message,
    }
    if job_event.type == STATUS_EVENT:
        data.update(status=source.pop("to", None), previous_status=source.pop("from", None))
        data.update(source)  # reason, error details, checkpoint_id...
    elif job_event.type == METRICS_EVENT:
        metrics = source.get("metrics") or {}
        data.update(step=source.get("step"),
                    metrics={k: v for k, v in metrics.items() if str(k).startswith(EVAL_PREFIX)})
    else:
        data.update(source)  # checkpoint_id, step, files, total_bytes
    created = job_event.created_at or utcnow()
    return {"type": event_type, "timestamp": created.isoformat(), "data": data}


def message_id(job_event: JobEvent) -> str:
    """Stable per event (`webhook-id`): receivers deduplicate retries and at-least-once re-sends with it."""
    return f"msg_{job_event.job_id}_{job_event.id}"


def _enqueue_deliveries(_mapper: Mapper[Any], connection: Connection, target: JobEvent) -> None:
    event_type = webhook_event_type(target.type, dict(target.data or {}))
    if event_type is None:
        return
    # Core statements on the flush's own connection: same transaction, no ORM state touched mid-flush.
    tenant_id = connection.execute(select(Job.tenant_id).where(Job.id == target.job_id)).scalar_one_or_none()
    if tenant_id is None:
        return
    endpoint_ids = connection.execute(
        select(WebhookEndpoint.id).where(WebhookEndpoint.tenant_id == tenant_id)
    ).scalars().all()
    if not endpoint_ids:
        return
    now = utcnow()
    payload = event_payload(event_type, target, tenant_id)
    connection.execute(
        insert(WebhookDelivery),
        [
            {
                "endpoint_id": endpoint_id,
                "tenant_id": tenant_id,
                "job_id": target.job_id,
                "message_id": message_id(target),
                "event_type": event_type,
                "payload": payload,
                "status": DeliveryStatus.pending,
                "attempts": 0,
                "next_attempt_at": now,
                "created_at": now,
            }
            for endpoint_id in endpoint_ids
        ],
    )


def register() -> None:
    """Turn the outbox on in this process: every JobEvent inserted from now on that is a lifecycle event gets
    its delivery rows in the same transaction. Idempotent (each entry point calls it; tests call it again)."""
    if not event.contains(JobEvent, "after_insert", _enqueue_deliveries):
        event.listen(JobEvent, "after_insert", _enqueue_deliveries)
