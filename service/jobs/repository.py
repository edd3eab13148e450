"""All SQL of the jobs domain. Every query of a tenant's data filters on tenant_id."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import Integer, Select, bindparam, delete, exists, func, literal, or_, select, text, update
from sqlalchemy.orm import Session

from contract.spec import CHECKPOINT_PREFIX
from service.datasets import repository as datasets_repository
from service.jobs.models import IdempotencyKey, Job, JobEvent, JobMetric, JobSample
from service.jobs.states import UNFINISHED, WORKER_OWNED, JobStatus
from service.kit.reads import Reads, one_or_none
from service.quotas.models import TenantQuota
from service.quotas.service import JobLoad
from service.rewards import repository as rewards_repository
from service.rewards.models import RewardFunction


def get_job(session: Session, tenant_id: str, job_id: str, *, for_update: bool = False) -> Job | None:
    stmt = select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id)
    if for_update:
        # Row lock (PostgreSQL): serialises API transitions with the worker's writes to this job.
        stmt = stmt.with_for_update()
    return session.scalars(stmt).one_or_none()


# Every column of `jobs`, named as the ORM attributes are (`metadata` is `metadata_`), so a plain row renders
# like a Job entity does (schemas.job_out).
_JOB_COLUMNS = [
    column.label("metadata_") if column.key == "metadata" else column for column in Job.__table__.c
]


# Built once with bound parameters: building the statement and its cache key on every call cost about as much
# as the rest of SQLAlchemy's work for this read. Only the statement is reused, never a result.
_JOB_ROW = select(*_JOB_COLUMNS).where(
    Job.__table__.c.id == bindparam("job_id"), Job.__table__.c.tenant_id == bindparam("tenant_id")
)


async def get_job_row(reads: Reads, tenant_id: str, job_id: str) -> Any | None:
    """The job as a plain row, for reads that only render it (the polled read path): a Core statement
    skips the ORM's entity construction, identity map and attribute instrumentation, and `reads` runs it
    without a thread hop on PostgreSQL (see kit.reads). Always a fresh SELECT: nothing is cached."""
    return await one_or_none(reads, _JOB_ROW, {"job_id": job_id, "tenant_id": tenant_id})


def get_job_any_tenant(
    session: Session, job_id: str, *, for_update: bool = False, refresh: bool = False
) -> Job | None:
    """For the worker, which acts on a job id it was sent, not on behalf of a tenant. `refresh` re-reads an
    entity already in the session (after a Core UPDATE of its row)."""
    stmt = select(Job).where(Job.id == job_id)
    if for_update:
        stmt = stmt.with_for_update()
    if refresh:
        stmt = stmt.execution_options(populate_existing=True)
    return session.scalars(stmt).one_or_none()


@lru_cache(maxsize=4)
def _job_page(by_status: bool, with_cursor: bool) -> Select[Any]:
    """The list statement for one combination of filters, built once (see _JOB_ROW)."""
    table = Job.__table__
    stmt = select(*_JOB_COLUMNS).where(table.c.tenant_id == bindparam("tenant_id"))
    if by_status:
        stmt = stmt.where(table.c.status == bindparam("status"))
    if with_cursor:
        stmt = stmt.where(table.c.id < bindparam("before_id"))
    return stmt.order_by(table.c.id.desc()).limit(bindparam("limit", type_=Integer))


async def list_jobs(
    reads: Reads, tenant_id: str, *, status: str | None, limit: int, before_id: str | None
) -> Sequence[Any]:
    """Newest first, as plain rows (see get_job_row). Ids are time-sortable, so `id < before_id` is a stable
    cursor."""
    stmt = _job_page(status is not None, before_id is not None)
    params = {"tenant_id": tenant_id, "status": status, "before_id": before_id, "limit": limit}
    return await reads.all(stmt, params)


def job_load(session: Session, tenant_id: str) -> JobLoad:
    """What the tenant's jobs take of its job quotas (service.quotas.service.check_can_queue)."""
    owned = Job.status.in_([state.value for state in WORKER_OWNED])
    row = session.execute(
        select(
            func.count().filter(owned),
            func.count().filter(Job.status == JobStatus.queued.value),
            func.count().filter(Job.status == JobStatus.paused.value),
            func.coalesce(func.sum(Job.devices).filter(owned), 0),
        ).where(
            Job.tenant_id == tenant_id,
            Job.status.in_([*(state.value for state in WORKER_OWNED), JobStatus.queued.value, JobStatus.paused.value]),
        )
    ).one()
    return JobLoad(running_jobs=int(row[0]), queued_jobs=int(row[1]), paused_jobs=int(row[2]), devices=int(row[3]))


def job_uses_dataset(session: Session, tenant_id: str, dataset_id: str, statuses: Sequence[str]) -> bool:
    stmt = select(
        exists().where(
            Job.tenant_id == tenant_id,
            Job.status.in_(statuses),
            or_(Job.train_dataset_id == dataset_id, Job.eval_dataset_id == dataset_id),
        )
    )
    return bool(session.scalar(stmt))


# --- references a job spec makes ------------------------------------------------------------------


def live_dataset_keys(session: Session, tenant_id: str, ids: Sequence[str]) -> dict[str, str]:
    """{dataset id: storage key} of those of `ids` that are the tenant's and not deleted (the worker's inputs)."""
    return {dataset_id: row.storage_key for dataset_id, row in datasets_repository.live(session, tenant_id, ids).items()}


