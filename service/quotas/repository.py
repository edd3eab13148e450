"""All SQL of the quotas domain: overrides, and what a tenant uses of each limit."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.datasets.models import Dataset
from service.jobs.models import Job
from service.jobs.states import WORKER_OWNED, JobStatus
from service.quotas.models import TenantQuota

_OWNED = [state.value for state in WORKER_OWNED]


def get_override(session: Session, tenant_id: str) -> TenantQuota | None:
    return session.get(TenantQuota, tenant_id, populate_existing=True)


def add(session: Session, row: TenantQuota) -> None:
    session.add(row)
    session.flush()


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
