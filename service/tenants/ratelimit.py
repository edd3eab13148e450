"""Per-key rate limits: a token bucket per API key and class of request (reads, writes).

Each key may make `GRPO_RATE_LIMIT_READS` reads and `GRPO_RATE_LIMIT_WRITES` writes per
`GRPO_RATE_LIMIT_WINDOW_SECONDS`: a bucket holds that many tokens, refilled continuously at limit/window
per second, and each request takes one. A request that finds none is refused with 429 `rate_limited` (gRPC
RESOURCE_EXHAUSTED) before it runs, so retrying it is always safe; `Retry-After` says when a token will be
there. Reads are GET/HEAD routes and the `read`-scoped RPCs; everything else is a write.

Where the buckets live:
- Redis (`RedisBuckets`) when the API runs with a Redis (GRPO_RATE_LIMIT_REDIS_URL, or the broker's Redis):
  every API process and the gRPC server share one budget per key. One Lua script refills and takes
  atomically on the Redis clock; see the class for how the round trips are kept off most requests.
  If Redis cannot be reached the request is let through (logged): limits protect the service, they must
  not take it down with them.
- in-process (`MemoryBuckets`) otherwise (the embedded mode): the budget is per process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.kit.config import Settings, get_settings
from service.kit.errors import DomainError

log = logging.getLogger(__name__)

RequestClass = Literal["read", "write"]
MAX_ENTRIES = 100_000
REDIS_PREFIX = "grpo:ratelimit:"


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one take, and what the RateLimit-* headers report."""

    allowed: bool
    limit: int
    remaining: int  # whole tokens left after this request
    reset_s: float  # until the bucket is full again
    retry_after_s: float  # until the next token (0 when allowed)
    window_s: float

    def headers(self) -> dict[str, str]:
        """RateLimit-Limit / -Remaining / -Reset (draft-ietf-httpapi-ratelimit-headers), whole seconds."""
        return {
            "RateLimit-Limit": str(self.limit),
            "RateLimit-Remaining": str(self.remaining),
            "RateLimit-Reset": str(math.ceil(self.reset_s)),
        }


def decide(tokens: float, granted: bool, limit: int, window_s: float) -> Decision:
    """The decision for a bucket left with `tokens` (after the take, when granted)."""
    rate = limit / window_s
    return Decision(
        allowed=granted,
        limit=limit,
        remaining=max(0, math.floor(tokens)),
        reset_s=max(0.0, (limit - tokens) / rate),
        retry_after_s=0.0 if granted else max(0.0, (1 - tokens) / rate),
        window_s=window_s,
    )


class RateLimited(DomainError):
    code = "rate_limited"
    http_status = 429
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, decision: Decision, request_class: RequestClass) -> None:
        self.decision = decision
        self.retry_after = max(1, math.ceil(decision.retry_after_s))  # HTTP's Retry-After is whole seconds
        super().__init__(
            f"rate limit of this API key reached: {decision.limit} {request_class}s per "
            f"{decision.window_s:g} s; retry in {self.retry_after} s",
            details={
                "class": request_class,
                "limit": decision.limit,
                "window_s": decision.window_s,
                "retry_after_s": round(decision.retry_after_s, 3),
            },
        )

    def http_headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after), **self.decision.headers()}

    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        return (
            ("retry-after", str(self.retry_after)),
            ("grpo-retry-after-ms", str(math.ceil(self.decision.retry_after_s * 1000))),
            *((name.lower(), value) for name, value in self.decision.headers().items()),
        )


class Buckets(Protocol):
    async def take(self, bucket: str, limit: int, window_s: float) -> Decision: ...

    async def close(self) -> None: ...


