"""Server-Sent Events for one job: the job's event rows, as they are written.

Every event row (state changes, per-step metrics, checkpoints, logs) becomes one SSE message whose
`id:` is the row id, so a client that reconnects with `Last-Event-ID` continues exactly after the
last message it saw. The stream polls the database (POLL_INTERVAL_S) with a short session per
poll, so an open stream holds no database connection while it waits, and it ends once the job is
in a terminal state and every event has been sent.

The stream outlives the request that authenticated it, so before every poll it checks the key again
(`still_authorized`, answered from the auth cache): once the key is revoked or expired, the stream sends an
`error` message (the error body, as REST renders it) and ends, within GRPO_AUTH_CACHE_SECONDS of the
revocation (plus one poll interval).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.concurrency import run_in_threadpool

from contract.api.jobs import EventOut
from contract.fields import INT64_MAX
from service.jobs import repository
from service.jobs.schemas import event_out
from service.jobs.states import TERMINAL, JobStatus
from service.kit.db import session_scope
from service.kit.errors import DomainError, Unauthenticated

POLL_INTERVAL_S = 0.5
HEARTBEAT_S = 15.0
BATCH = 500
RETRY_MS = 2000


def format_event(event: EventOut) -> bytes:
    payload = event.model_dump_json()
    return f"id: {event.id}\nevent: {event.type}\ndata: {payload}\n\n".encode()


def _poll(job_id: str, after_id: int | None) -> tuple[str | None, list[EventOut]]:
    # Status first, events second: a terminal status is committed together with its event, so when
    # the status read sees it, the events read (a later statement) sees the event too.
    with session_scope() as session:
        status = repository.job_status(session, job_id)
        rows = repository.list_events(session, job_id, after_id=after_id, limit=BATCH)
        return status, [event_out(row) for row in rows]


def format_error(error: DomainError) -> bytes:
    return f"event: error\ndata: {json.dumps(error.to_body())}\n\n".encode()


async def job_event_stream(
    job_id: str,
    last_event_id: int | None,
    is_disconnected: Callable[[], Awaitable[bool]],
    still_authorized: Callable[[], Awaitable[object]],
    *,
    poll_interval_s: float = POLL_INTERVAL_S,
) -> AsyncIterator[bytes]:
    """The SSE byte stream for `job_id` (whose ownership the caller has checked). `still_authorized` raises
    Unauthenticated once the caller's key no longer authenticates (service.tenants.auth.reauthenticate)."""
    yield f"retry: {RETRY_MS}\n\n".encode()
    last = last_event_id
    last_sent = time.monotonic()
    while True:
        try:
            await still_authorized()
        except Unauthenticated as error:
            yield format_error(error)
            return
        status, events = await run_in_threadpool(_poll, job_id, last)
        for event in events:
            yield format_event(event)
            last = event.id
            last_sent = time.monotonic()
        if len(events) == BATCH:
            continue  # more rows are waiting: no sleep
        if status is None or JobStatus(status) in TERMINAL:
            return
        if await is_disconnected():
            return
        if time.monotonic() - last_sent >= HEARTBEAT_S:
            yield b": keep-alive\n\n"  # a comment line: keeps proxies from closing an idle stream
            last_sent = time.monotonic()
        await asyncio.sleep(poll_interval_s)


def parse_last_event_id(value: str | None) -> int | None:
    """The event id to resume after, or None (from the first event) when `Last-Event-ID` is absent or is not
    one of our event ids (a decimal integer that fits BIGINT).

    Not an error: the header is whatever `id:` the client saw last, and an EventSource that gets a 4xx stops
    reconnecting for good, whereas starting over only repeats events the client can recognise by id.
    """
    if value is None or not value.isascii() or not value.isdecimal():
        return None
    parsed = int(value)
    return parsed if parsed <= INT64_MAX else None
