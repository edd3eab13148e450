"""The SQL of job execution: the claim, the lease fence, the resume point and the reaper's queries, on the jobs
table that the jobs domain owns (service/jobs/models.py). Only the execution port (this package) writes a job's
ownership columns (attempt, lease_until, worker_id)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Integer, delete, func, literal, or_, select, text, update
from sqlalchemy.orm import Session

from service.jobs.models import Job, JobEvent, JobMetric, JobSample
from service.jobs.states import WORKER_OWNED, JobStatus
from service.quotas.models import TenantQuota


class JobControl(NamedTuple):
    """What a running attempt polls between steps."""

    status: str
    pause_requested: bool
    attempt: int


def job_control(session: Session, job_id: str) -> JobControl | None:
    row = session.execute(
        select(Job.status, Job.pause_requested, Job.attempt).where(Job.id == job_id)
    ).one_or_none()
    return None if row is None else JobControl(row[0], bool(row[1]), int(row[2]))


def delete_step_samples(session: Session, job_id: str, step: int) -> None:
    session.execute(delete(JobSample).where(JobSample.job_id == job_id, JobSample.step == step))


_OWNED = [state.value for state in WORKER_OWNED]


def claim_row(session: Session, job_id: str, worker_id: str, *, now: datetime, lease_until: datetime) -> bool:
    """Start a new attempt of `job_id` iff it is queued, or running with an expired lease. The conditional
    UPDATE is the claim: of two workers racing for the row, exactly one matches."""
    claimable = or_(
        Job.status == JobStatus.queued.value,
        (Job.status == JobStatus.running.value) & (Job.lease_until < now),
    )
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, claimable)
        .values(
            attempt=Job.attempt + 1,
            lease_until=lease_until,
            worker_id=worker_id,
            updated_at=now,
            version=Job.version + 1,
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def claim_target(session: Session, job_id: str) -> tuple[str, str, datetime | None] | None:
    """(status, queue, lease_until) of the job a delivery names."""
    row = session.execute(select(Job.status, Job.queue, Job.lease_until).where(Job.id == job_id)).one_or_none()
    return None if row is None else (row.status, row.queue, row.lease_until)


def lock_claims(session: Session, queue: str) -> None:
    """Serialise fair claims of `queue` until the transaction ends, so two workers choosing at once do not both
    count a tenant's running jobs before either claim commits. PostgreSQL: a transaction-level advisory lock
    per queue; SQLite: a write that matches no row takes the database's write lock."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(func.hashtext("grpo.claim." + queue))))
    else:
        session.execute(text("UPDATE jobs SET queue = queue WHERE 1 = 0"))


def next_fair_job(
    session: Session, queue: str, *, default_max_running: int | None, default_max_devices: int | None
) -> str | None:
    """The queued job of `queue` that a free worker should run next, or None when nothing queued may start.

    Among tenants with a queued job in `queue` and still under their running-jobs and devices quotas: the
    tenant with the fewest running jobs (in any queue); between equals, the one served least recently (its
    latest job start; never served first), then the one waiting longest. Of that tenant's queued jobs: the
    highest priority, then the oldest. Priority orders a tenant's own jobs only, so it cannot buy a tenant a
    place ahead of others."""
    waiting = (
        select(Job.tenant_id.label("tenant_id"), func.min(Job.created_at).label("waiting_since"))
        .where(Job.status == JobStatus.queued.value, Job.queue == queue)
        .group_by(Job.tenant_id)
        .subquery()
    )
    owned = Job.status.in_(_OWNED)
    load = (
        select(
            Job.tenant_id.label("tenant_id"),
            func.count().filter(owned).label("running"),
            func.coalesce(func.sum(Job.devices).filter(owned), 0).label("devices"),
            func.max(Job.started_at).label("last_started"),
        )
        .where(Job.tenant_id.in_(select(waiting.c.tenant_id)))
        .group_by(Job.tenant_id)
        .subquery()
    )
    max_running = func.coalesce(TenantQuota.max_running_jobs, literal(default_max_running, Integer))
    max_devices = func.coalesce(TenantQuota.max_devices, literal(default_max_devices, Integer))
    stmt = (
        select(Job.id)
        .join(waiting, waiting.c.tenant_id == Job.tenant_id)
        .join(load, load.c.tenant_id == Job.tenant_id)
        .outerjoin(TenantQuota, TenantQuota.tenant_id == Job.tenant_id)
        .where(
            Job.status == JobStatus.queued.value,
            Job.queue == queue,
            or_(max_running.is_(None), load.c.running < max_running),
            or_(max_devices.is_(None), load.c.devices + Job.devices <= max_devices),
        )
        .order_by(
            load.c.running,
            load.c.last_started.asc().nulls_first(),
            waiting.c.waiting_since,
            Job.tenant_id,
            Job.priority.desc(),
            Job.created_at,
            Job.id,
        )
        .limit(1)
    )
    return session.scalar(stmt)


def renew_lease(session: Session, job_id: str, attempt: int, lease_until: datetime) -> bool:
    """The fence: extend the lease iff `attempt` still owns the job. Locks the row until the transaction ends."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(_OWNED))
        .values(lease_until=lease_until)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def discard_steps_after(session: Session, job_id: str, step: int, *, attempt: int) -> None:
    """Forget what earlier attempts recorded after `step`: metrics and samples are deleted, their events kept in
    the log but marked superseded. Each domain deletes its own rows: checkpoints and usage records are
    checkpoints.repository's and usage.repository's `delete_steps_after`; service/execution/lease.py calls all three in
    one transaction."""
    session.execute(
        update(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.step > step, JobEvent.attempt < attempt)
        .values(superseded=True)
        .execution_options(synchronize_session=False)
    )
    session.execute(delete(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > step))
    session.execute(delete(JobSample).where(JobSample.job_id == job_id, JobSample.step > step))


def set_resume_point(session: Session, job_id: str, step: int, checkpoint_id: str | None) -> None:
    session.execute(
        update(Job).where(Job.id == job_id).values(current_step=step, resume_checkpoint_id=checkpoint_id)
    )


def expired_leases(session: Session, now: datetime) -> list[tuple[str, int]]:
    """(job id, attempt) of owned jobs whose lease ran out."""
    rows = session.execute(select(Job.id, Job.attempt).where(Job.status.in_(_OWNED), Job.lease_until < now))
    return [(row.id, row.attempt) for row in rows]


def release_expired_lease(session: Session, job_id: str, attempt: int, now: datetime) -> bool:
    """Take the job back from `attempt` iff its lease is still expired and no newer attempt claimed it."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(_OWNED), Job.lease_until < now)
        .values(lease_until=None, version=Job.version + 1)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def count_events(session: Session, job_id: str, type_: str) -> int:
    stmt = select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == type_)
    return int(session.scalar(stmt) or 0)


def stale_queued_jobs(session: Session, cutoff: datetime) -> list[str]:
    """Ids of jobs still queued with no change since `cutoff` (their message may be lost)."""
    stmt = select(Job.id).where(Job.status == JobStatus.queued.value, Job.updated_at < cutoff)
    return list(session.scalars(stmt))


def touch_stale_queued(session: Session, job_id: str, cutoff: datetime, now: datetime) -> str | None:
    """Bump a still-stale queued job's `updated_at` to `now`; returns its queue, or None if it changed."""
    return session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.queued.value, Job.updated_at < cutoff)
        .values(updated_at=now)
        .returning(Job.queue)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