class MemoryBuckets:
    """This process's buckets; thread-safe, bounded by evicting the least recently used."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # bucket -> (tokens, at)
        self._lock = threading.Lock()
        self._max_entries = max_entries

    def take_now(self, bucket: str, limit: int, window_s: float) -> Decision:
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.pop(bucket, (float(limit), now))
            tokens = min(float(limit), tokens + (now - at) * limit / window_s)
            granted = tokens >= 1
            if granted:
                tokens -= 1
            self._buckets[bucket] = (tokens, now)
            if len(self._buckets) > self._max_entries:
                self._buckets.popitem(last=False)
        return decide(tokens, granted, limit, window_s)

    async def take(self, bucket: str, limit: int, window_s: float) -> Decision:
        return self.take_now(bucket, limit, window_s)

    async def close(self) -> None:
        with self._lock:
            self._buckets.clear()


# KEYS: the buckets; ARGV: per bucket (capacity, tokens per second, tokens wanted, tokens given back). Returns per
# bucket the tokens granted (at most those wanted) and the tokens left, as a string (Lua numbers become integers).
_TAKE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[4 * i - 3])
  local rate = tonumber(ARGV[4 * i - 2])
  local wanted = tonumber(ARGV[4 * i - 1])
  local refund = tonumber(ARGV[4 * i])
  local state = redis.call('HMGET', key, 'tokens', 'at')
  local tokens = tonumber(state[1]) or cap
  local at = tonumber(state[2]) or now
  tokens = math.min(cap, tokens + refund + math.max(0, now - at) * rate)
  local granted = math.min(wanted, math.floor(tokens))
  tokens = tokens - granted
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - tokens) / rate * 1000) + 1000)
  out[2 * i - 1] = granted
  out[2 * i] = tostring(tokens)
end
return out
"""

# A process takes tokens from Redis for up to this share of a budget at once, and keeps them this long.
LEASE_SHARE = 0.01
LEASE_MAX = 100
LEASE_SECONDS = 1.0


def lease_size(limit: int) -> int:
    """Tokens fetched per Redis call for a bucket of `limit`: 1 (every request asks Redis) below 200."""
    return max(1, min(LEASE_MAX, int(limit * LEASE_SHARE)))


@dataclass
class _Lease:
    """Tokens this process took from a Redis bucket and has not handed out yet."""

    left: int
    redis_left: float  # the bucket's tokens in Redis after the fetch (for RateLimit-Remaining)
    until: float  # monotonic: unused tokens go back to Redis with the next fetch after this


@dataclass
class _Want:
    future: asyncio.Future[tuple[int, float]]  # (granted, tokens left in Redis after this one's share)
    count: int


