"""Plain factory functions for service tests (importable; the fixtures in conftest.py wrap them)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from service.tenants import service as tenants
from service.tenants.models import Tenant


class TenantHeaders(dict[str, str]):
    """Request headers authenticating as one tenant, carrying that tenant's id and key as attributes.

    Pass it straight as `headers=`; use `.tenant_id` for direct database set-up.
    """

    def __init__(self, tenant_id: str, api_key: str) -> None:
        super().__init__(auth_headers(api_key))
        self.tenant_id = tenant_id
        self.api_key = api_key


def create_tenant(session: Session, name: str) -> tuple[Tenant, str]:
    """A tenant and a fresh plaintext API key for it with every scope (flushed, not committed)."""
    tenant = tenants.create_tenant(session, name)
    _row, token = tenants.create_api_key(session, tenant)
    return tenant, token


def create_key(session: Session, tenant_id: str, scopes: Iterable[str], **fields: Any) -> str:
    """Another plaintext key for an existing tenant, with exactly `scopes` (flushed, not committed)."""
    tenant = tenants.find_tenant(session, tenant_id)
    _row, token = tenants.create_api_key(session, tenant, scopes=scopes, **fields)
    return token


def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}
