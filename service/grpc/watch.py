"""WatchJob: a job's progress as a stream of messages, built by polling the same domain reads as REST.

Order of one poll: the job first, then (one short transaction) its metrics and checkpoints. The worker
commits a terminal state after the last step's metrics, so a poll that sees the terminal state also sees
every metric when it reads them next; the stream then sends what is left and ends with the terminal Job.

Guarantees: metrics go out in increasing step order, each step once, starting at `from_step`; a client
that reconnects with from_step = last step received + 1 continues without gaps or duplicates. (A step
re-run by a retried attempt is not sent again; GetJobMetrics has the final values.)

The call outlives the check its interceptor made, so before every poll it checks the key again
(`still_authorized`, answered from the auth cache): once the key is revoked or expired the call ends with
UNAUTHENTICATED, within GRPO_AUTH_CACHE_SECONDS of the revocation (plus one poll interval).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from sqlalchemy.orm import Session

from contract.api.jobs import EventOut, JobOut
from contract.gen.grpo.v1 import jobs_pb2
from service.grpc.calls import in_session
from service.grpc.convert import event_to_proto, job_to_proto, metrics_by_step
from service.jobs import service as jobs_service
from service.jobs.events import HEALTH_EVENT
from service.jobs.schemas import event_out
from service.jobs.states import TERMINAL
from service.kit.reads import Reads

POLL_INTERVAL_S = 0.5
METRICS_PAGE = 10_000  # (step, name) points per read; a page never ends mid-step


@dataclass
class _Poll:
    job: JobOut
    steps: list[jobs_pb2.StepMetrics]
    more_metrics: bool
    checkpoints: list[tuple[str, int]] = field(default_factory=list)  # (id, step), by step
    health: list[EventOut] = field(default_factory=list)  # health events after the last one seen, by id


async def _poll(reads: Reads, tenant_id: str, job_id: str, next_step: int, health_after: int | None) -> _Poll:
    """One poll: the job, then (one transaction) its metrics from next_step, its checkpoints and new health events."""
    job = await jobs_service.read_job(reads, tenant_id, job_id)
    return await in_session(partial(
        _progress, job=job, tenant_id=tenant_id, job_id=job_id, next_step=next_step, health_after=health_after
    ))


def _progress(
    session: Session, job: JobOut, tenant_id: str, job_id: str, next_step: int, health_after: int | None
) -> _Poll:
    metrics = jobs_service.get_metrics(session, tenant_id, job_id, names=None, since_step=next_step, limit=METRICS_PAGE)
    series = {name: (s.steps, s.values) for name, s in metrics.series.items()}
    checkpoints = [(c.id, c.step) for c in jobs_service.list_job_checkpoints(session, tenant_id, job_id)]
    health, _ = jobs_service.list_events(
        session, tenant_id, job_id, after=health_after, limit=METRICS_PAGE, types=[HEALTH_EVENT]
    )
    return _Poll(job, metrics_by_step(series), metrics.has_more, checkpoints, [event_out(e) for e in health])


async def watch_job(
    reads: Reads,
    tenant_id: str,
    job_id: str,
    from_step: int,
    still_authorized: Callable[[], Awaitable[object]],
    *,
    poll_interval_s: float = POLL_INTERVAL_S,
) -> AsyncIterator[jobs_pb2.WatchJobResponse]:
    """The WatchJob stream for one job of `tenant_id` (NotFound before anything is sent otherwise).
    `still_authorized` raises Unauthenticated once the caller's key no longer authenticates."""
    next_step = from_step
    health_after: int | None = None  # id of the last health event read
    sent_checkpoints: set[str] = set()
    last_job: jobs_pb2.Job | None = None
    while True:
        await still_authorized()
        poll = await _poll(reads, tenant_id, job_id, next_step, health_after)
        job = job_to_proto(poll.job)
        terminal = poll.job.status in TERMINAL
        if not terminal and (last_job is None or _changed(last_job, job)):
            yield jobs_pb2.WatchJobResponse(job=job)
            last_job = job
        pending = [(cid, step) for cid, step in poll.checkpoints if cid not in sent_checkpoints and step >= from_step]
        for metrics in poll.steps:
            # A checkpoint follows the metrics of its step and comes before any later step's, also when it was
            # recorded after a poll had sent its step's metrics.
            for message in _checkpoints_up_to(pending, sent_checkpoints, metrics.step - 1):
                yield message
            yield jobs_pb2.WatchJobResponse(metrics=metrics)
            next_step = metrics.step + 1
            for message in _checkpoints_up_to(pending, sent_checkpoints, metrics.step):
                yield message
        for event in poll.health:  # after the metrics of their step (the worker writes them in that order)
            health_after = event.id
            if int(event.data.get("step", from_step)) >= from_step:
                yield jobs_pb2.WatchJobResponse(health=event_to_proto(event))
        if poll.more_metrics:
            continue  # a backlog is waiting: no sleep
        for message in _checkpoints_up_to(pending, sent_checkpoints, None):
            yield message
        if terminal:
            yield jobs_pb2.WatchJobResponse(job=job)  # the stream always ends with the terminal Job
            return
        await asyncio.sleep(poll_interval_s)


def _checkpoints_up_to(
    pending: list[tuple[str, int]], sent: set[str], step: int | None
) -> list[jobs_pb2.WatchJobResponse]:
    """Messages for the pending checkpoints at or before `step` (None = all), marked as sent."""
    out = []
    for checkpoint_id, checkpoint_step in pending:
        if checkpoint_id not in sent and (step is None or checkpoint_step <= step):
            sent.add(checkpoint_id)
            out.append(
                jobs_pb2.WatchJobResponse(
                    checkpoint=jobs_pb2.CheckpointSaved(checkpoint_id=checkpoint_id, step=checkpoint_step)
                )
            )
    return out


def _changed(before: jobs_pb2.Job, after: jobs_pb2.Job) -> bool:
    """A state change (or a pause request) is news; step and metric updates come as StepMetrics."""
    return (before.state, before.pause_requested, before.attempt) != (after.state, after.pause_requested, after.attempt)
