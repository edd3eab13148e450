"""Job ownership: the claim, the lease heartbeat and attempt fencing. The job row is the truth.

A Celery message only wakes a worker. The worker then *claims* the job with one conditional UPDATE:

    UPDATE jobs SET attempt = attempt + 1, lease_until = now + lease, worker_id = me, version = version + 1
    WHERE id = :job AND (status = 'queued' OR (status = 'running' AND lease_until < now))

Zero rows updated means someone else owns the job, or it is finished, paused or cancelled: the message was
a duplicate (Redis redelivery, a re-send by the reaper, a second copy) and the task returns quietly. A
queued job that was cancelled therefore never starts.

`attempt` is the fencing token. Every later write (metrics, events, checkpoints, state) runs in a
transaction that begins with

    UPDATE jobs SET lease_until = now + lease WHERE id = :job AND attempt = :mine AND status IN (running, cancelling)

and is refused (`LeaseLost`, rolled back) when that matches nothing, i.e. when the reaper took the job back
or a newer attempt claimed it. Because the fence is an UPDATE, it locks the row (PostgreSQL) or takes the
database write lock (SQLite) until the transaction ends, so a write and a takeover are serialised: a
worker frozen with SIGSTOP whose lease expired cannot write anything after it wakes up.

The heartbeat thread renews the lease every `lease_seconds / 3`; a frozen or dead worker stops renewing
and the reaper (worker/reaper.py) re-enqueues the job once `lease_until` has passed.

Claiming also prepares the resume: metrics, samples and usage records of steps after the latest checkpoint (written by
the dead attempt) are deleted in the claim transaction, so the new attempt, which restarts from that
checkpoint, records every later step exactly once.

Database calls retry transient errors (a PostgreSQL restart, SQLite "database is locked") with tenacity.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import delete, or_, select, update
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session
from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

from service.checkpoints.models import Checkpoint
from service.jobs.models import Job, JobEvent, JobMetric, JobSample
from service.jobs.states import JobStatus, transition
from service.kit.db import session_scope, utcnow
from service.usage.models import JobUsage

log = logging.getLogger(__name__)

T = TypeVar("T")
OWNED_STATES = (JobStatus.running.value, JobStatus.cancelling.value)
# How long a worker keeps retrying one database write (e.g. through a PostgreSQL restart).
DB_RETRY_SECONDS = 120.0


class LeaseLost(Exception):
    """This attempt no longer owns the job: a newer attempt claimed it or the reaper took it back."""

    def __init__(self, job_id: str, attempt: int) -> None:
        super().__init__(f"job {job_id!r}: attempt {attempt} no longer owns the job; write refused")
        self.job_id = job_id
        self.attempt = attempt


def is_transient_db_error(exc: BaseException) -> bool:
    """Connection-level failures worth retrying: the server went away, refused, or the file is locked."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def with_db_retry(fn: Callable[[], T], *, seconds: float = DB_RETRY_SECONDS) -> T:
    """Run `fn` (which opens its own transaction), retrying transient database errors for `seconds`."""
    retrying = Retrying(
        retry=retry_if_exception(is_transient_db_error),
        stop=stop_after_delay(seconds),
        wait=wait_random_exponential(multiplier=0.2, max=5),
        before_sleep=before_sleep_log(log, logging.WARNING),
        reraise=True,
    )
    return retrying(fn)


@dataclass(frozen=True)
class Claim:
    """What a worker holds after a successful claim."""

    job_id: str
    attempt: int
    worker_id: str
    lease_seconds: int
    resume_step: int  # 0 when starting from scratch
    resume_checkpoint_id: str | None


def _lease_end(lease_seconds: int, now: datetime | None = None) -> datetime:
    return (now or utcnow()) + timedelta(seconds=lease_seconds)


# --- claim -------------------------------------------------------------------------------------