def live_reward_functions(session: Session, tenant_id: str, ids: Sequence[str]) -> dict[str, RewardFunction]:
    """{id: row} of those of `ids` that are the tenant's and not deleted (the worker's inputs)."""
    return rewards_repository.live(session, tenant_id, ids)


def base_model_uses(session: Session, checkpoint_ids: Sequence[str]) -> set[str]:
    """Those of `checkpoint_ids` that an unfinished job (queued, running, paused...) uses as its base model."""
    if not checkpoint_ids:
        return set()
    names = [CHECKPOINT_PREFIX + checkpoint_id for checkpoint_id in checkpoint_ids]
    used = session.scalars(
        select(Job.base_model).where(Job.base_model.in_(names), Job.status.in_([s.value for s in UNFINISHED]))
    )
    return {name.removeprefix(CHECKPOINT_PREFIX) for name in used}


# --- events, metrics, samples ---------------------------------------------------------------------


def list_events(
    session: Session,
    job_id: str,
    *,
    after_id: int | None,
    limit: int,
    types: Sequence[str] | None = None,
    include_superseded: bool = False,
) -> Sequence[JobEvent]:
    """Oldest first, from after `after_id` (the cursor, also the SSE Last-Event-ID)."""
    stmt = select(JobEvent).where(JobEvent.job_id == job_id)
    if not include_superseded:
        stmt = stmt.where(JobEvent.superseded.is_(False))
    if after_id is not None:
        stmt = stmt.where(JobEvent.id > after_id)
    if types:
        stmt = stmt.where(JobEvent.type.in_(types))
    return session.scalars(stmt.order_by(JobEvent.id).limit(limit)).all()


def job_status(session: Session, job_id: str) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


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


def replace_metrics(
    session: Session, job_id: str, step: int, values: Mapping[str, float], attempt: int
) -> None:
    """Write a step's metrics; a re-recorded step (retried attempt) replaces the earlier values."""
    session.execute(
        delete(JobMetric).where(
            JobMetric.job_id == job_id, JobMetric.step == step, JobMetric.name.in_(list(values))
        )
    )
    session.add_all(
        JobMetric(job_id=job_id, step=step, name=name, value=value, attempt=attempt)
        for name, value in values.items()
    )


def metrics_at_step(session: Session, job_id: str, step: int) -> dict[str, float]:
    """{name: value} of the metrics recorded at `step` (a checkpoint's metrics unless the worker names them)."""
    stmt = select(JobMetric.name, JobMetric.value).where(JobMetric.job_id == job_id, JobMetric.step == step)
    return {row.name: row.value for row in session.execute(stmt)}


def metric_rows(
    session: Session, job_id: str, *, names: Sequence[str] | None, since_step: int, limit: int
) -> Sequence[tuple[int, str, float]]:
    stmt = select(JobMetric.step, JobMetric.name, JobMetric.value).where(
        JobMetric.job_id == job_id, JobMetric.step >= since_step
    )
    if names:
        stmt = stmt.where(JobMetric.name.in_(names))
    rows = session.execute(stmt.order_by(JobMetric.step, JobMetric.name).limit(limit)).all()
    return [(row.step, row.name, row.value) for row in rows]


def delete_step_samples(session: Session, job_id: str, step: int) -> None:
    session.execute(delete(JobSample).where(JobSample.job_id == job_id, JobSample.step == step))


def list_samples(
    session: Session, job_id: str, *, step: int | None, after_id: int | None, limit: int
) -> Sequence[JobSample]:
    stmt = select(JobSample).where(JobSample.job_id == job_id)
    if step is not None:
        stmt = stmt.where(JobSample.step == step)
    if after_id is not None:
        stmt = stmt.where(JobSample.id > after_id)
    return session.scalars(stmt.order_by(JobSample.id).limit(limit)).all()


# --- worker ownership: claim, lease fencing, resume point, reaper (see worker/lease.py) ---------------

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


def oldest_queued_per_queue(session: Session, tenant_id: str) -> dict[str, str]:
    """{queue: id of the tenant's oldest queued job in it} for every queue where the tenant has one."""
    stmt = (
        select(Job.queue, func.min(Job.id).label("job_id"))
        .where(Job.tenant_id == tenant_id, Job.status == JobStatus.queued.value)
        .group_by(Job.queue)
    )
    return {row.queue: row.job_id for row in session.execute(stmt)}


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
    checkpoints.repository's and usage.repository's `delete_steps_after`; worker/lease.py calls all three in
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


# --- idempotency keys -----------------------------------------------------------------------------


def get_idempotency_key(session: Session, tenant_id: str, key: str) -> IdempotencyKey | None:
    return session.get(IdempotencyKey, (tenant_id, key), populate_existing=True)


def delete_idempotency_key(session: Session, tenant_id: str, key: str, *, created_at: datetime) -> None:
    """Delete the claim only if it is still the one we looked at (a concurrent re-claim survives)."""
    session.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.tenant_id == tenant_id,
            IdempotencyKey.key == key,
            IdempotencyKey.created_at == created_at,
        )
    )


def delete_idempotency_keys_before(session: Session, cutoff: datetime) -> int:
    result = session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < cutoff))
    return int(getattr(result, "rowcount", 0) or 0)
