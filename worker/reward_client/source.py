"""`EndpointRewardSource`: what every remote reward transport shares (HTTP webhooks, gRPC).

Per call (one training step): look up the cache, send each distinct uncached completion once, in batches of
at most `max_batch_size` that keep groups together, with up to `max_concurrency` requests in flight. Each
request is signed (Standard Webhooks), retried on transient failures with exponential backoff and full
jitter, and validated strictly. A circuit breaker turns an endpoint that stays down into
`RewardUnavailable`, which pauses the job instead of failing it.

A transport subclass supplies only the wire: how a batch is encoded into the exact bytes that are signed
(`_encode`), how one attempt is sent and classified (`_attempt`: rewards, `TransientFailure`, or a final
`RewardError`), and its per-event-loop connection (`_connect` / `_disconnect`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from worker.grpo.reward_types import RewardInput, RewardUnavailable
from worker.reward_client.batching import make_batches
from worker.reward_client.breaker import CircuitBreaker
from worker.reward_client.cache import RewardCache, cache_key
from worker.reward_client.config import RemoteRewardConfig
from worker.reward_client.endpoint import TransientFailure
from worker.reward_client.signing import new_message_id


@dataclass(frozen=True)
class RetryEvent:
    """Passed to `on_retry` before each backoff sleep; the worker records it as a job event."""

    source: str
    url: str
    message_id: str  # the webhook-id, stable across the attempts of one request
    attempt: int  # the attempt that failed, 1-based
    reason: str  # "HTTP 503", "timed out (ReadTimeout)", "gRPC UNAVAILABLE: ...", ...
    wait_s: float  # the sleep before the next attempt
    batch_size: int


OnRetry = Callable[[RetryEvent], Awaitable[None] | None]


@dataclass
class SourceStats:
    """Counters for metrics and tests."""

    requests: int = 0  # requests that got rewards back (attempts that succeeded)
    attempts: int = 0  # every request attempt started
    retries: int = 0
    items_sent: int = 0
    cache_hits: int = 0  # items answered from earlier steps
    deduplicated: int = 0  # items identical to another item of the same call


@dataclass
class Pending:
    """One distinct completion waiting to be sent."""

    key: bytes
    index: int  # position in the step's item list; doubles as the request item id
    item: RewardInput


ConnT = TypeVar("ConnT")  # the transport's connection object (an httpx client, a gRPC channel pool)


class EndpointRewardSource(ABC, Generic[ConnT]):
    """Implements `worker.grpo.reward_types.RewardSource` for one remote endpoint within one job."""

    # Whether the connection may be reused from another event loop (else it is rebuilt, see below).
    connection_survives_loops = False

    def __init__(self, config: RemoteRewardConfig, *, where: str, on_retry: OnRetry | None = None) -> None:
        self.config = config
        self.name = config.source_name
        self.where = where  # the endpoint as shown in errors and events (no query string)
        self.stats = SourceStats()
        self._on_retry = on_retry
        self._breaker = CircuitBreaker(
            threshold=config.breaker_threshold, reset_after_s=config.breaker_reset_s
        )
        self._cache = RewardCache(config.cache_max_entries)
        # The connection and the semaphore belong to one event loop; rebuilt if called from another.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: ConnT | None = None
        self._semaphore = asyncio.Semaphore(config.max_concurrency)

    # -- the transport's part ---------------------------------------------------------------------------

    @abstractmethod
    def _encode(self, batch: Sequence[Pending], step: int) -> bytes:
        """The request for `batch` as the exact bytes that are signed and sent."""

    @abstractmethod
    async def _attempt(
        self, conn: ConnT, *, msg_id: str, body: bytes, expected: int, budget_s: float
    ) -> list[float | None]:
        """One attempt: rewards, or TransientFailure (retried), or a RewardError (final)."""

    @abstractmethod
    def _connect(self) -> ConnT:
        """A new connection object for the running event loop."""

    @abstractmethod
    async def _disconnect(self, conn: ConnT) -> None:
        """Close a connection made by `_connect` (on its own loop)."""

    # -- the shared part --------------------------------------------------------------------------------

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> list[float | None]:
        results: list[float | None] = [None] * len(items)
        waiting: dict[bytes, list[int]] = {}  # cache key -> positions that take its reward
        to_send: list[Pending] = []
        for index, item in enumerate(items):
            key = cache_key(item.prompt, item.completion, item.extras)
            found, value = self._cache.get(key)
            if found:
                self.stats.cache_hits += 1
                results[index] = value
            elif key in waiting:
                self.stats.deduplicated += 1
                waiting[key].append(index)
            else:
                waiting[key] = [index]
                to_send.append(Pending(key, index, item))
        if not to_send:
            return results
        batches = make_batches(
            to_send, max_batch_size=self.config.max_batch_size, key=lambda p: p.item.group_id
        )
        answers = await self._send_all(batches, step)
        for batch, rewards in zip(batches, answers, strict=True):
            for pending, reward in zip(batch, rewards, strict=True):
                self._cache.put(pending.key, reward)
                for index in waiting[pending.key]:
                    results[index] = reward
        return results

    async def aclose(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await self._disconnect(conn)

    async def _send_all(self, batches: list[list[Pending]], step: int) -> list[list[float | None]]:
        """Send every batch concurrently (bounded); on the first error cancel the rest and raise it."""
        conn = self._conn_for_this_loop()
        tasks = [asyncio.ensure_future(self._send_batch(conn, batch, step)) for batch in batches]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _send_batch(self, conn: ConnT, batch: list[Pending], step: int) -> list[float | None]:
        body = self._encode(batch, step)
        async with self._semaphore:
            rewards = await self._call_with_retries(conn, body, expected=len(batch))
        self.stats.items_sent += len(batch)
        return rewards

    async def _call_with_retries(self, conn: ConnT, body: bytes, *, expected: int) -> list[float | None]:
        cfg = self.config
        if not self._breaker.allow():
            raise RewardUnavailable(
                self.name,
                f"{self.where}: circuit open after {self._breaker.consecutive_failures} consecutive "
                f"failed calls; not calling for {cfg.breaker_reset_s:g} s",
            )
        trial = self._breaker.is_open  # half-open: this call decides, with a single attempt
        msg_id = new_message_id()
        budget = cfg.connect_timeout_s + cfg.timeout_s
        retrying = AsyncRetrying(
            stop=stop_after_attempt(1 if trial else cfg.max_attempts),
            wait=self._wait,
            retry=retry_if_exception_type(TransientFailure),
            before_sleep=functools.partial(self._before_sleep, msg_id=msg_id, batch_size=expected),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1 and self._breaker.is_open and not trial:
                        # Another request of this step opened the circuit: stop hammering the endpoint.
                        raise RewardUnavailable(self.name, f"{self.where}: circuit opened by another request")
                    self.stats.attempts += 1
                    rewards = await self._attempt(
                        conn, msg_id=msg_id, body=body, expected=expected, budget_s=budget
                    )
        except TransientFailure as exc:
            self._breaker.record_failure()
            raise RewardUnavailable(
                self.name,
                f"{self.where}: {exc.reason} (gave up after {retrying.statistics['attempt_number']} attempts)",
            ) from exc
        except RewardUnavailable:
            self._breaker.record_failure()
            raise
        self._breaker.record_success()
        self.stats.requests += 1
        return rewards

    def _wait(self, state: RetryCallState) -> float:
        """The endpoint's requested delay when it sent one (if not too long), else full-jitter backoff."""
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, TransientFailure) and exc.retry_after is not None:
            if exc.retry_after > self.config.max_retry_after_s:
                raise RewardUnavailable(
                    self.name,
                    f"{self.where}: {exc.reason} asks to retry after {exc.retry_after:g} s "
                    f"(more than max_retry_after_s={self.config.max_retry_after_s:g})",
                )
            return exc.retry_after
        backoff = wait_random_exponential(
            multiplier=self.config.backoff_base_s, max=self.config.backoff_max_s
        )
        return float(backoff(state))

    async def _before_sleep(self, state: RetryCallState, *, msg_id: str, batch_size: int) -> None:
        self.stats.retries += 1
        exc = state.outcome.exception() if state.outcome else None
        if self._on_retry is None:
            return
        event = RetryEvent(
            source=self.name,
            url=self.where,
            message_id=msg_id,
            attempt=state.attempt_number,
            reason=exc.reason if isinstance(exc, TransientFailure) else repr(exc),
            wait_s=state.upcoming_sleep,
            batch_size=batch_size,
        )
        result = self._on_retry(event)
        if inspect.isawaitable(result):
            await result

    def _conn_for_this_loop(self) -> ConnT:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
            if not self.connection_survives_loops:
                # A loop-bound connection from a previous (closed) loop cannot be used or closed here.
                self._conn = None
        if self._conn is None:
            self._conn = self._connect()
        return self._conn
