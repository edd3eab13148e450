"""Job ownership: the fair claim, the lease heartbeat and attempt fencing. The job row is the truth.

A Celery message `grpo.run_job(X)` only wakes a worker; it means "a job of X's queue may be ready", not "run X".
The delivery claims the *fair choice* of X's queue (`claim_next`), which may be another job Y:

1. X is `running` with an expired lease (a redelivery after its worker died): X is taken over, as below. It
   already started, so it keeps its place.
2. Otherwise the delivery serialises with the other claims of X's queue (`repository.lock_claims`: an advisory
   lock on PostgreSQL, the write lock on SQLite) and chooses, among queued jobs of that queue whose tenant is
   under its running-jobs and devices quotas, a job of the tenant with the fewest running jobs (between equals,
   the tenant served least recently, then the one waiting longest): that tenant's highest-priority, then
   oldest, job (`repository.next_fair_job`). Then it claims that job. With one worker every tenant has zero
   running jobs whenever it frees up, so "served least recently" is what makes tenants take turns.

Every queued job was sent one message, so there are at least as many deliveries as queued jobs; each delivery
starts at most one. When Y ran in X's stead, Y's own message later finds X (or whichever job is fairest then),
or nothing: a delivery that finds nothing claimable returns quietly. Duplicates, redeliveries and the reaper's
re-sends are therefore harmless, and the order holds with any number of workers and either broker, because it
is decided by the rows at claim time, not by the order of messages. A job left waiting by its tenant's running
quota gets a new message when one of its tenant's jobs ends (`wake_waiting_jobs`) or when an operator raises
the quota; the reaper's re-send of stale queued jobs is the backstop.

The claim itself is one conditional UPDATE:

    UPDATE jobs SET attempt = attempt + 1, lease_until = now + lease, worker_id = me, version = version + 1
    WHERE id = :job AND (status = 'queued' OR (status = 'running' AND lease_until < now))

Zero rows updated means someone else owns the job, or it is finished, paused or cancelled (on PostgreSQL a
cancel can land between the choice and the claim: the delivery chooses again). A queued job that was
cancelled therefore never starts.

`attempt` is the fencing token. Every later write (metrics, events, checkpoints, state) runs in a
transaction that begins with

    UPDATE jobs SET lease_until = now + lease WHERE id = :job AND attempt = :mine AND status IN (running, cancelling)

and is refused (`LeaseLost`, rolled back) when that matches nothing, i.e. when the reaper took the job back
or a newer attempt claimed it. Because the fence is an UPDATE, it locks the row (PostgreSQL) or takes the
database write lock (SQLite) until the transaction ends, so a write and a takeover are serialised: a
worker frozen with SIGSTOP whose lease expired cannot write anything after it wakes up.

The heartbeat thread renews the lease every `lease_seconds / 3`; a frozen or dead worker stops renewing
and the reaper (service/execution/reaper.py) re-enqueues the job once `lease_until` has passed.

Before claiming, a job whose own budget or tenant's monthly cap is already reached is paused with
`budget_exhausted` instead (`paused_for_budget`), so no step runs past a cap; the delivery then chooses again.

Claiming also prepares the resume: metrics, samples and usage records of steps after the latest checkpoint (written by
the dead attempt) are deleted in the claim transaction, so the new attempt, which restarts from that
checkpoint, records every later step exactly once.

Database calls retry transient errors (a PostgreSQL restart, SQLite "database is locked") with tenacity.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session
from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

from service.checkpoints import repository as checkpoints_repository
from service.checkpoints.models import Checkpoint
from service.evaluations import repository as evaluations_repository
from service.evaluations.service import EVALUATION
from service.execution import repository
from service.jobs import repository as jobs_repository
from service.jobs import service as jobs_service
from service.jobs.models import JobEvent
from service.jobs.states import JobStatus, transition
from service.kit.db import session_scope, utcnow
from service.kit.queue import get_job_queue
from service.usage import repository as usage_repository

log = logging.getLogger(__name__)

T = TypeVar("T")
OWNED_STATES = (JobStatus.running.value, JobStatus.cancelling.value)
# How long a worker keeps retrying one database write (e.g. through a PostgreSQL restart).
DB_RETRY_SECONDS = 120.0


_process_id: tuple[int, str] | None = None  # (pid, id) of this process; a forked child draws its own


def process_worker_id() -> str:
    """This worker process's opaque id (`wrk_` and 12 random hex digits), which the job row and the job events
    tenants read name it by: never its host name or PID. Logged once per process with both, so an operator
    can map an id in an event to a machine."""
    global _process_id
    pid = os.getpid()
    if _process_id is None or _process_id[0] != pid:
        _process_id = (pid, f"wrk_{secrets.token_hex(6)}")
        log.info("worker id %s is host %s, pid %d", _process_id[1], socket.gethostname(), pid)
    return _process_id[1]


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

# Times a delivery re-chooses when the job it chose changed under it (PostgreSQL: cancelled, paused or claimed
# by a takeover between the choice and the claim). Each miss means the queue changed; the bound only keeps a
# pathological churn from spinning.
_FAIR_CHOICES = 8


@dataclass(frozen=True)
class ClaimLimits:
    """The defaults of the quotas the claim enforces (tenant_quotas rows override them per tenant)."""

    max_running_jobs: int | None = None
    max_devices: int | None = None


def claim_next(
    session: Session, job_id: str, worker_id: str, lease_seconds: int, limits: ClaimLimits
) -> Claim | None:
    """What one delivery of `grpo.run_job(job_id)` claims (see the module docstring). Never commits."""
    target = repository.claim_target(session, job_id)
    if target is None:
        return None
    status, queue, lease_until = target
    if status == JobStatus.running.value and lease_until is not None and lease_until < utcnow():
        # A redelivery of a job whose worker died: it already started, so it keeps its place.
        if paused_for_budget(session, job_id):
            return None
        return claim_job(session, job_id, worker_id, lease_seconds)
    repository.lock_claims(session, queue)
    for _ in range(_FAIR_CHOICES):
        chosen = repository.next_fair_job(
            session, queue, default_max_running=limits.max_running_jobs, default_max_devices=limits.max_devices
        )
        if chosen is None:
            return None
        if paused_for_budget(session, chosen):
            continue  # paused: the delivery chooses again
        claim = claim_job(session, chosen, worker_id, lease_seconds)
        if claim is not None:
            if chosen != job_id:
                log.info("delivery for job %s claimed job %s (the fair choice of queue %s)", job_id, chosen, queue)
            return claim
    return None



def claim_delivery(job_id: str, worker_id: str, lease_seconds: int, limits: ClaimLimits) -> Claim | None:
    """`claim_next` in a transaction of its own, committed when it returns."""
    with session_scope() as session:
        return claim_next(session, job_id, worker_id, lease_seconds, limits)


def paused_for_budget(session: Session, job_id: str) -> bool:
    """Before claiming: a job whose budget or tenant's monthly cap is already reached is paused with
    `budget_exhausted` (service.jobs.service.pause_if_exhausted) and not started, so no step runs past it."""
    job = jobs_repository.get_job_any_tenant(session, job_id, for_update=True)
    if job is None or job.status not in (JobStatus.queued.value, JobStatus.running.value):
        return False  # the claim's conditional UPDATE settles it
    reached = jobs_service.pause_if_exhausted(session, job)
    if reached is not None:
        log.info("job %s: not started, %s", job_id, reached.message)
    return reached is not None


def claim_job(session: Session, job_id: str, worker_id: str, lease_seconds: int) -> Claim | None:
    """Take ownership of `job_id` for a new attempt, or return None (duplicate delivery). Never commits."""
    now = utcnow()
    if not repository.claim_row(session, job_id, worker_id, now=now, lease_until=_lease_end(lease_seconds, now)):
        return None
    job = jobs_repository.get_job_any_tenant(session, job_id, refresh=True)
    if job is None:  # cannot happen: the claim's UPDATE holds the row until this transaction ends
        raise RuntimeError(f"job {job_id!r} vanished under its claim")
    checkpoint = latest_checkpoint(session, job_id)
    resume_step = checkpoint.step if checkpoint is not None else 0
    if job.kind == EVALUATION:
        # An evaluation's step counts the items it recorded, each batch with its progress and usage in one
        # fenced write: the next attempt continues after them.
        resume_step = evaluations_repository.items_recorded(session, job_id)
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
    return checkpoints_repository.latest_checkpoint(session, job_id, before_step=before_step)


def _discard_steps_after(session: Session, job_id: str, step: int, *, attempt: int) -> None:
    """Forget what attempts before `attempt` recorded after `step`, in the caller's transaction; each domain
    deletes its own rows (jobs: metrics, samples, superseded events; then checkpoints; then usage records)."""
    repository.discard_steps_after(session, job_id, step, attempt=attempt)
    checkpoints_repository.delete_steps_after(session, job_id, step)
    usage_repository.delete_steps_after(session, job_id, step)


def rewind_to(session: Session, claim: Claim, checkpoint: Checkpoint | None) -> None:
    """Resume from an older checkpoint than the claim chose (the newer one failed verification). Fenced.

    What the dead attempts recorded after that step is forgotten (_discard_steps_after).
    """
    fence(session, claim)
    step = checkpoint.step if checkpoint is not None else 0
    _discard_steps_after(session, claim.job_id, step, attempt=claim.attempt)
    repository.set_resume_point(session, claim.job_id, step, checkpoint.id if checkpoint is not None else None)


def wake_waiting_jobs(job_id: str) -> None:
    """After an attempt of `job_id` ends: deliveries for its tenant's queued jobs, which its running-jobs or
    devices quota may have held back (jobs_service.enqueue_waiting). Surplus deliveries find nothing and return."""
    try:
        with session_scope() as session:
            job = jobs_repository.get_job_any_tenant(session, job_id)
            if job is not None:
                jobs_service.enqueue_waiting(session, job.tenant_id, get_job_queue())
    except Exception:
        log.warning("could not look for waiting jobs; the reaper re-sends them", exc_info=True)


# --- fencing -----------------------------------------------------------------------------------


def fence(session: Session, claim: Claim) -> None:
    """Open a fenced write: renew the lease iff `claim` still owns the job, else raise LeaseLost.

    Call first in the transaction; the row stays locked until the transaction ends.
    """
    if not repository.renew_lease(session, claim.job_id, claim.attempt, _lease_end(claim.lease_seconds)):
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
