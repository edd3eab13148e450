"""All SQL of the jobs domain. Every query of a tenant's data filters on tenant_id."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import Integer, Select, bindparam, delete, exists, func, or_, select
from sqlalchemy.orm import Session

from contract.spec import CHECKPOINT_PREFIX
from service.datasets import repository as datasets_repository
from service.jobs.models import IdempotencyKey, Job, JobEvent, JobMetric, JobSample
from service.jobs.states import UNFINISHED, WORKER_OWNED, JobStatus
from service.kit.reads import Reads, one_or_none
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
    # Training jobs only: an evaluation's job is listed as an evaluation (service.evaluations).
    stmt = select(*_JOB_COLUMNS).where(table.c.tenant_id == bindparam("tenant_id"), table.c.kind == "train")
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


def events_of_type(session: Session, job_id: str, type_: str) -> Sequence[JobEvent]:
    """Oldest first."""
    stmt = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == type_).order_by(JobEvent.id)
    return session.scalars(stmt).all()


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


def list_samples(
    session: Session, job_id: str, *, step: int | None, after_id: int | None, limit: int
) -> Sequence[JobSample]:
    stmt = select(JobSample).where(JobSample.job_id == job_id)
    if step is not None:
        stmt = stmt.where(JobSample.step == step)
    if after_id is not None:
        stmt = stmt.where(JobSample.id > after_id)
    return session.scalars(stmt.order_by(JobSample.id).limit(limit)).all()


def oldest_queued_per_queue(session: Session, tenant_id: str) -> dict[str, str]:
    """{queue: id of the tenant's oldest queued job in it} for every queue where the tenant has one."""
    stmt = (
        select(Job.queue, func.min(Job.id).label("job_id"))
        .where(Job.tenant_id == tenant_id, Job.status == JobStatus.queued.value)
        .group_by(Job.queue)
    )
    return {row.queue: row.job_id for row in session.execute(stmt)}


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
