"""All SQL of the quotas domain: a tenant's overrides. What the tenant uses is counted by the domains whose rows
it is (service.quotas.service.JobLoad, CountStoredBytes)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.quotas.models import TenantQuota


def get_override(session: Session, tenant_id: str) -> TenantQuota | None:
    return session.get(TenantQuota, tenant_id, populate_existing=True)


def add(session: Session, row: TenantQuota) -> None:
    session.add(row)
    session.flush()
