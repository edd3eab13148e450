"""Typed domain errors. One class per failure; REST and gRPC render them in one place each."""

from __future__ import annotations

from typing import Any

import grpc


class DomainError(Exception):
    """Base of every expected failure. `code` is stable and documented; never a 500."""

    code: str = "error"
    http_status: int = 400
    grpc_status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}

    def http_headers(self) -> dict[str, str]:
        """Headers the REST error response carries besides its body (e.g. Retry-After)."""
        return {}

    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata the gRPC status carries besides the error code, field and details."""
        return ()


class NotFound(DomainError):
    code = "not_found"
    http_status = 404
    grpc_status = grpc.StatusCode.NOT_FOUND

    def __init__(self, kind: str, ident: str) -> None:
        # Identical for "does not exist" and "belongs to another tenant": no existence oracle.
        super().__init__(f"{kind} {ident!r} not found")


class ValidationFailed(DomainError):
    code = "validation_error"
    http_status = 422
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT


class UrlNotAllowed(ValidationFailed):
    """A URL the SSRF policy refuses at registration (the policy's own `outbound.urlpolicy.UrlRejected`)."""

    code = "url_rejected"


class Unauthenticated(DomainError):
    code = "unauthenticated"
    http_status = 401
    grpc_status = grpc.StatusCode.UNAUTHENTICATED


class Conflict(DomainError):
    code = "conflict"
    http_status = 409
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class IllegalTransition(Conflict):
    code = "illegal_transition"


class IdempotencyMismatch(DomainError):
    code = "idempotency_key_reused"
    http_status = 422
    grpc_status = grpc.StatusCode.ALREADY_EXISTS


class IdempotencyInFlight(DomainError):
    code = "idempotency_key_in_flight"
    http_status = 409
    grpc_status = grpc.StatusCode.ABORTED


class PayloadTooLarge(DomainError):
    code = "payload_too_large"
    http_status = 413
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED


class ServiceUnavailable(DomainError):
    code = "service_unavailable"
    http_status = 503
    grpc_status = grpc.StatusCode.UNAVAILABLE