class RedisBuckets:
    """Buckets in Redis, shared by every process using the same Redis.

    Two things keep the cost per request small: takes that arrive while a script call is in flight go together
    in the next call (one round trip for all of them), and for budgets of 200 or more a process takes up to 1 %
    of the budget at once (`lease_size`) and hands those tokens out locally for up to LEASE_SECONDS, giving back
    what it did not use with its next fetch. The limit then holds to within that 1 % per API process: a key
    never gets more than its budget, and another process may refuse it while this one holds unused tokens for
    at most a second. Below 200 every request asks Redis, so small budgets are exact.
    """

    def __init__(self, url: str) -> None:
        # Only an API with a Redis imports the client: the embedded mode's (MemoryBuckets) never loads it.
        import redis.asyncio as aredis

        self._redis = aredis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
        self._script = self._redis.register_script(_TAKE_SCRIPT)
        # bucket -> (limit, window, tokens given back, the takes waiting), in arrival order
        self._waiting: dict[str, tuple[int, float, int, list[_Want]]] = {}
        self._sender: asyncio.Task[None] | None = None
        self._leases: dict[str, _Lease] = {}
        self._fetching: dict[str, asyncio.Future[tuple[int, float]]] = {}

    async def take(self, bucket: str, limit: int, window_s: float) -> Decision:
        key = REDIS_PREFIX + bucket
        chunk = lease_size(limit)
        if chunk == 1:
            granted, tokens = await self._ask(key, limit, window_s, 1, 0)
            return decide(tokens, granted == 1, limit, window_s)
        fetched = False  # a lease this take waited for is used even if a slow event loop let it expire meanwhile
        while True:
            lease = self._leases.get(key)
            if lease is not None and lease.left > 0 and (fetched or time.monotonic() < lease.until):
                lease.left -= 1
                return decide(lease.redis_left + lease.left, True, limit, window_s)
            fetch = self._fetching.get(key)
            if fetch is None:  # one fetch per bucket at a time; the others wait for it
                refund = self._leases.pop(key).left if lease is not None else 0
                fetch = asyncio.ensure_future(self._fetch_lease(key, limit, window_s, chunk, refund))
                self._fetching[key] = fetch
            granted, tokens = await asyncio.shield(fetch)
            if granted == 0:
                return decide(tokens, False, limit, window_s)
            fetched = True

    async def _fetch_lease(self, key: str, limit: int, window_s: float, chunk: int, refund: int) -> tuple[int, float]:
        """Fetch a lease and install it before finishing: a take that finds this fetch done must also find its
        lease (awaiting a done future does not yield, so a take looping on a done fetch would spin forever)."""
        try:
            granted, tokens = await self._ask(key, limit, window_s, chunk, refund)
            self._leases[key] = _Lease(granted, tokens, time.monotonic() + LEASE_SECONDS)
            return granted, tokens
        finally:
            self._fetching.pop(key, None)

    async def _ask(self, key: str, limit: int, window_s: float, count: int, refund: int) -> tuple[int, float]:
        """Take up to `count` tokens (giving `refund` back first) in the next script call."""
        future: asyncio.Future[tuple[int, float]] = asyncio.get_running_loop().create_future()
        entry = self._waiting.get(key)
        if entry is None:
            entry = self._waiting[key] = (limit, window_s, 0, [])
        self._waiting[key] = (limit, window_s, entry[2] + refund, entry[3])
        entry[3].append(_Want(future, count))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send())
        return await future

    async def _send(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, {}
                await self._send_batch(batch)
        finally:
            self._sender = None

    async def _send_batch(self, batch: dict[str, tuple[int, float, int, list[_Want]]]) -> None:
        args: list[float] = []
        for limit, window_s, refund, wants in batch.values():
            args += [limit, limit / window_s, sum(w.count for w in wants), refund]
        try:
            reply = await self._script(keys=list(batch), args=args)
        except Exception as exc:  # unreachable or failing Redis: let the requests through (see module doc)
            log.warning("rate limiting skipped: Redis call failed: %r", exc)
            for limit, _window_s, _refund, wants in batch.values():
                for want in wants:
                    if not want.future.done():
                        want.future.set_result((want.count, float(limit)))
            return
        for index, (_limit, _window_s, _refund, wants) in enumerate(batch.values()):
            granted, tokens = int(reply[2 * index]), float(reply[2 * index + 1])
            # In arrival order; each sees the tokens its own share left behind.
            for want in wants:
                share = min(want.count, granted)
                granted -= share
                if not want.future.done():  # its request went away (client disconnected)
                    want.future.set_result((share, tokens + granted))

    async def close(self) -> None:
        await self._redis.aclose()


def redis_url_of(settings: Settings) -> str:
    """The Redis holding the buckets: GRPO_RATE_LIMIT_REDIS_URL, else the broker's when it is a Redis; "" for
    in-process buckets."""
    if settings.rate_limit_redis_url is not None:
        return settings.rate_limit_redis_url
    broker = settings.broker_url
    return broker if broker.startswith(("redis://", "rediss://")) else ""


# Buckets per event loop (the Redis client is bound to the loop that made it) and configuration.
_BUCKETS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[str, Buckets]] = weakref.WeakKeyDictionary()
MEMORY_BUCKETS = MemoryBuckets()


def buckets_for(settings: Settings) -> Buckets:
    url = redis_url_of(settings)
    if not url:
        return MEMORY_BUCKETS
    loop = asyncio.get_running_loop()
    current = _BUCKETS.get(loop)
    if current is None or current[0] != url:
        current = (url, RedisBuckets(url))
        _BUCKETS[loop] = current
    return current[1]


async def close_buckets() -> None:
    """Close this event loop's Redis client, if it made one (at shutdown)."""
    entry = _BUCKETS.pop(asyncio.get_running_loop(), None)
    if entry is not None:
        await entry[1].close()


async def admit(api_key_id: str, request_class: RequestClass) -> Decision | None:
    """Take a token of this key's `request_class` bucket; raises RateLimited when there is none. None when that
    class has no limit (its setting is 0)."""
    settings = get_settings()
    limit = settings.rate_limit_reads if request_class == "read" else settings.rate_limit_writes
    if limit <= 0:
        return None
    window_s = settings.rate_limit_window_seconds
    decision = await buckets_for(settings).take(f"{api_key_id}:{request_class}", limit, window_s)
    if not decision.allowed:
        raise RateLimited(decision, request_class)
    return decision


STATE_KEY = "ratelimit"  # request.state attribute holding the Decision of an admitted REST request


class RateLimitHeaders:
    """Adds RateLimit-Limit / -Remaining / -Reset to every response of an admitted request (429s carry them
    from RateLimited). Pure ASGI: the decision is in the request's state, where the auth dependency put it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                state: dict[str, Any] = scope.get("state") or {}
                decision = state.get(STATE_KEY)
                if isinstance(decision, Decision):
                    raw = [(k.lower().encode(), v.encode()) for k, v in decision.headers().items()]
                    message = {**message, "headers": [*message.get("headers", ()), *raw]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
