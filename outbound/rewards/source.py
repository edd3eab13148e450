"""`EndpointRewardSource`: what every remote reward transport shares (HTTP webhooks, gRPC).

Per call (one training step): look up the cache, send each distinct uncached completion once, in batches of
at most `max_batch_size` that keep groups together, with up to `max_concurrency` requests in flight. Each
request is signed (Standard Webhooks), retried on transient failures with exponential backoff and full
jitter, and validated strictly.

Failure policy (all limits per reward function, see `RemoteRewardConfig`):

- a request that exhausts its `max_attempts` counts as one failed call for the circuit breaker; after
  `breaker_threshold` consecutive failed calls the endpoint is down: `RewardUnavailable`, which pauses the job;
- while the breaker stays closed the endpoint is alive (merely flaky): the request is sent again (same
  webhook-id, after a backoff) until the step's `step_deadline_s` has passed;
- a request still unanswered at the deadline abstains for its items (`None`) and the step goes on, reported
  through `on_degraded`, unless more than `max_abstain_fraction` of the step's items would abstain: that is
  `RewardUnavailable` too.

A transport subclass supplies only the wire: how a batch is encoded into the exact bytes that are signed
(`_encode`), how one attempt is sent and classified (`_attempt`: rewards, `TransientFailure`, or a final
`RewardError`), and its per-event-loop connection (`_connect` / `_disconnect`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_any,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from contract.reward_types import RewardInput, RewardUnavailable
from outbound.rewards.batching import make_batches
from outbound.rewards.breaker import CircuitBreaker
from outbound.rewards.cache import RewardCache, cache_key
from outbound.rewards.config import RemoteRewardConfig
from outbound.rewards.endpoint import TransientFailure
from outbound.signing import new_message_id


@dataclass(frozen=True)
class RetryEvent:
    """Passed to `on_retry` before each backoff sleep; the worker records it as a job event."""

    source: str
    url: str
    message_id: str  # the webhook-id, stable across the attempts of one request
    attempt: int  # the attempt that failed, 1-based, counted over the request's resends
    reason: str  # "HTTP 503", "timed out (ReadTimeout)", "gRPC UNAVAILABLE: ...", ...
    wait_s: float  # the sleep before the next attempt
    batch_size: int


OnRetry = Callable[[RetryEvent], Awaitable[None] | None]


@dataclass(frozen=True)
class DegradedEvent:
    """Passed to `on_degraded` when some items of a step abstain because the deadline passed."""

    source: str
    url: str
    step: int
    abstained: int  # items scored None because their request never succeeded in time
    items: int  # items of the step
    reason: str  # the last failure of the abandoned requests


OnDegraded = Callable[[DegradedEvent], Awaitable[None] | None]


class stop_when(stop_base):  # noqa: N801  (named like tenacity's own stop conditions)
    """Stop retrying once `condition()` holds (here: the step deadline has passed)."""

    def __init__(self, condition: Callable[[], bool]) -> None:
        self._condition = condition

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._condition()


class _GaveUp(Exception):
    """A request exhausted its attempts while the breaker stayed closed: the endpoint is flaky, not down."""

    def __init__(self, reason: str, attempts: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts


@dataclass
class SourceStats:
    """Counters for metrics and tests."""

    requests: int = 0  # requests that got rewards back (attempts that succeeded)
    attempts: int = 0  # every request attempt started
    retries: int = 0
    resends: int = 0  # requests sent again after exhausting their attempts (breaker still closed)
    abstained: int = 0  # items left unscored at a step deadline
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
    """Implements `contract.reward_types.RewardSource` for one remote endpoint within one job."""

    # Whether the connection may be reused from another event loop (else it is rebuilt, see below).
    connection_survives_loops = False

    def __init__(
        self,
        config: RemoteRewardConfig,
        *,
        where: str,
        on_retry: OnRetry | None = None,
        on_degraded: OnDegraded | None = None,
    ) -> None:
        self.config = config
        self.name = config.source_name
        self.where = where  # the endpoint as shown in errors and events (no query string)
        self.stats = SourceStats()
        self._on_retry = on_retry
        self._on_degraded = on_degraded
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
        answers = await self._send_all(batches, step, step_items=len(items))
        for batch, rewards in zip(batches, answers, strict=True):
            for position, pending in enumerate(batch):
                reward = rewards[position] if rewards is not None else None
                if rewards is not None:  # an abstention forced by the deadline is not the endpoint's answer
                    self._cache.put(pending.key, reward)
                for index in waiting[pending.key]:
                    results[index] = reward
        return results

    async def aclose(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await self._disconnect(conn)

    async def _send_all(
        self, batches: list[list[Pending]], step: int, *, step_items: int
    ) -> list[list[float | None] | None]:
        """Rewards per batch (None: abandoned at the step deadline); on a final error cancel the rest, raise it."""
        conn = self._conn_for_this_loop()
        deadline = asyncio.get_running_loop().time() + self.config.step_deadline_s
        tasks = [asyncio.ensure_future(self._send_batch(conn, batch, step, deadline)) for batch in batches]
        try:
            outcomes = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        gave_up = [(batch, outcome) for batch, outcome in zip(batches, outcomes, strict=True)
                   if isinstance(outcome, _GaveUp)]
        if gave_up:
            await self._abstain(gave_up, step, step_items)
        return [None if isinstance(outcome, _GaveUp) else outcome for outcome in outcomes]

    async def _abstain(self, gave_up: list[tuple[list[Pending], _GaveUp]], step: int, step_items: int) -> None:
        """Let the items of abandoned requests abstain, within the per-step limit, and report it."""
        abstained = sum(len(batch) for batch, _ in gave_up)
        reason = gave_up[-1][1].reason
        limit = int(self.config.max_abstain_fraction * step_items)
        if abstained > limit:
            raise RewardUnavailable(
                self.name,
                f"{self.where}: {abstained} of {step_items} items still unscored after the "
                f"{self.config.step_deadline_s:g} s step deadline ({reason}); more than "
                f"max_abstain_fraction={self.config.max_abstain_fraction:g} allows",
            )
        self.stats.abstained += abstained
        if self._on_degraded is not None:
            event = DegradedEvent(self.name, self.where, step, abstained, step_items, reason)
            result = self._on_degraded(event)
            if inspect.isawaitable(result):
                await result

    async def _send_batch(
        self, conn: ConnT, batch: list[Pending], step: int, deadline: float
    ) -> list[float | None] | _GaveUp:
        """The batch's rewards; the request is sent again while the breaker stays closed, until `deadline`."""
        body = self._encode(batch, step)
        msg_id = new_message_id()  # one webhook-id for every attempt and resend: the same request
        loop = asyncio.get_running_loop()
        attempts = 0  # over every send of this request, so retry events number them in order
        resends = 0
        while True:
            try:
                async with self._semaphore:
                    rewards = await self._call_with_retries(
                        conn, body, msg_id=msg_id, expected=len(batch), deadline=deadline, attempts_before=attempts
                    )
            except _GaveUp as exc:
                attempts += exc.attempts
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return exc
                resends += 1
                self.stats.resends += 1
                backoff = min(self.config.backoff_base_s * 2 ** min(resends, 10), self.config.backoff_max_s)
                wait = min(remaining, random.uniform(0, backoff))
                await self._notify_retry(RetryEvent(
                    self.name, self.where, msg_id, attempts, f"{exc.reason}; circuit closed, sending again",
                    wait, len(batch),
                ))
                await asyncio.sleep(wait)
                continue
            self.stats.items_sent += len(batch)
            return rewards

    async def _call_with_retries(
        self, conn: ConnT, body: bytes, *, msg_id: str, expected: int, deadline: float, attempts_before: int
    ) -> list[float | None]:
        """One request with its attempts. Raises _GaveUp (flaky) or RewardUnavailable (down), or a RewardError."""
        cfg = self.config
        if not self._breaker.allow():
            raise RewardUnavailable(
                self.name,
                f"{self.where}: circuit open after {self._breaker.consecutive_failures} consecutive "
                f"failed calls; not calling for {cfg.breaker_reset_s:g} s",
            )
        trial = self._breaker.is_open  # half-open: this call decides, with a single attempt
        budget = cfg.connect_timeout_s + cfg.timeout_s
        loop = asyncio.get_running_loop()
        retrying = AsyncRetrying(
            # No new attempt once the step deadline has passed: the caller decides what happens next.
            stop=stop_any(stop_after_attempt(1 if trial else cfg.max_attempts), stop_when(lambda: loop.time() >= deadline)),
            wait=self._wait,
            retry=retry_if_exception_type(TransientFailure),
            before_sleep=functools.partial(
                self._before_sleep, msg_id=msg_id, batch_size=expected, attempts_before=attempts_before
            ),
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
            made = retrying.statistics["attempt_number"]
            reason = f"{exc.reason} (gave up after {made} attempts)"
            if self._breaker.is_open:
                raise RewardUnavailable(
                    self.name,
                    f"{self.where}: {reason}; circuit open after {self._breaker.consecutive_failures} "
                    f"consecutive failed calls",
                ) from exc
            raise _GaveUp(reason, made) from exc
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

    async def _before_sleep(
        self, state: RetryCallState, *, msg_id: str, batch_size: int, attempts_before: int
    ) -> None:
        self.stats.retries += 1
        exc = state.outcome.exception() if state.outcome else None
        await self._notify_retry(RetryEvent(
            source=self.name,
            url=self.where,
            message_id=msg_id,
            attempt=attempts_before + state.attempt_number,
            reason=exc.reason if isinstance(exc, TransientFailure) else repr(exc),
            wait_s=state.upcoming_sleep,
            batch_size=batch_size,
        ))

    async def _notify_retry(self, event: RetryEvent) -> None:
        if self._on_retry is None:
            return
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
