"""Bearer-key authentication: `authenticate()` for any transport, `CurrentTenant` for FastAPI routes."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.kit.deps import SessionDep
from service.kit.errors import Unauthenticated
from service.tenants import repository
from service.tenants.service import hash_key, lookup_prefix

# Compared against when no row matches, so a miss costs about what a hit costs.
_DUMMY_HASH = "0" * 64


@dataclass(frozen=True)
class TenantContext:
    """Who is calling: what every domain service receives instead of the raw key."""

    tenant_id: str
    tenant_name: str
    api_key_id: str


def authenticate(session: Session, bearer_token: str | None) -> TenantContext:
    """Resolve a presented API key to its tenant. Raises Unauthenticated (one message for every failure)."""
    if not bearer_token:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    presented = hash_key(bearer_token)
    prefix = lookup_prefix(bearer_token)
    candidates = repository.active_keys_with_prefix(session, prefix) if prefix else []
    match: TenantContext | None = None
    for key, tenant in candidates:
        # Constant-time comparison of the hashes; the prefix only narrowed the candidates.
        if hmac.compare_digest(presented, key.key_hash):
            match = TenantContext(tenant_id=tenant.id, tenant_name=tenant.name, api_key_id=key.id)
    if not candidates:
        hmac.compare_digest(presented, _DUMMY_HASH)
    if match is None:
        raise Unauthenticated("invalid API key")
    return match


_bearer = HTTPBearer(auto_error=False, description="An API key from `grpo admin create-key`.")


def current_tenant(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> TenantContext:
    return authenticate(session, credentials.credentials if credentials else None)


CurrentTenant = Annotated[TenantContext, Depends(current_tenant)]
