"""One signed POST to the endpoint, classified: rewards, a retryable failure, or a final error."""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from standardwebhooks import Webhook

from outbound.rewards.errors import (
    RewardEndpointHTTPError,
    RewardEndpointInvalidResponse,
    RewardEndpointRefused,
)
from outbound.rewards.protocol import ResponseInvalid, parse_response
from outbound.signing import SigningKeys, sign_headers
from outbound.urlpolicy import UrlRejected

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_EXCERPT_BYTES = 300


class TransientFailure(Exception):
    """A failure worth retrying: connection error, timeout, 429 or 5xx gateway trouble."""

    def __init__(self, reason: str, *, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date); None if absent/unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


async def read_capped(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body, read as a stream; (body, truncated). Stops reading past the limit."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks)[:limit], True
    return b"".join(chunks), False


class EndpointCaller:
    """Sends one attempt of one request and turns every outcome into a value or a typed exception."""

    def __init__(
        self,
        *,
        source: str,
        url: str,
        signer: Webhook | SigningKeys,
        headers: dict[str, str],
        max_bytes: int,
        parse: Callable[..., list[float | None]] = parse_response,
    ) -> None:
        self.source = source
        self.parse = parse  # the answer's body -> rewards (ResponseInvalid when unusable)
        self.url = url
        self.signer = signer
        self.headers = headers
        self.max_bytes = max_bytes

    @property
    def where(self) -> str:
        """The endpoint as shown in errors: no query string (it may carry a token)."""
        return str(httpx.URL(self.url).copy_with(query=None, fragment=None))

    async def attempt(
        self, client: httpx.AsyncClient, *, msg_id: str, body: bytes, expected: int, budget_s: float
    ) -> list[float | None]:
        headers = {
            **self.headers,
            "content-type": "application/json",
            **sign_headers(self.signer, msg_id, body, now=datetime.now(tz=UTC)),
        }
        try:
            # httpx's timeouts are per operation; the budget bounds a server that drips bytes slowly.
            async with asyncio.timeout(budget_s):
                async with client.stream("POST", self.url, content=body, headers=headers) as response:
                    return await self._handle(response, expected)
        except TimeoutError as exc:
            raise TransientFailure(f"no complete answer within {budget_s:g} s") from exc
        except httpx.TimeoutException as exc:
            raise TransientFailure(f"timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise TransientFailure(f"connection failed ({type(exc).__name__}: {exc})") from exc
        except UrlRejected as exc:
            raise RewardEndpointRefused(self.source, f"{self.where}: {exc.message}") from exc

    async def _handle(self, response: httpx.Response, expected: int) -> list[float | None]:
        status = response.status_code
        if status in RETRY_STATUSES:
            retry_after = (
                parse_retry_after(response.headers.get("retry-after")) if status in (429, 503) else None
            )
            raise TransientFailure(f"HTTP {status}", retry_after=retry_after)
        if 300 <= status < 400:
            location = response.headers.get("location", "")
            raise RewardEndpointHTTPError(
                self.source,
                f"{self.where} answered HTTP {status} (redirect to {location!r}); redirects are not followed",
                status=status,
            )
        if not 200 <= status < 300:
            excerpt, _ = await read_capped(response, _EXCERPT_BYTES)
            raise RewardEndpointHTTPError(
                self.source,
                f"{self.where} answered HTTP {status}: {excerpt.decode('utf-8', 'replace')!r}",
                status=status,
            )
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._invalid(f"response of {declared} bytes exceeds the {self.max_bytes}-byte limit")
        body, truncated = await read_capped(response, self.max_bytes)
        if truncated:
            raise self._invalid(f"response exceeds the {self.max_bytes}-byte limit")
        try:
            return self.parse(body, expected=expected)
        except ResponseInvalid as exc:
            raise self._invalid(str(exc)) from exc

    def _invalid(self, what: str) -> RewardEndpointInvalidResponse:
        return RewardEndpointInvalidResponse(self.source, f"{self.where}: {what}")
