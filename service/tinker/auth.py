"""Who calls the Tinker door: the SDK sends the key as `X-API-Key` and refuses keys that do not start with
`tml-`. A tenant's API key works here written `tml-` + the key (`tml-grpo_sk_...`); scopes and rate limits are
those of the key, as on every route."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.kit.errors import Unauthenticated
from service.tenants.auth import TenantContext, authenticate_on_loop
from service.tenants.ratelimit import STATE_KEY, admit
from service.tenants.scopes import Scope, require_scope

TINKER_KEY_PREFIX = "tml-"


def presented_key(request: Request) -> str | None:
    value = request.headers.get("x-api-key")
    return value.removeprefix(TINKER_KEY_PREFIX) if value else None


class _TinkerTenant:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    async def __call__(self, request: Request) -> TenantContext:
        address = request.client.host if request.client else None
        key = presented_key(request)
        if not key:
            raise Unauthenticated("missing API key: send 'X-API-Key: tml-<key>' (TINKER_API_KEY)")
        tenant = await authenticate_on_loop(key, address)
        require_scope(tenant, self.scope)
        decision = await admit(tenant.api_key_id, "read" if self.scope == "read" else "write")
        if decision is not None:
            setattr(request.state, STATE_KEY, decision)
        return tenant


TinkerReader = Annotated[TenantContext, Depends(_TinkerTenant("read"))]
"""Polls and reads (retrieve_future, get_info, heartbeats, telemetry)."""
TinkerWriter = Annotated[TenantContext, Depends(_TinkerTenant("write"))]
"""Everything that creates, trains, samples or saves."""
