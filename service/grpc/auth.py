"""Who is calling: the bearer key from metadata, resolved with the same `authenticate_on_loop()` as REST.

The interceptor resolves the key once per call and binds the tenant to a ContextVar for the duration of
that call; servicers read it with `current_tenant()`. (grpc.aio runs each call's handler in its own task,
so the binding cannot leak between calls.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar

from service.tenants.auth import TenantContext, authenticate_on_loop, bearer_credentials
from service.tenants.ratelimit import admit
from service.tenants.scopes import InsufficientScope, Scope, require_scope

_TENANT: ContextVar[TenantContext | None] = ContextVar("grpo_grpc_tenant", default=None)


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The first value of a (lower-case) metadata key, or None."""
    for name, value in metadata or ():
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key of an `authorization: Bearer <key>` entry; None when absent or not a bearer credential."""
    return bearer_credentials(metadata_value(metadata, "authorization"))


def peer_address(peer: str | None) -> str | None:
    """The client's address from a gRPC peer string ("ipv4:10.0.0.7:5123" -> "10.0.0.7", "ipv6:[::1]:5123"
    -> "::1"); other kinds (unix sockets) as given."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


@asynccontextmanager
async def authenticated(
    token: str | None, address: str | None, scope: Scope | None
) -> AsyncIterator[TenantContext]:
    """Resolve `token` (raises Unauthenticated), check it has `scope` (raises InsufficientScope; None: the method
    declares no scope, refused whatever the key) and bind the tenant for the enclosed call."""
    tenant = await authenticate_on_loop(token, address)
    if scope is None:
        raise InsufficientScope("this method declares no scope (service.grpc.scopes), so no key may call it")
    require_scope(tenant, scope)
    await admit(tenant.api_key_id, "read" if scope == "read" else "write")
    binding = _TENANT.set(tenant)
    try:
        yield tenant
    finally:
        try:
            _TENANT.reset(binding)
        except ValueError:
            # A streaming call the client cancelled is finalised from another context; the call's own
            # context (one per call task) goes away with its task, so there is nothing left to undo.
            pass


def current_tenant() -> TenantContext:
    """The authenticated tenant of the current call (only inside a call that went through the interceptor)."""
    tenant = _TENANT.get()
    if tenant is None:
        raise RuntimeError("no authenticated tenant bound: is the AuthInterceptor installed?")
    return tenant
