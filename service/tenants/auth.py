"""Bearer-key authentication: `authenticate()` for any transport, `CurrentTenant` for FastAPI routes."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.kit.config import get_settings
from service.kit.db import session_scope
from service.kit.errors import Unauthenticated
from service.tenants import repository
from service.tenants.keycache import KeyCache
from service.tenants.service import hash_key, lookup_prefix

# Compared against when no row matches, so a miss costs about what a hit costs.
_DUMMY_HASH = "0" * 64


@dataclass(frozen=True)
class TenantContext:
    """Who is calling: what every domain service receives instead of the raw key."""

    tenant_id: str
    tenant_name: str
    api_key_id: str


# Recently authenticated keys of this process (see keycache for the revocation delay this implies).
KEY_CACHE: KeyCache[TenantContext] = KeyCache()


def cached_tenant(bearer_token: str | None) -> TenantContext | None:
    """The tenant of a key this process authenticated within GRPO_AUTH_CACHE_SECONDS, else None."""
    if not bearer_token or get_settings().auth_cache_seconds <= 0:
        return None
    return KEY_CACHE.get(hash_key(bearer_token))


def authenticate(session: Session, bearer_token: str | None) -> TenantContext:
    """Resolve a presented API key to its tenant. Raises Unauthenticated (one message for every failure).

    Served from the in-process key cache when the key was authenticated moments ago; misses and failures
    always go to the database (failures are never cached).
    """
    if not bearer_token:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    if (cached := cached_tenant(bearer_token)) is not None:
        return cached
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
    KEY_CACHE.put(presented, match, get_settings().auth_cache_seconds)
    return match


def _authenticate_in_own_session(bearer_token: str | None) -> TenantContext:
    with session_scope() as session:
        return authenticate(session, bearer_token)


class _BearerTenant(HTTPBearer):
    """The HTTP bearer scheme, resolved to the caller's tenant in the same dependency.

    Subclassing HTTPBearer keeps OpenAPI's security scheme (FastAPI documents any HTTPBearer dependency) while
    routes resolve one dependency instead of a tenant dependency on top of HTTPBearer's: measured in-process
    on the polled `GET /v1/jobs/{id}`, each dependency level costs about a tenth of the request's CPU.
    Async so that a cached key costs no thread-pool hop; a miss authenticates in a short session of its own
    (the database work stays off the event loop).
    """

    async def __call__(self, request: Request) -> TenantContext:  # type: ignore[override]
        credentials = await super().__call__(request)
        token = credentials.credentials if credentials else None
        if (cached := cached_tenant(token)) is not None:
            return cached
        return await run_in_threadpool(_authenticate_in_own_session, token)


current_tenant = _BearerTenant(
    auto_error=False, scheme_name="HTTPBearer", description="An API key from `grpo admin create-key`."
)

CurrentTenant = Annotated[TenantContext, Depends(current_tenant)]