def claim_job(session: Session, job_id: str, worker_id: str, lease_seconds: int) -> Claim | None:
    """Take ownership of `job_id` for a new attempt, or return None (duplicate delivery). Never commits."""
    now = utcnow()
    claimable = or_(
        Job.status == JobStatus.queued.value,
        (Job.status == JobStatus.running.value) & (Job.lease_until < now),
    )
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, claimable)
        .values(
            attempt=Job.attempt + 1,
            lease_until=_lease_end(lease_seconds, now),
            worker_id=worker_id,
            updated_at=now,
            version=Job.version + 1,
        )
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    job = session.execute(select(Job).where(Job.id == job_id).execution_options(populate_existing=True)).scalar_one()
    checkpoint = latest_checkpoint(session, job_id)
    resume_step = checkpoint.step if checkpoint is not None else 0
    _discard_steps_after(session, job_id, resume_step, attempt=job.attempt)
    job.current_step = resume_step
    job.resume_checkpoint_id = checkpoint.id if checkpoint is not None else None
    job.error_code = None
    job.error_message = None
    data = {"attempt": job.attempt, "worker_id": worker_id, "resume_step": resume_step,
            "resume_checkpoint_id": job.resume_checkpoint_id}
    if job.status == JobStatus.queued.value:
        transition(session, job, JobStatus.running, reason=f"attempt {job.attempt} claimed by {worker_id}", data=data)
    else:
        # A redelivered message found a running job whose worker stopped renewing before the reaper did.
        session.add(JobEvent(job_id=job_id, type="lease_taken_over", attempt=job.attempt, data=data,
                             message=f"attempt {job.attempt} took over an expired lease"))
        session.flush()
    return Claim(job_id, job.attempt, worker_id, lease_seconds, resume_step, job.resume_checkpoint_id)


def latest_checkpoint(session: Session, job_id: str, *, before_step: int | None = None) -> Checkpoint | None:
    query = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if before_step is not None:
        query = query.where(Checkpoint.step < before_step)
    return session.execute(query.order_by(Checkpoint.step.desc()).limit(1)).scalar_one_or_none()


def _discard_steps_after(session: Session, job_id: str, step: int, *, attempt: int) -> None:
    """Forget what a dead attempt recorded after the step the new attempt resumes from.

    Its events for those steps stay in the log, marked superseded (the new attempt writes its own).
    """
    session.execute(
        update(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.step > step, JobEvent.attempt < attempt)
        .values(superseded=True)
        .execution_options(synchronize_session=False)
    )
    session.execute(delete(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > step))
    session.execute(delete(JobSample).where(JobSample.job_id == job_id, JobSample.step > step))
    session.execute(delete(JobUsage).where(JobUsage.job_id == job_id, JobUsage.step > step))
    session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step > step))


def rewind_to(session: Session, claim: Claim, checkpoint: Checkpoint | None) -> None:
    """Resume from an older checkpoint than the claim chose (the newer one failed verification). Fenced."""
    fence(session, claim)
    step = checkpoint.step if checkpoint is not None else 0
    _discard_steps_after(session, claim.job_id, step, attempt=claim.attempt)
    session.execute(
        update(Job).where(Job.id == claim.job_id).values(
            current_step=step, resume_checkpoint_id=checkpoint.id if checkpoint is not None else None
        )
    )


# --- fencing -----------------------------------------------------------------------------------


def fence(session: Session, claim: Claim) -> None:
    """Open a fenced write: renew the lease iff `claim` still owns the job, else raise LeaseLost.

    Call first in the transaction; the row stays locked until the transaction ends.
    """
    result = session.execute(
        update(Job)
        .where(Job.id == claim.job_id, Job.attempt == claim.attempt, Job.status.in_(OWNED_STATES))
        .values(lease_until=_lease_end(claim.lease_seconds))
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise LeaseLost(claim.job_id, claim.attempt)


def fenced_write(claim: Claim, work: Callable[[Session], T]) -> T:
    """Run `work(session)` in its own transaction after `fence`, retrying transient DB errors."""

    def attempt() -> T:
        with session_scope() as session:
            fence(session, claim)
            return work(session)

    return with_db_retry(attempt)


# --- heartbeat ---------------------------------------------------------------------------------


class Heartbeat:
    """A daemon thread renewing the lease every `lease_seconds / 3` until stopped or the lease is lost."""

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.interval = max(0.5, claim.lease_seconds / 3)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{claim.job_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with session_scope() as session:
                    fence(session, self.claim)
            except LeaseLost:
                log.warning("job %s attempt %d: lease lost", self.claim.job_id, self.claim.attempt)
                self.lost.set()
                return
            except Exception:
                # A database hiccup: keep trying; if it outlasts the lease, a newer attempt takes over
                # and the next fence tells us.
                log.warning("job %s: lease renewal failed; retrying", self.claim.job_id, exc_info=True)
