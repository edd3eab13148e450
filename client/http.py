"""How the clients send a `Call` and read its answer: the API's errors as APIError, which failures are retried
and how long to wait (Retry-After, else backoff), the base URL and key from the environment, and the event
stream's Server-Sent Events."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from tenacity import RetryCallState, wait_random_exponential

from client.calls import Call, T
from contract.api.jobs import EventOut

RETRY_STATUSES = {429, 502, 503, 504}


class APIError(Exception):
    """An error answer from the API, with its stable code (error shape: docs/jobs-api.md)."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details



class Retryable(Exception):
    """A retryable answer (see needs_retry): raised for tenacity, its response kept for the last try."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response



def raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        raise APIError(response.status_code, error["code"], error["message"], error.get("details"))
    except (ValueError, KeyError, TypeError):
        raise APIError(response.status_code, "http_error", response.text[:500]) from None


def parse_answer(call: Call[T], response: httpx.Response) -> T:
    raise_for_error(response)
    if call.model is None:
        return None  # type: ignore[return-value]
    return call.model.model_validate(response.json())


def retry_after_seconds(response: httpx.Response) -> float | None:
    """The response's Retry-After in seconds (delta-seconds or an HTTP date), or None."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def needs_retry(call: Call[Any], response: httpx.Response) -> bool:
    """Whether a retry of `call` may help and is safe: a retryable status of an idempotent call, or a rate limit
    (429 with Retry-After) of any call."""
    if response.status_code not in RETRY_STATUSES:
        return False
    return call.idempotent or (response.status_code == 429 and "Retry-After" in response.headers)


class RetryPolicy:
    """tenacity's retry predicate and wait for one call: Retry-After when the server sent one, else backoff."""

    def __init__(self, call: Call[Any], max_retry_after: float) -> None:
        self.call = call
        self.max_retry_after = max_retry_after
        self.backoff = wait_random_exponential(multiplier=0.5, max=8)

    def should_retry(self, exc: BaseException) -> bool:
        if isinstance(exc, Retryable):
            after = retry_after_seconds(exc.response)
            return after is None or after <= self.max_retry_after
        return self.call.idempotent and isinstance(exc, httpx.TransportError)

    def wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, Retryable) and (after := retry_after_seconds(exc.response)) is not None:
            return after
        return float(self.backoff(state))


def connection_settings(base_url: str | None, api_key: str | None) -> tuple[str, dict[str, str]]:
    url = base_url or os.environ.get("GRPO_API_URL", "http://127.0.0.1:8000")
    key = api_key or os.environ.get("GRPO_API_KEY")
    return url.rstrip("/"), ({"Authorization": f"Bearer {key}"} if key else {})


class SSEParser:
    """Incremental Server-Sent Events parser: feed lines, get an event at each blank line. An `error` message
    (the server ends the stream with one when the API key is revoked or expires) raises APIError."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._type = ""

    def feed(self, line: str) -> EventOut | None:
        if line.startswith("data:"):
            self._data.append(line[5:].strip())
        elif line.startswith("event:"):
            self._type = line[6:].strip()
        elif line == "" and self._data:
            body, kind = json.loads("\n".join(self._data)), self._type
            self._data, self._type = [], ""
            if kind == "error":
                error = body["error"]
                raise APIError(401 if error["code"] == "unauthenticated" else 400, error["code"], error["message"],
                               error.get("details"))
            return EventOut.model_validate(body)
        return None

