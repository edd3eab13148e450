"""Is this URL an OpenEnv environment server? `GET /health` and `GET /schema`, signed and SSRF-checked.

OpenEnv (PyPI `openenv`) serves a FastAPI app: `/health` answers `{"status": "healthy"}`, `/schema` the JSON
schemas of its action, observation and state. Episodes run over `WS /ws` (the engine's client); these two reads
are all registration and the health check need. Every request goes through the pinned-resolution transport
(the SSRF policy on each connection), carries the Standard Webhooks headers over an empty body and follows no
redirect: a 3xx is an answer to report, never a second destination to trust.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from pydantic import BaseModel, Field, ValidationError

from outbound.signing import SigningKeys, new_message_id, sign_headers
from outbound.transport import PinnedResolutionTransport
from outbound.urlpolicy import Resolver, UrlRejected

# /schema of a real environment is a few KiB; anything past this is not one we can use.
MAX_PROBE_BYTES = 1 << 20
HEALTHY = "healthy"


class EnvironmentSchemas(BaseModel):
    """What `/schema` publishes (OpenEnv's SchemaResponse); reset_observation is optional there."""

    action: dict[str, Any]
    observation: dict[str, Any]
    state: dict[str, Any] = Field(default_factory=dict)


class ProbeResult(BaseModel):
    status: str
    schemas: EnvironmentSchemas
    latency_ms: float


class EnvironmentUnavailable(Exception):
    """No usable answer at the transport level (refused, timeout, 5xx): a retry may help."""


class EnvironmentInvalid(Exception):
    """An answer that is not an OpenEnv server's (4xx, a redirect, not JSON, wrong shape, too large)."""


def _base(url: str) -> str:
    return url.rstrip("/")


async def _get_json(client: httpx.AsyncClient, url: str, keys: SigningKeys, headers: dict[str, str]) -> Any:
    signed = {**headers, **sign_headers(keys, new_message_id(), b"")}
    try:
        async with client.stream("GET", url, headers=signed) as response:
            if response.status_code >= 500:
                raise EnvironmentUnavailable(f"GET {url} answered HTTP {response.status_code}")
            if response.status_code != 200:
                where = f" (to {response.headers.get('location')!r})" if response.is_redirect else ""
                raise EnvironmentInvalid(f"GET {url} answered HTTP {response.status_code}{where}, not 200")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_PROBE_BYTES:
                    raise EnvironmentInvalid(f"GET {url}: the answer is larger than {MAX_PROBE_BYTES} bytes")
    except (httpx.TimeoutException, httpx.TransportError) as exc:
        raise EnvironmentUnavailable(f"GET {url}: {type(exc).__name__}: {exc or 'no answer'}") from exc
    try:
        return json.loads(bytes(body))
    except ValueError as exc:
        raise EnvironmentInvalid(f"GET {url}: the answer is not JSON") from exc


async def probe(
    url: str,
    *,
    keys: SigningKeys,
    headers: dict[str, str],
    timeout_s: float,
    allow_private: bool,
    resolver: Resolver | None = None,
) -> ProbeResult:
    """Read `/health` then `/schema` of the server at `url`. Raises EnvironmentUnavailable, EnvironmentInvalid,
    or UrlRejected (the policy refused an address the name resolves to)."""
    transport = PinnedResolutionTransport(allow_private=allow_private, resolver=resolver)
    started = time.perf_counter()
    async with httpx.AsyncClient(transport=transport, timeout=timeout_s, follow_redirects=False) as client:
        health = await _get_json(client, f"{_base(url)}/health", keys, headers)
        status = health.get("status") if isinstance(health, dict) else None
        if not isinstance(status, str):
            raise EnvironmentInvalid(f"GET {_base(url)}/health: no 'status' in the answer (not an OpenEnv server?)")
        if status != HEALTHY:
            raise EnvironmentUnavailable(f"GET {_base(url)}/health: status {status!r}, not {HEALTHY!r}")
        raw = await _get_json(client, f"{_base(url)}/schema", keys, headers)
    try:
        schemas = EnvironmentSchemas.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise EnvironmentInvalid(f"GET {_base(url)}/schema: {where}: {error['msg']}") from exc
    return ProbeResult(status=status, schemas=schemas, latency_ms=round((time.perf_counter() - started) * 1000, 3))


__all__ = ["EnvironmentInvalid", "EnvironmentSchemas", "EnvironmentUnavailable", "ProbeResult", "UrlRejected", "probe"]
