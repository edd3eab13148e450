"""Quotas per tenant: the one check REST and gRPC share, the claim's limits, and their administration.

Four limits, each a service default (settings `quota_*`) that a tenant's override replaces:

- `max_queued_jobs`: jobs waiting, `queued` or `paused`. A new job is refused once the tenant's queued and
  paused jobs together reach it, and a resumed one once its queued jobs alone do (the paused job being resumed
  is already counted): 429 / RESOURCE_EXHAUSTED (it frees up as jobs start, or when paused ones are cancelled).
  So pausing jobs cannot park more than the limit: a tenant holds at most `max_queued_jobs` waiting jobs plus
  those that paused while running (which the limit admitted before they started).
- `max_running_jobs`: jobs running at once. Never an error: the fair claim (service/execution/lease.py) leaves the job
  `queued` until one of the tenant's jobs ends.
- `max_devices`: devices the tenant's running jobs occupy together; checked by the claim like the running
  quota. A job that alone needs more than the limit could never start and is refused at submission:
  409 / FAILED_PRECONDITION.
- `max_dataset_storage_bytes`: total size of the tenant's (not deleted) datasets. An upload past it is
  refused: 409 / FAILED_PRECONDITION (it frees up only when the tenant deletes datasets).

Every refusal is `QuotaExceeded` (code `quota_exceeded`) with details {quota, limit, current, requested}.
A check locks the tenant row first, so concurrent requests cannot both take the last unit.

What a tenant uses is counted by the domain whose rows it is, which hands its counter in (`CountJobs`,
`CountStoredBytes`): quotas import nothing of the jobs and datasets they limit. A check runs the counter after
the lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from sqlalchemy.orm import Session

from contract.api.quotas import QUOTA_NAMES, QuotaLimits, QuotaName, QuotasOut, QuotaUsage
from service.kit.config import Settings, get_settings
from service.kit.db import utcnow
from service.kit.errors import DomainError, NotFound
from service.quotas import repository
from service.quotas.models import TenantQuota
from service.tenants import repository as tenants_repository


class QuotaExceeded(DomainError):
    """Over a quota. 429 / RESOURCE_EXHAUSTED when it frees up as jobs start, else 409 / FAILED_PRECONDITION."""

    code = "quota_exceeded"

    def __init__(self, quota: QuotaName, *, limit: int, current: int, requested: int, waits: bool) -> None:
        super().__init__(
            f"quota {quota} exceeded: limit {limit}, in use {current}, requested {requested}",
            details={"quota": quota, "limit": limit, "current": current, "requested": requested},
        )
        self.http_status = 429 if waits else 409
        self.grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED if waits else grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class JobLoad:
    """What a tenant's jobs take of the job quotas: running (worker-owned) jobs, queued and paused jobs, and the
    devices of the running ones."""

    running_jobs: int
    queued_jobs: int
    paused_jobs: int
    devices: int


# (session, tenant id) -> the tenant's JobLoad (service.jobs.repository.job_load).
CountJobs = Callable[[Session, str], JobLoad]
# (session, tenant id) -> bytes of the tenant's datasets that are not deleted (service.datasets.repository).
CountStoredBytes = Callable[[Session, str], int]


def default_limits(settings: Settings | None = None) -> QuotaLimits:
    settings = settings or get_settings()
    return QuotaLimits(
        max_running_jobs=settings.quota_max_running_jobs,
        max_queued_jobs=settings.quota_max_queued_jobs,
        max_devices=settings.quota_max_devices,
        max_dataset_storage_bytes=settings.quota_max_dataset_storage_bytes,
    )


def _overrides(row: TenantQuota | None) -> QuotaLimits:
    if row is None:
        return QuotaLimits()
    return QuotaLimits.model_validate({name: getattr(row, name) for name in QUOTA_NAMES})


def limits_for(session: Session, tenant_id: str) -> QuotaLimits:
    """The limits that apply to the tenant: its overrides over the service defaults."""
    overrides = _overrides(repository.get_override(session, tenant_id))
    defaults = default_limits()
    return QuotaLimits.model_validate(
        {name: _pick(getattr(overrides, name), getattr(defaults, name)) for name in QUOTA_NAMES}
    )


def _pick(override: int | None, default: int | None) -> int | None:
    return default if override is None else override


# --- checks ---------------------------------------------------------------------------------------


def check_can_queue(
    session: Session, tenant_id: str, devices: int, count_jobs: CountJobs, *, resuming: bool = False
) -> None:
    """Before a job of `devices` devices becomes queued: QuotaExceeded past max_queued_jobs (a created job
    counts the tenant's queued and paused jobs, a resumed one its queued jobs: see the module docstring), or
    when the job alone needs more than max_devices."""
    tenants_repository.lock_tenant(session, tenant_id)
    limits = limits_for(session, tenant_id)
    use = count_jobs(session, tenant_id)
    if limits.max_devices is not None and devices > limits.max_devices:
        raise QuotaExceeded(
            "max_devices", limit=limits.max_devices, current=use.devices, requested=devices, waits=False
        )
    waiting = use.queued_jobs if resuming else use.queued_jobs + use.paused_jobs
    if limits.max_queued_jobs is not None and waiting + 1 > limits.max_queued_jobs:
        raise QuotaExceeded(
            "max_queued_jobs", limit=limits.max_queued_jobs, current=waiting, requested=1, waits=True
        )


def check_dataset_storage(session: Session, tenant_id: str, size: int, stored_bytes: CountStoredBytes) -> None:
    """Before a dataset of `size` bytes is recorded: QuotaExceeded past max_dataset_storage_bytes."""
    tenants_repository.lock_tenant(session, tenant_id)
    limit = limits_for(session, tenant_id).max_dataset_storage_bytes
    if limit is None:
        return
    stored = stored_bytes(session, tenant_id)
    if stored + size > limit:
        raise QuotaExceeded("max_dataset_storage_bytes", limit=limit, current=stored, requested=size, waits=False)


# --- administration ---------------------------------------------------------------------------------


def get_quotas(
    session: Session, tenant_id: str, count_jobs: CountJobs, stored_bytes: CountStoredBytes
) -> QuotasOut:
    """Limits, overrides and current use of a tenant (NotFound if there is no such tenant)."""
    if tenants_repository.get_tenant(session, tenant_id) is None:
        raise NotFound("tenant", tenant_id)
    use = count_jobs(session, tenant_id)
    return QuotasOut(
        tenant_id=tenant_id,
        limits=limits_for(session, tenant_id),
        overrides=_overrides(repository.get_override(session, tenant_id)),
        usage=QuotaUsage(
            running_jobs=use.running_jobs,
            queued_jobs=use.queued_jobs + use.paused_jobs,
            devices=use.devices,
            dataset_storage_bytes=stored_bytes(session, tenant_id),
        ),
    )


def set_overrides(session: Session, tenant_id: str, overrides: QuotaLimits) -> None:
    """Replace the tenant's overrides (a null field: the service default). Callers use
    service.admin.quotas.write_quotas, which also wakes the jobs a raised limit lets start."""
    if not tenants_repository.lock_tenant(session, tenant_id):
        raise NotFound("tenant", tenant_id)
    row = repository.get_override(session, tenant_id)
    if row is None:
        row = TenantQuota(tenant_id=tenant_id)
        repository.add(session, row)
    for name in QUOTA_NAMES:
        setattr(row, name, getattr(overrides, name))
    row.updated_at = utcnow()
    session.flush()
