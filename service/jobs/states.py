"""The job state machine: every status change of a job goes through `transition()`.

States and who moves a job between them::

    queued ──worker claims──▶ running ──worker──▶ succeeded | failed
      │  ╲                      │  ╲
      │   ╲ pause (API)         │   ╲ cancel (API) ─▶ cancelling ──worker stops──▶ cancelled | failed
      │    ▼                    │
      │   paused ◀──worker, at a checkpoint, after a pause request (see below)
      │    │  ╲
      │    │   ╲ resume (API) ─▶ queued (re-enqueued; the worker resumes from the latest checkpoint)
      ▼    ▼
    cancelled (API cancel of a job that is not running: nothing to stop)

    running ─▶ queued: the worker's lease ran out (the worker died); the job is re-sent with attempt + 1
                       (service/execution/reaper.py). No separate "retrying" state: `attempt` says it is a retry.
    queued  ─▶ failed: a job that cannot even start (attempts exhausted, invalid at claim time).

Pausing a running job is a two-phase request, like cancelling, but without an extra state
(the public state list stays the seven of the API contract): `POST /pause` on a running job sets
`pause_requested` and leaves the status `running`; the worker sees the flag at its next step
boundary, saves a checkpoint and moves the job to `paused` (clearing the flag). `POST /resume`
while the pause is still only requested withdraws the request. A queued job pauses at once.

Terminal states (`succeeded`, `failed`, `cancelled`) have no way out.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from contract.api.jobs import JobStatus
from service.jobs.events import STATUS_EVENT
from service.jobs.models import Job, JobEvent
from service.kit.db import utcnow
from service.kit.errors import IllegalTransition

S = JobStatus

TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    S.queued: frozenset({S.running, S.paused, S.cancelled, S.failed}),
    S.running: frozenset({S.succeeded, S.failed, S.paused, S.cancelling, S.queued}),
    S.paused: frozenset({S.queued, S.cancelled}),
    S.cancelling: frozenset({S.cancelled, S.failed}),
    S.succeeded: frozenset(),
    S.failed: frozenset(),
    S.cancelled: frozenset(),
}

TERMINAL: frozenset[JobStatus] = frozenset(state for state, targets in TRANSITIONS.items() if not targets)
# States in which a job still needs its inputs (datasets, reward functions) to exist.
UNFINISHED: frozenset[JobStatus] = frozenset(JobStatus) - TERMINAL
# States in which a worker owns the job and may report progress.
WORKER_OWNED: frozenset[JobStatus] = frozenset({S.running, S.cancelling})


def can_transition(current: str, to: JobStatus) -> bool:
    return to in TRANSITIONS[JobStatus(current)]


def transition(
    session: Session, job: Job, to: JobStatus, *, reason: str, data: dict[str, Any] | None = None
) -> JobEvent:
    """Move `job` to `to`, or raise IllegalTransition (409) naming the current state.

    Writes the `status` event in the same transaction, stamps started_at/finished_at, and flushes so
    that a concurrent change of the same row (the worker vs. an API call) fails here, through the
    optimistic version check on the job row, instead of at commit time.
    """
    current = JobStatus(job.status)
    if to not in TRANSITIONS[current]:
        raise IllegalTransition(
            f"job {job.id!r} is {current.value}: cannot move to {to.value}",
            details={"current_status": current.value, "requested_status": to.value},
        )
    now = utcnow()
    job.status = to.value
    job.updated_at = now
    if to is S.running and job.started_at is None:
        job.started_at = now
    if to in TERMINAL:
        job.finished_at = now
        job.lease_until = None
    if to is S.paused or to in TERMINAL:
        job.pause_requested = False
    event = JobEvent(
        job_id=job.id,
        type=STATUS_EVENT,
        message=f"{current.value} -> {to.value}: {reason}",
        data={"from": current.value, "to": to.value, "reason": reason, **(data or {})},
        attempt=job.attempt,
        created_at=now,
    )
    session.add(event)
    flush_job(session, job)
    return event


def flush_job(session: Session, job: Job) -> None:
    """Flush, turning a lost optimistic-concurrency race on the job row into a 409."""
    try:
        session.flush()
    except StaleDataError as exc:
        raise IllegalTransition(
            f"job {job.id!r} was changed concurrently; read it again and retry",
            details={"current_status": None},
        ) from exc
