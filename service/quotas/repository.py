"""All SQL of the quotas domain: overrides, and what a tenant uses of each limit."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.datasets.models import Dataset
from service.jobs.models import Job
from service.jobs.states import WORKER_OWNED, JobStatus
from service.quotas.models import TenantQuota
from service.tenants.models import Tenant

_OWNED = [state.value for state in WORKER_OWNED]


def get_override(session: Session, tenant_id: str) -> TenantQuota | None:
    return session.get(TenantQuota, tenant_id, populate_existing=True)


def add(session: Session, row: TenantQuota) -> None:
    session.add(row)
    session.flush()


def lock_tenant(session: Session, tenant_id: str) -> bool:
    """Serialise quota checks of one tenant until the transaction ends (a row lock on PostgreSQL, the write lock
    on SQLite), so two requests at once cannot both take the last unit. False if the tenant does not exist."""
    result = session.execute(
        update(Tenant).where(Tenant.id == tenant_id).values(name=Tenant.name).execution_options(
            synchronize_session=False
        )
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Usage:
    running_jobs: int
    queued_jobs: int
    paused_jobs: int
    devices: int
    dataset_storage_bytes: int


def usage(session: Session, tenant_id: str) -> Usage:
    jobs = session.execute(
        select(
            func.count().filter(Job.status.in_(_OWNED)),
            func.count().filter(Job.status == JobStatus.queued.value),
            func.count().filter(Job.status == JobStatus.paused.value),
            func.coalesce(func.sum(Job.devices).filter(Job.status.in_(_OWNED)), 0),
        ).where(Job.tenant_id == tenant_id, Job.status.in_([*_OWNED, JobStatus.queued.value, JobStatus.paused.value]))
    ).one()
    stored = session.scalar(
        select(func.coalesce(func.sum(Dataset.bytes), 0)).where(
            Dataset.tenant_id == tenant_id, Dataset.deleted_at.is_(None)
        )
    )
    return Usage(
        running_jobs=int(jobs[0]), queued_jobs=int(jobs[1]), paused_jobs=int(jobs[2]), devices=int(jobs[3]),
        dataset_storage_bytes=int(stored or 0),
    )
