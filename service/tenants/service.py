"""Tenants and API keys: creation (admin CLI, test factories) and key material.

A key is "grpo_sk_" + 43 url-safe characters (32 random bytes). Stored: the sha256 of the whole key
and the first PREFIX_LEN characters of the random part as a lookup index.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Protocol

import grpc
from sqlalchemy.orm import Session

from service.kit.config import get_settings
from service.kit.db import on_commit, utcnow
from service.kit.errors import Conflict, DomainError, NotFound, ValidationFailed
from service.kit.ids import new_id
from service.kit.paging import page
from service.tenants import repository
from service.tenants.auth import KEY_CACHE
from service.tenants.keys import KEY_PREFIX, hash_key, lookup_prefix
from service.tenants.models import ApiKey, Tenant
from service.tenants.scopes import ALL_SCOPES, InsufficientScope, normalize_scopes

_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def create_tenant(session: Session, name: str) -> Tenant:
    """A new tenant; names are unique. Raises ValidationFailed / Conflict."""
    if not _TENANT_NAME.match(name):
        raise ValidationFailed(
            "tenant name must be 1-128 characters of letters, digits, '_', '.', '-' (starting alphanumeric)",
            details=[{"field": "name"}],
        )
    if repository.get_tenant_by_name(session, name) is not None:
        raise Conflict(f"tenant {name!r} already exists")
    tenant = Tenant(id=new_id("ten"), name=name)
    repository.add(session, tenant)
    return tenant


def find_tenant(session: Session, name_or_id: str) -> Tenant:
    tenant = repository.get_tenant(session, name_or_id) or repository.get_tenant_by_name(session, name_or_id)
    if tenant is None:
        raise NotFound("tenant", name_or_id)
    return tenant


def create_api_key(
    session: Session,
    tenant: Tenant,
    *,
    scopes: Iterable[str] = ALL_SCOPES,
    name: str = "",
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """A new key for `tenant`: returns the row and the plaintext, which is never stored or shown again.

    The default scopes are all of them: what `grpo admin` makes (the server's shell is trusted with the
    tenant). Keys made over the API default to DEFAULT_SCOPES instead (service.tenants.keys)."""
    stored_scopes = normalize_scopes(scopes)
    token = KEY_PREFIX + secrets.token_urlsafe(32)
    prefix = lookup_prefix(token)
    assert prefix is not None  # our own format
    key = ApiKey(
        id=new_id("key"),
        tenant_id=tenant.id,
        prefix=prefix,
        key_hash=hash_key(token),
        name=name,
        scopes=stored_scopes,
        expires_at=expires_at,
    )
    repository.add(session, key)
    return key, token


class KeyHolder(Protocol):
    """The key making a request (service.tenants.auth.TenantContext): what a key it creates is bounded by."""

    @property
    def tenant_id(self) -> str: ...
    @property
    def scopes(self) -> frozenset[str]: ...
    @property
    def expires_at(self) -> datetime | None: ...


class TooManyApiKeys(DomainError):
    code = "too_many_api_keys"
    http_status = 409
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


def create_api_key_for(
    session: Session, parent: KeyHolder, *, name: str, scopes: Iterable[str], expires_at: datetime | None
) -> tuple[ApiKey, str]:
    """A key made over the API by `parent`, an admin key, for its own tenant. A key never outgrows the key that
    made it: it has no scope the parent lacks (InsufficientScope, 403) and expires no later than the parent
    (ValidationFailed naming `expires_at`; an expiring parent must name an expiry). The tenant may hold at most
    GRPO_MAX_API_KEYS_PER_TENANT active keys (TooManyApiKeys, 409)."""
    wanted = normalize_scopes(scopes).split()
    if not_held := [scope for scope in wanted if scope not in parent.scopes]:
        raise InsufficientScope(
            f"scopes: this API key cannot grant {', '.join(map(repr, not_held))}, which it lacks itself "
            f"(it has: {', '.join(sorted(parent.scopes)) or 'none'})",
            details={"field": "scopes", "not_held": not_held, "key_scopes": sorted(parent.scopes)},
        )
    now = utcnow()
    if expires_at is not None and expires_at <= now:
        raise ValidationFailed(
            "expires_at: must be in the future", details=[{"field": "expires_at", "message": "in the past"}]
        )
    if parent.expires_at is not None and (expires_at is None or expires_at > parent.expires_at):
        limit = parent.expires_at.isoformat()
        raise ValidationFailed(
            f"expires_at: this API key expires at {limit}, so a key it creates must expire no later "
            f"({'name an expires_at' if expires_at is None else 'asked for ' + expires_at.isoformat()})",
            details=[{"field": "expires_at", "message": f"must be no later than {limit}"}],
        )
    if not repository.lock_tenant(session, parent.tenant_id):  # concurrent creations cannot both take the last place
        raise NotFound("tenant", parent.tenant_id)
    tenant = repository.get_tenant(session, parent.tenant_id)
    if tenant is None:
        raise NotFound("tenant", parent.tenant_id)
    limit_keys = get_settings().max_api_keys_per_tenant
    if (active := repository.count_active_keys(session, tenant.id, now)) >= limit_keys:
        raise TooManyApiKeys(
            f"this tenant has {active} active API keys, the most GRPO_MAX_API_KEYS_PER_TENANT allows "
            f"({limit_keys}): revoke one first",
            details={"limit": limit_keys, "current": active, "setting": "GRPO_MAX_API_KEYS_PER_TENANT"},
        )
    return create_api_key(session, tenant, scopes=wanted, name=name, expires_at=expires_at)


def list_api_keys(session: Session, tenant_id: str, *, limit: int, after: str | None) -> tuple[Sequence[ApiKey], bool]:
    """The tenant's keys, revoked and expired ones included, newest first."""
    return page(repository.list_api_keys(session, tenant_id, limit=limit + 1, after=after), limit)


def revoke_api_key(session: Session, tenant_id: str, key_id: str) -> ApiKey:
    """Revoke one of a tenant's keys (idempotent). Raises NotFound for unknown or other tenants' keys.

    This process forgets the key as soon as the revocation commits; other processes refuse it once their
    cached entry expires (GRPO_AUTH_CACHE_SECONDS).
    """
    key = repository.get_api_key(session, tenant_id, key_id)
    if key is None:
        raise NotFound("api key", key_id)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    on_commit(session, lambda: KEY_CACHE.forget_key_id(key_id))
    return key
