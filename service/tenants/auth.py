"""Bearer-key authentication: `authenticate_on_loop()` for any transport, `CurrentTenant` for FastAPI routes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import weakref
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session

from service.kit.config import get_settings
from service.kit.db import session_scope, utcnow
from service.kit.errors import ServiceUnavailable, Unauthenticated
from service.kit.reads import unavailable_database_is_503
from service.tenants import repository
from service.tenants.failures import FailedLookups, TooManyAuthFailures
from service.tenants.keycache import KeyCache
from service.tenants.keys import hash_key, lookup_prefix
from service.tenants.lastused import LastUsed
from service.tenants.ratelimit import STATE_KEY, admit
from service.tenants.scopes import Scope, parse_scopes, require_scope

# Compared against when no row matches, so a miss costs about what a hit costs.
_DUMMY_HASH = "0" * 64
_MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantContext:
    """Who is calling: what every domain service receives instead of the raw key."""

    tenant_id: str
    tenant_name: str
    api_key_id: str
    # What the key may do (service.tenants.scopes).
    scopes: frozenset[str] = frozenset()
    expires_at: datetime | None = None


# Recently authenticated keys of this process (see keycache for the revocation delay this implies).
KEY_CACHE: KeyCache[TenantContext] = KeyCache()
# Recently refused keys and each address's budget of lookups of unknown keys (see failures).
FAILED_LOOKUPS = FailedLookups()
# When this process last wrote each key's last_used_at (see lastused).
LAST_USED = LastUsed()


def look_up_key(session: Session, bearer_token: str) -> TenantContext:
    """Resolve a presented API key to its tenant in the database (never the cache); a match is cached.
    Raises Unauthenticated, with one message for every kind of failure (failures are never cached)."""
    generation = KEY_CACHE.generation
    presented = hash_key(bearer_token)
    prefix = lookup_prefix(bearer_token)
    now = utcnow()
    candidates = repository.active_keys_with_prefix(session, prefix, now) if prefix else []
    match: TenantContext | None = None
    for key, tenant in candidates:
        # Constant-time comparison of the hashes; the prefix only narrowed the candidates.
        if hmac.compare_digest(presented, key.key_hash):
            match = TenantContext(
                tenant_id=tenant.id,
                tenant_name=tenant.name,
                api_key_id=key.id,
                scopes=parse_scopes(key.scopes),
                expires_at=key.expires_at,
            )
    if not candidates:
        hmac.compare_digest(presented, _DUMMY_HASH)
    if match is None:
        raise Unauthenticated("invalid API key")
    ttl = get_settings().auth_cache_seconds
    if match.expires_at is not None:  # an expiring key leaves the cache when it expires, not up to ttl later
        # Measured now, not from `now`: the query may have taken a while (a loaded database, a slow thread).
        ttl = min(ttl, (match.expires_at - utcnow()).total_seconds())
    KEY_CACHE.put(presented, match, ttl, generation)
    return match


def _look_up_in_own_session(bearer_token: str) -> TenantContext:
    with unavailable_database_is_503("API key lookup"), session_scope() as session:
        return look_up_key(session, bearer_token)


# --- on the event loop (REST and gRPC) ----------------------------------------------------------------

# A cached key is looked up again, in the background, once this fraction of its time is left.
REFRESH_WHEN_LEFT = 0.2

# Database lookups under way, per event loop and key hash: concurrent requests with one key share one.
_LOOKUPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Task[TenantContext]]] = (
    weakref.WeakKeyDictionary()
)


async def authenticate_on_loop(bearer_token: str | None, address: str | None = None) -> TenantContext:
    """The tenant of a presented API key (raises Unauthenticated). A key this process authenticated within
    GRPO_AUTH_CACHE_SECONDS answers from the cache without leaving the event loop; otherwise the database
    lookup runs on a thread, one per key at a time.

    Why: every key's cache entry expires after GRPO_AUTH_CACHE_SECONDS. With each request looking the key up
    on its own, a busy client's requests in the milliseconds after expiry would all queue a lookup, and
    those lookups set the p99 latency. So concurrent misses of one key await one lookup, and a key in use is
    looked up again in the background shortly before its entry expires, while the entry still answers; the
    entry itself still expires on time, so a revocation made elsewhere is honoured within the setting.

    A key not in that cache is refused without a query when the database refused it within
    GRPO_AUTH_NEGATIVE_CACHE_SECONDS, and `address` (the client's) may fail at most
    GRPO_AUTH_LOOKUPS_PER_MINUTE lookups a minute (beyond, unknown keys get 429 while valid keys still
    authenticate): see `_bounded_lookup` and `service.tenants.failures`.
    """
    return await _authenticate(bearer_token, address or "")


async def reauthenticate(bearer_token: str | None) -> TenantContext:
    """For a response that outlives its request (an SSE stream, gRPC WatchJob): the key's tenant again, or
    Unauthenticated once the key is revoked or has expired. Answers like any request, from the cache while the
    key's entry lasts, so a key revoked by another process is refused within GRPO_AUTH_CACHE_SECONDS (at once
    by the process that revoked it, or by one whose entry has expired); it spends no failed-lookup budget."""
    return await _authenticate(bearer_token, None)


async def _authenticate(bearer_token: str | None, address: str | None) -> TenantContext:
    if not bearer_token:
        raise Unauthenticated(_MISSING_KEY)
    ttl = get_settings().auth_cache_seconds
    key_hash = hash_key(bearer_token)
    if ttl <= 0:
        tenant = await _bounded_lookup(bearer_token, key_hash, address)
    elif (cached := KEY_CACHE.lookup(key_hash)) is not None:
        tenant, seconds_left = cached
        if seconds_left < REFRESH_WHEN_LEFT * ttl:
            _shared_lookup(bearer_token, key_hash, None)  # in the background: this request is answered now
    else:
        # Shielded: a caller that goes away (client disconnect) must not cancel the others' lookup.
        tenant = await asyncio.shield(_shared_lookup(bearer_token, key_hash, address))
    LAST_USED.touch(tenant.api_key_id)
    return tenant


async def _bounded_lookup(bearer_token: str, key_hash: str, address: str | None) -> TenantContext:
    """The database lookup behind the failed-lookup bounds; `address` None (a background refresh of a key
    that was valid moments ago, a stream re-checking its key) spends no budget.

    A lookup holds one of the address's tokens while it runs and gives it back unless the key is refused, so
    only failures spend the budget. An address with no token left is not refused outright (a valid key from
    behind the same NAT or proxy as an attacker must still work): its lookups take turns in one lane per
    process (THROTTLED_LOOKUPS_AT_ONCE), and a key refused there answers 429 instead of 401."""
    settings = get_settings()
    if FAILED_LOOKUPS.refused(key_hash):
        raise Unauthenticated("invalid API key")
    if lookup_prefix(bearer_token) is None:
        address = None  # not shaped like a key: refused without a query, so it spends no budget
    per_minute = settings.auth_lookups_per_minute
    holds_token = address is not None and FAILED_LOOKUPS.acquire(address, per_minute)
    throttled = address is not None and not holds_token
    try:
        if throttled:
            async with _throttled_lane():
                tenant = await asyncio.to_thread(_look_up_in_own_session, bearer_token)
        else:
            tenant = await asyncio.to_thread(_look_up_in_own_session, bearer_token)
    except Unauthenticated:
        FAILED_LOOKUPS.remember_refused(key_hash, settings.auth_negative_cache_seconds)
        if throttled:
            assert address is not None
            wait = FAILED_LOOKUPS.seconds_until_token(address, per_minute)
            raise TooManyAuthFailures(
                f"too many failed API key lookups from this address (limit {per_minute} failures per minute); "
                f"retry in {wait:.1f} s",
                details={"limit_per_minute": per_minute, "retry_after_s": round(wait, 1)},
            ) from None
        raise  # the token stays spent
    except BaseException:
        if holds_token:
            assert address is not None
            FAILED_LOOKUPS.release(address, per_minute)
        raise
    if holds_token:
        assert address is not None
        FAILED_LOOKUPS.release(address, per_minute)
    return tenant


# Lookups from addresses over their failure budget, at once per event loop: an attacker's flood of unknown
# keys then occupies one database query and one thread at a time, however many requests it sends.
THROTTLED_LOOKUPS_AT_ONCE = 1
_THROTTLED_LANES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _throttled_lane() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    lane = _THROTTLED_LANES.get(loop)
    if lane is None:
        lane = _THROTTLED_LANES[loop] = asyncio.Semaphore(THROTTLED_LOOKUPS_AT_ONCE)
    return lane


def _shared_lookup(bearer_token: str, key_hash: str, address: str | None) -> asyncio.Task[TenantContext]:
    loop = asyncio.get_running_loop()
    under_way = _LOOKUPS.setdefault(loop, {})
    if (task := under_way.get(key_hash)) is not None:
        return task
    task = loop.create_task(_bounded_lookup(bearer_token, key_hash, address))
    under_way[key_hash] = task
    task.add_done_callback(partial(_lookup_done, under_way, key_hash))
    return task


def _lookup_done(under_way: dict[str, asyncio.Task[TenantContext]], key_hash: str, task: asyncio.Task[Any]) -> None:
    under_way.pop(key_hash, None)
    if task.cancelled():
        return
    error = task.exception()  # retrieved here too, so a background refresh's failure is never left unread
    if isinstance(error, Unauthenticated):
        KEY_CACHE.forget(key_hash)  # revoked since it was cached: refuse it now, not at expiry
    elif error is not None and not isinstance(error, ServiceUnavailable | TooManyAuthFailures):  # expected / logged
        log.warning("API key lookup failed: %r", error)


class _BearerTenant(HTTPBearer):
    """The HTTP bearer scheme, resolved to the caller's tenant in the same dependency.

    Subclassing HTTPBearer keeps OpenAPI's security scheme (FastAPI documents any HTTPBearer dependency) while
    routes resolve one dependency instead of a tenant dependency on top of HTTPBearer's: on the polled
    `GET /v1/jobs/{id}`, each dependency level costs about a tenth of the request's CPU.
    Async so that a cached key costs no thread-pool hop (see `authenticate_on_loop`).
    """

    def __init__(self, scope: Scope | None) -> None:
        super().__init__(
            auto_error=False, scheme_name="HTTPBearer", description="An API key (`grpo admin create-key`, "
            "POST /v1/api-keys) with the scope the route needs: `read` for GET, `write` for other methods, "
            "`admin` for key management."
        )
        self.scope = scope

    async def __call__(self, request: Request) -> TenantContext:  # type: ignore[override]
        credentials = await super().__call__(request)
        address = request.client.host if request.client else None
        tenant = await authenticate_on_loop(credentials.credentials if credentials else None, address)
        scope = self.scope or scope_of_method(request.method)
        require_scope(tenant, scope)
        decision = await admit(tenant.api_key_id, "read" if scope == "read" else "write")
        if decision is not None:
            setattr(request.state, STATE_KEY, decision)  # for the RateLimit-* headers (RateLimitHeaders)
        return tenant


def bearer_credentials(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value (HTTP header or gRPC metadata); None when absent or not
    a bearer credential."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def scope_of_method(method: str) -> Scope:
    """The scope a route needs unless it names one: GET/HEAD read, every other method changes something."""
    return "read" if method in ("GET", "HEAD") else "write"


CurrentTenant = Annotated[TenantContext, Depends(_BearerTenant(scope=None))]
"""The caller, with the scope its HTTP method implies (`scope_of_method`): what every route uses by default."""
ReadTenant = Annotated[TenantContext, Depends(_BearerTenant(scope="read"))]
"""For a route that only reads whatever its method (e.g. a POST that computes an estimate)."""
AdminTenant = Annotated[TenantContext, Depends(_BearerTenant(scope="admin"))]
"""For routes that manage the tenant itself (API keys, quotas)."""
