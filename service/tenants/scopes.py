"""What an API key may do: `read` (GET routes and read RPCs), `write` (everything that changes state or calls
out: create, delete, cancel, upload, rotate, test), `admin` (manage the tenant's API keys and quotas).

Scopes are independent (an `admin` key that should also submit jobs needs `write` too), so a key grants
exactly what it lists. `require_scope` is the one check; REST routes get it through their tenant dependency
(service.tenants.auth), RPCs through the table in service.grpc.scopes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, get_args

import grpc

from contract.api.api_keys import Scope
from service.kit.errors import DomainError, ValidationFailed

ALL_SCOPES: tuple[Scope, ...] = get_args(Scope)
# What a key gets when its creator names no scopes: everything but key management.
DEFAULT_SCOPES: tuple[Scope, ...] = ("read", "write")


class InsufficientScope(DomainError):
    code = "insufficient_scope"
    http_status = 403
    grpc_status = grpc.StatusCode.PERMISSION_DENIED


class _Scoped(Protocol):
    @property
    def scopes(self) -> frozenset[str]: ...


def require_scope(principal: _Scoped, scope: Scope) -> None:
    """Raise InsufficientScope (403 / PERMISSION_DENIED) unless the caller's key has `scope`."""
    if scope not in principal.scopes:
        raise InsufficientScope(
            f"this API key lacks the {scope!r} scope (it has: {', '.join(sorted(principal.scopes)) or 'none'})",
            details={"required_scope": scope, "key_scopes": sorted(principal.scopes)},
        )


def parse_scopes(stored: str) -> frozenset[str]:
    """The scopes of a stored key (space-separated)."""
    return frozenset(stored.split())


def normalize_scopes(scopes: Iterable[str], field: str = "scopes") -> str:
    """The stored form of requested scopes (sorted in ALL_SCOPES order, space-separated); ValidationFailed naming
    `field` for an unknown or missing scope."""
    wanted = list(scopes)
    for index, scope in enumerate(wanted):
        if scope not in ALL_SCOPES:
            raise ValidationFailed(
                f"{field}.{index}: unknown scope {scope!r} (one of {', '.join(ALL_SCOPES)})",
                details=[{"field": f"{field}.{index}", "message": f"unknown scope {scope!r}"}],
            )
    if not wanted:
        raise ValidationFailed(
            f"{field}: at least one scope is required", details=[{"field": field, "message": "empty"}]
        )
    return " ".join(scope for scope in ALL_SCOPES if scope in wanted)
