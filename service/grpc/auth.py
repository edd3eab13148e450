"""Who is calling: the bearer key from metadata, resolved with the same `authenticate_on_loop()` as REST.

The interceptor resolves the key once per call and binds the tenant to a ContextVar for the duration of
that call; servicers read it with `current_tenant()`. (grpc.aio runs each call's handler in its own task,
so the binding cannot leak between calls.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar

from service.tenants.auth import TenantContext, authenticate_on_loop

_TENANT: ContextVar[TenantContext | None] = ContextVar("grpo_grpc_tenant", default=None)


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The first value of a (lower-case) metadata key, or None."""
    for name, value in metadata or ():
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key of an `authorization: Bearer <key>` entry; None when absent or not a bearer credential."""
    header = metadata_value(metadata, "authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@asynccontextmanager
async def authenticated(token: str | None) -> AsyncIterator[TenantContext]:
    """Resolve `token` (raises Unauthenticated) and bind the tenant for the enclosed call."""
    tenant = await authenticate_on_loop(token)
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
