"""The reaper: recovers jobs whose worker died and jobs whose message was lost.

It runs as a loop in the API process (`grpo serve`, `run_reaper_loop`); several reapers are safe
(every change is a conditional UPDATE re-checking what was read). One pass (`reap_once`):

1. Expired leases (status running/cancelling, `lease_until` passed): the worker stopped renewing (killed,
   frozen, partitioned). The job is taken back with a conditional UPDATE on the attempt that was seen, an
   event `lease_expired` is written, and then
   - a job being cancelled becomes `cancelled` (nothing is left to stop);
   - a job with a pending pause request becomes `paused` (it resumes from its last checkpoint);
   - a job that has now lost `max_attempts` leases becomes `failed` (`worker_lost`): something in it keeps
     killing workers (out-of-memory, a driver crash) and retrying forever would hide that;
   - otherwise it goes back to `queued` and is re-sent after the commit; the next claim increments
     `attempt` and resumes from the latest checkpoint.
   Lost leases are counted from the `lease_expired` events rather than read from `attempt`, because a
   pause/resume also starts a new attempt and must not use up the job's crash budget.
2. Lost messages: a job still `queued` `queued_resend_seconds` after its last change is re-sent (the
   embedded broker can lose a message on SIGKILL; a Redis without persistence loses its queue on a
   restart). Re-sending is always safe: the claim turns surplus copies into no-ops. Its `updated_at`
   is bumped so it is re-sent at most once per period.
3. Expired idempotency keys: records older than `idempotency_ttl_hours` are deleted
   (service/jobs/idempotency.py). A claim also expires lazily when its key is reused, but keys that are
   never reused would otherwise stay forever. The delete is a range on an indexed column, so a pass
   that finds nothing to delete costs one index probe.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial

from sqlalchemy.orm import Session

from service.execution import repository
from service.jobs import idempotency
from service.jobs import repository as jobs_repository
from service.jobs.models import JobEvent
from service.jobs.states import JobStatus, transition
from service.kit.config import Settings
from service.kit.db import on_commit, session_scope, utcnow
from service.kit.queue import JobQueue, send_job_logged
from service.webhooks import outbox

log = logging.getLogger(__name__)

LEASE_EXPIRED_EVENT = "lease_expired"
WORKER_LOST = "worker_lost"


@dataclass
class ReapReport:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    resent: list[str] = field(default_factory=list)
    idempotency_keys_purged: int = 0

    def __bool__(self) -> bool:
        return any((self.requeued, self.failed, self.cancelled, self.paused, self.resent,
                    self.idempotency_keys_purged))


def reap_once(queue: JobQueue, settings: Settings, *, now: datetime | None = None) -> ReapReport:
    """One pass over expired leases, stale queued jobs and expired idempotency keys. Each job is handled in its
    own transaction."""
    now = now or utcnow()
    report = ReapReport()
    with session_scope() as session:
        expired = repository.expired_leases(session, now)
    for job_id, attempt in expired:
        with session_scope() as session:
            _take_back(session, queue, job_id, attempt, now, report)
    cutoff = now - timedelta(seconds=settings.queued_resend_seconds)
    with session_scope() as session:
        stale = repository.stale_queued_jobs(session, cutoff)
    for job_id in stale:
        with session_scope() as session:
            _resend(session, queue, job_id, cutoff, now, report)
    with session_scope() as session:
        report.idempotency_keys_purged = idempotency.purge_expired(session, now)
    if report:
        log.info("reaper: %s", report)
    return report


def _take_back(session: Session, queue: JobQueue, job_id: str, attempt: int, now: datetime,
               report: ReapReport) -> None:
    if not repository.release_expired_lease(session, job_id, attempt, now):
        return  # renewed meanwhile, or another reaper got there first
    job = jobs_repository.get_job_any_tenant(session, job_id, refresh=True)
    if job is None:  # cannot happen: the UPDATE above holds the row until this transaction ends
        return
    lost = 1 + repository.count_events(session, job_id, LEASE_EXPIRED_EVENT)
    session.add(JobEvent(
        job_id=job_id, type=LEASE_EXPIRED_EVENT, attempt=attempt, created_at=now,
        message=f"attempt {attempt} (worker {job.worker_id}) stopped renewing its lease",
        data={"attempt": attempt, "worker_id": job.worker_id, "lost_leases": lost, "max_attempts": job.max_attempts},
    ))
    if job.status == JobStatus.cancelling.value:
        transition(session, job, JobStatus.cancelled, reason="worker lost while cancelling")
        report.cancelled.append(job_id)
    elif job.pause_requested:
        transition(session, job, JobStatus.paused, reason="worker lost; paused at its last checkpoint")
        report.paused.append(job_id)
    elif lost >= job.max_attempts:
        job.error_code = WORKER_LOST
        job.error_message = f"the worker running this job was lost {lost} times (max_attempts={job.max_attempts})"
        transition(session, job, JobStatus.failed, reason=job.error_message)
        report.failed.append(job_id)
    else:
        transition(session, job, JobStatus.queued, reason=f"lease of attempt {attempt} expired; re-enqueued",
                   data={"lost_leases": lost})
        on_commit(session, partial(send_job_logged, queue, job.id, job.queue))
        report.requeued.append(job_id)


def _resend(session: Session, queue: JobQueue, job_id: str, cutoff: datetime, now: datetime,
            report: ReapReport) -> None:
    bumped = repository.touch_stale_queued(session, job_id, cutoff, now)
    if bumped is None:
        return
    on_commit(session, partial(send_job_logged, queue, job_id, bumped))
    report.resent.append(job_id)


def run_reaper_loop(queue: JobQueue, settings: Settings, stop: threading.Event,
                    interval: float | None = None) -> None:
    """Reap every `interval` seconds until `stop` is set; a failing pass is logged and retried."""
    period = interval if interval is not None else reaper_interval(settings)
    while not stop.wait(period):
        try:
            reap_once(queue, settings)
        except Exception:
            log.exception("reaper pass failed; retrying in %.1fs", period)


def reaper_interval(settings: Settings) -> float:
    """Often enough that an expired lease is noticed within a fraction of the lease."""
    return max(0.5, min(settings.lease_seconds / 4, settings.queued_resend_seconds / 4, 15.0))


def start_reaper_thread(queue: JobQueue, settings: Settings) -> tuple[threading.Thread, threading.Event]:
    outbox.register()  # the reaper's transitions are announced (service.webhooks.outbox)
    stop = threading.Event()
    thread = threading.Thread(target=run_reaper_loop, args=(queue, settings, stop), name="reaper", daemon=True)
    thread.start()
    return thread, stop
