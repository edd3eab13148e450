"""RemoteRewardSource against real loopback reward servers with injected faults."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest

from contract.gen.grpo.v1 import reward_pb2
from contract.reward_types import RewardError, RewardInput
from outbound.rewards import (
    RemoteRewardConfig,
    RemoteRewardSource,
    RetryEvent,
    RewardEndpointHTTPError,
    RewardEndpointInvalidResponse,
    RewardEndpointRefused,
    RewardItem,
    RewardUnavailable,
    test_endpoint,
)
from outbound.rewards.batching import make_batches
from outbound.rewards.breaker import CircuitBreaker
from outbound.rewards.cache import RewardCache, cache_key
from outbound.rewards.endpoint import parse_retry_after
from outbound.rewards.grpc_source import encode_score_request
from outbound.rewards.protocol import encode_request
from outbound.rewards.source import DegradedEvent, Pending
from worker.reward_server import RewardRequest

from .reward_servers import Fault, RewardServer, closed_port, new_secret, running


def make_items(groups: int, per_group: int, *, distinct: bool = True) -> list[RewardInput]:
    """`groups` prompts x `per_group` completions; completion lengths differ so rewards are predictable."""
    items = []
    for g in range(groups):
        for k in range(per_group):
            completion = "x" * (g * per_group + k + 1) if distinct else "same"
            items.append(
                RewardInput(
                    prompt=f"prompt {g}",
                    completion=completion,
                    completion_ids=[1, 2],
                    extras={"answer": str(g)},
                    group_id=g,
                    index=len(items),
                )
            )
    return items


def expected(items: Sequence[RewardInput]) -> list[float | None]:
    return [float(len(i.completion)) for i in items]


def make_config(url: str, secret: str, **overrides: Any) -> RemoteRewardConfig:
    values: dict[str, Any] = {
        "reward_function_id": "rf_test",
        "url": url,
        "secret": secret,
        "job_id": "job_123",
        "timeout_s": 2.0,
        "connect_timeout_s": 1.0,
        "max_batch_size": 8,
        "max_concurrency": 4,
        "allow_private": True,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
    }
    values.update(overrides)
    return RemoteRewardConfig(**values)


@pytest.fixture
def secret() -> str:
    return new_secret()


@pytest.fixture
def server(secret: str) -> Iterator[RewardServer]:
    with running(RewardServer(secret)) as srv:
        yield srv


class TestHappyPath:
    async def test_rewards_signed_requests_and_body(self, server: RewardServer, secret: str) -> None:
        items = make_items(3, 4)
        source = RemoteRewardSource(make_config(server.url, secret, headers={"x-api-key": "k1"}))
        try:
            rewards = await source(items, step=7)
        finally:
            await source.aclose()
        assert rewards == expected(items)
        assert source.name == "remote:rf_test"
        assert server.rejected == []
        assert len(server.seen) == server.received == 2  # 4+4 then 4 (max_batch_size 8)
        for seen in server.seen:
            assert seen.headers["x-api-key"] == "k1"
            assert seen.headers["webhook-signature"].startswith("v1,")
            body = json.loads(seen.body)
            assert body["job_id"] == "job_123" and body["step"] == 7
            assert set(body["items"][0]) == {"id", "prompt", "completion", "metadata", "group_id"}
            assert body["items"][0]["metadata"] == {"answer": str(body["items"][0]["group_id"])}
        sent_ids = [item.id for seen in server.seen for item in seen.request.items]
        assert len(set(sent_ids)) == len(items)

    async def test_batches_keep_groups_together(self, server: RewardServer, secret: str) -> None:
        items = make_items(5, 3)  # groups of 3, batches of at most 8 -> 6, 6, 3
        source = RemoteRewardSource(make_config(server.url, secret, max_batch_size=8, max_concurrency=1))
        assert await source(items, step=0) == expected(items)
        await source.aclose()
        sizes = [len(seen.request.items) for seen in server.seen]
        assert sorted(sizes) == [3, 6, 6]
        for seen in server.seen:
            groups = Counter(item.group_id for item in seen.request.items)
            assert all(count == 3 for count in groups.values()), groups

    async def test_concurrency_limit_respected(self, secret: str) -> None:
        with running(RewardServer(secret, latency_s=0.15)) as server:
            items = make_items(8, 4)  # 32 items, batches of 4 -> 8 requests
            source = RemoteRewardSource(make_config(server.url, secret, max_batch_size=4, max_concurrency=3))
            assert await source(items, step=0) == expected(items)
            await source.aclose()
        assert server.received == 8
        assert server.max_in_flight == 3

    async def test_cache_dedupes_identical_completions(self, server: RewardServer, secret: str) -> None:
        items = make_items(2, 4, distinct=False)  # within a group all 4 completions are identical
        source = RemoteRewardSource(make_config(server.url, secret))
        assert await source(items, step=0) == [4.0] * 8
        sent = [item for seen in server.seen for item in seen.request.items]
        assert len(sent) == 2  # one per (prompt, completion, metadata)
        assert source.stats.deduplicated == 6
        # The next step asks for the same completions again: answered from the cache, no request.
        assert await source(items, step=1) == [4.0] * 8
        assert server.received == 1 and source.stats.cache_hits == 8
        await source.aclose()

    def test_usable_from_successive_event_loops(self, server: RewardServer, secret: str) -> None:
        source = RemoteRewardSource(make_config(server.url, secret, cache_max_entries=0))
        items = make_items(2, 2)
        assert asyncio.run(source(items, step=0)) == expected(items)
        assert asyncio.run(source(items, step=1)) == expected(items)

    async def test_connects_to_the_validated_address(self, server: RewardServer, secret: str) -> None:
        # The name only exists in the injected resolver: the request reaches the server only if the
        # transport connects to the address it validated (no second lookup by the system resolver).
        calls: list[str] = []

        async def resolver(host: str, port: int) -> list[str]:
            calls.append(host)
            return ["127.0.0.1"]

        url = f"http://rewards.internal.test:{server.port}/score"
        source = RemoteRewardSource(make_config(url, secret), resolver=resolver)
        items = make_items(1, 2)
        assert await source(items, step=0) == expected(items)
        await source.aclose()
        assert calls == ["rewards.internal.test"]
        assert server.seen[0].headers["host"] == f"rewards.internal.test:{server.port}"


class TestRetries:
    async def test_500s_and_timeouts_are_retried(self, secret: str) -> None:
        rng = random.Random(4)
        timeouts = {3, 9}

        def faults(number: int, request: RewardRequest) -> Fault | None:
            if number in timeouts:
                return Fault(delay_s=1.5)  # beyond the 0.5 s read timeout
            return Fault(status=500) if rng.random() < 0.3 else None

        events: list[RetryEvent] = []
        with running(RewardServer(secret, faults=faults)) as server:
            items = make_items(10, 4)
            config = make_config(server.url, secret, max_batch_size=4, timeout_s=0.5, max_attempts=8)
            source = RemoteRewardSource(config, on_retry=events.append)
            assert await source(items, step=3) == expected(items)
            await source.aclose()
        reasons = Counter(e.reason.split(" (")[0] for e in events)
        assert reasons["HTTP 500"] >= 1
        assert any(e.reason.startswith(("timed out", "no complete answer")) for e in events)
        assert source.stats.retries == len(events) == server.received - 10
        assert server.rejected == []
        # Retries of one request keep its webhook-id; each attempt is signed afresh.
        per_id = Counter(seen.headers["webhook-id"] for seen in server.seen)
        assert len(per_id) == 10 and max(per_id.values()) >= 2
        assert {e.message_id for e in events} <= set(per_id)
        assert all(e.url == server.url and e.source == "remote:rf_test" for e in events)

    async def test_permanent_400_is_not_retried(self, secret: str) -> None:
        with running(
            RewardServer(secret, faults=lambda n, r: Fault(status=400, body=b"bad prompt field"))
        ) as server:
            source = RemoteRewardSource(make_config(server.url, secret))
            with pytest.raises(RewardEndpointHTTPError) as info:
                await source(make_items(1, 4), step=0)
            await source.aclose()
        assert server.received == 1
        assert info.value.status == 400
        assert isinstance(info.value, RewardError) and not isinstance(info.value, RewardUnavailable)
        assert "HTTP 400" in str(info.value) and "bad prompt field" in str(info.value)
        assert server.url in str(info.value)

    async def test_429_retry_after_seconds_is_honoured(self, secret: str) -> None:
        plan = lambda n, r: Fault(status=429, headers={"retry-after": "1"}) if n == 1 else None  # noqa: E731
        events: list[RetryEvent] = []
        with running(RewardServer(secret, faults=plan)) as server:
            source = RemoteRewardSource(make_config(server.url, secret), on_retry=events.append)
            started = time.monotonic()
            items = make_items(1, 2)
            assert await source(items, step=0) == expected(items)
            elapsed = time.monotonic() - started
            await source.aclose()
        assert elapsed >= 1.0
        assert [(e.reason, e.wait_s) for e in events] == [("HTTP 429", 1.0)]

    async def test_long_retry_after_pauses_instead_of_waiting(self, secret: str) -> None:
        plan = lambda n, r: Fault(status=503, headers={"retry-after": "3600"})  # noqa: E731
        with running(RewardServer(secret, faults=plan)) as server:
            source = RemoteRewardSource(make_config(server.url, secret))
            started = time.monotonic()
            with pytest.raises(RewardUnavailable, match="retry after 3600"):
                await source(make_items(1, 2), step=0)
            await source.aclose()
        assert time.monotonic() - started < 2 and server.received == 1

    def test_retry_after_http_date(self) -> None:
        now = datetime(2025, 1, 1, tzinfo=UTC)
        header = format_datetime(now + timedelta(seconds=30), usegmt=True)
        assert parse_retry_after(header, now=now.timestamp()) == pytest.approx(30.0)
        assert parse_retry_after("7") == 7.0
        assert parse_retry_after("soon") is None
        assert parse_retry_after(None) is None


class TestCircuitBreaker:
    async def test_endpoint_down_opens_breaker_then_recovers(self, secret: str) -> None:
        down = True
        plan = lambda n, r: Fault(status=503) if down else None  # noqa: E731
        with running(RewardServer(secret, faults=plan)) as server:
            config = make_config(server.url, secret, max_attempts=3, breaker_threshold=2, breaker_reset_s=0.5)
            source = RemoteRewardSource(config)
            items = make_items(1, 2)
            # The request is sent again until `breaker_threshold` requests in a row exhausted their attempts.
            with pytest.raises(RewardUnavailable, match="HTTP 503.*circuit open after 2"):
                await source(items, step=0)
            assert server.received == 6  # 2 requests x 3 attempts
            assert source.stats.resends == 1
            # Open: fails fast without touching the endpoint.
            with pytest.raises(RewardUnavailable, match="circuit open") as info:
                await source(items, step=0)
            assert info.value.code == "reward_endpoint_unavailable"
            assert server.received == 6
            down = False
            await asyncio.sleep(0.6)  # half-open: one trial call goes out and closes the breaker
            assert await source(items, step=0) == expected(items)
            assert await source(make_items(2, 2), step=1) == expected(make_items(2, 2))
            await source.aclose()

    async def test_connection_refused_is_unavailable(self, secret: str) -> None:
        url = f"http://127.0.0.1:{closed_port()}/score"
        events: list[RetryEvent] = []
        config = make_config(url, secret, max_attempts=3, breaker_threshold=2)
        source = RemoteRewardSource(config, on_retry=events.append)
        with pytest.raises(RewardUnavailable, match="connection failed"):
            await source(make_items(1, 2), step=0)
        await source.aclose()
        # 2 requests x 2 retries, and the resend between them; attempts numbered over both requests.
        assert [e.attempt for e in events] == [1, 2, 3, 4, 5]
        assert all("ConnectError" in e.reason for e in events) and "sending again" in events[2].reason


class TestFlakyEndpoint:
    """An endpoint that answers some calls is alive: a request that exhausts its attempts is sent again,
    and at the step deadline its items abstain (within the limit) instead of the job pausing."""

    async def test_exhausted_request_is_resent_while_the_breaker_stays_closed(self, secret: str) -> None:
        # Each request's first two attempts fail: with max_attempts=2 every request exhausts them once,
        # and its resend succeeds. The breaker (threshold 3) never sees 3 consecutive failed requests.
        failing = {1, 2}
        plan = lambda n, r: Fault(status=500) if n in failing else None  # noqa: E731
        with running(RewardServer(secret, faults=plan)) as server:
            config = make_config(server.url, secret, max_attempts=2, breaker_threshold=2, max_batch_size=8)
            source = RemoteRewardSource(config)
            items = make_items(2, 2)
            assert await source(items, step=0) == expected(items)
            await source.aclose()
        assert source.stats.resends == 1 and server.received == 3
        # The resend is the same request: the same webhook-id on every attempt.
        assert len({seen.headers["webhook-id"] for seen in server.seen}) == 1

    async def test_flaky_endpoint_never_pauses(self, secret: str) -> None:
        # 30 % 5xx and 10 % timeouts beyond the read timeout, at random; two attempts per request so that
        # many requests exhaust them (about 16 %): each must be resent, never pause the job.
        rng = random.Random(7)

        def faults(number: int, request: RewardRequest) -> Fault | None:
            draw = rng.random()
            if draw < 0.3:
                return Fault(status=503)
            return Fault(delay_s=0.6) if draw < 0.4 else None

        with running(RewardServer(secret, faults=faults)) as server:
            config = make_config(server.url, secret, max_attempts=2, max_batch_size=2, timeout_s=0.3,
                                 breaker_threshold=6)
            source = RemoteRewardSource(config)
            for step in range(12):
                items = make_items(4, 2)
                items = [RewardInput(i.prompt, i.completion + "y" * step, [], i.extras, i.group_id, i.index)
                         for i in items]
                assert await source(items, step=step) == expected(items)
            await source.aclose()
        assert source.stats.resends >= 1  # the old behaviour (pause on the first exhausted request) fails here

    async def test_deadline_abstains_within_the_limit_and_reports_it(self, secret: str) -> None:
        # Group 0's request always fails, the others succeed: the breaker keeps closing on their successes.
        plan = lambda n, r: Fault(status=500) if r.items[0].group_id == 0 else None  # noqa: E731
        degraded: list[DegradedEvent] = []
        with running(RewardServer(secret, faults=plan)) as server:
            config = make_config(server.url, secret, max_attempts=2, max_batch_size=2, max_concurrency=1,
                                 breaker_threshold=50, step_deadline_s=0.5, max_abstain_fraction=0.25)
            source = RemoteRewardSource(config, on_degraded=degraded.append)
            items = make_items(4, 2)
            rewards = await source(items, step=5)
            assert rewards[:2] == [None, None] and rewards[2:] == expected(items)[2:]
            assert len(degraded) == 1
            event = degraded[0]
            assert (event.step, event.abstained, event.items) == (5, 2, 8) and "HTTP 500" in event.reason
            # The abstention was forced, not the endpoint's answer: it is not cached, the next step asks again.
            before = server.received
            with pytest.raises(RewardUnavailable, match="2 of 2 items still unscored"):
                await source(items[:2], step=6)
            assert server.received > before
            await source.aclose()

    async def test_too_many_abstentions_pause(self, secret: str) -> None:
        plan = lambda n, r: Fault(status=500) if r.items[0].group_id < 2 else None  # noqa: E731
        with running(RewardServer(secret, faults=plan)) as server:
            config = make_config(server.url, secret, max_attempts=2, max_batch_size=2, max_concurrency=1,
                                 breaker_threshold=50, step_deadline_s=0.5, max_abstain_fraction=0.25)
            source = RemoteRewardSource(config)
            with pytest.raises(RewardUnavailable, match="4 of 8 items still unscored"):
                await source(make_items(4, 2), step=0)
            await source.aclose()


class TestInvalidResponses:
    @pytest.mark.parametrize(
        ("body", "what"),
        [
            (b'{"rewards": [1.0]}', "rewards has 1 values for 2 items"),
            (b'{"rewards": [NaN, 1.0]}', "NaN"),
            (b'{"rewards": [Infinity, 1.0]}', "Infinity"),
            (b'{"rewards": [1e999, 1.0]}', "overflows to infinity"),
            (b'{"rewards": ["1.0", 1.0]}', "rewards[0] is '1.0': Input should be a valid number"),
            (b'{"rewards": [true, 1.0]}', "rewards[0] is True"),
            (b'{"rewards": "high"}', "rewards is 'high'"),
            (b'{"scores": [1, 2]}', '"rewards" list'),
            (b"<html>oops</html>", "not valid JSON"),
            (b'{"rewards": [1.0, 2.0]' + b" " * 5000 + b"}", "exceeds the 4096-byte limit"),
        ],
    )
    async def test_rejected_with_endpoint_and_reason(self, secret: str, body: bytes, what: str) -> None:
        with running(RewardServer(secret, faults=lambda n, r: Fault(body=body))) as server:
            source = RemoteRewardSource(make_config(server.url, secret, max_response_bytes=4096))
            with pytest.raises(RewardEndpointInvalidResponse) as info:
                await source(make_items(1, 2), step=0)
            await source.aclose()
        assert info.value.code == "reward_endpoint_invalid_response"
        assert what in str(info.value)
        assert server.url in str(info.value) and "remote:rf_test" in str(info.value)
        assert server.received == 1  # never retried

    async def test_abstentions_pass_through(self, secret: str) -> None:
        with running(RewardServer(secret, score=lambda r: [None, 2])) as server:  # type: ignore[arg-type,list-item]
            source = RemoteRewardSource(make_config(server.url, secret))
            assert await source(make_items(1, 2), step=0) == [None, 2.0]
            await source.aclose()


class TestSsrfAtCallTime:
    async def test_redirect_to_private_address_is_refused(self, secret: str) -> None:
        plan = lambda n, r: Fault(status=302, headers={"location": "http://10.0.0.1/admin"})  # noqa: E731
        with running(RewardServer(secret, faults=plan)) as server:
            source = RemoteRewardSource(make_config(server.url, secret))
            with pytest.raises(
                RewardEndpointHTTPError, match=r"HTTP 302 \(redirect to 'http://10.0.0.1/admin'\)"
            ):
                await source(make_items(1, 2), step=0)
            await source.aclose()
        assert server.received == 1

    async def test_loopback_refused_in_production_before_connecting(
        self, server: RewardServer, secret: str
    ) -> None:
        # The config would refuse this URL at construction; model_copy skips that to exercise the call-time
        # check on its own (the transport must refuse before opening a socket).
        config = make_config(server.url, secret).model_copy(update={"allow_private": False})
        source = RemoteRewardSource(config)
        with pytest.raises(RewardEndpointRefused, match="127.0.0.1 is a loopback address"):
            await source(make_items(1, 2), step=0)
        await source.aclose()
        assert server.received == 0

    async def test_name_resolving_to_private_refused_in_production(
        self, server: RewardServer, secret: str
    ) -> None:
        answers = iter([["93.184.215.14"], ["10.1.2.3"]])

        async def rebinding(host: str, port: int) -> list[str]:
            return next(answers)

        from outbound.urlpolicy import check_url

        url = f"https://rewards.example.com:{server.port}/score"
        assert await check_url(url, allow_private=False, resolver=rebinding) == url  # registration: public
        source = RemoteRewardSource(make_config(url, secret, allow_private=False), resolver=rebinding)
        with pytest.raises(
            RewardEndpointRefused, match=r"rewards.example.com resolves to a private address$"
        ):
            await source(make_items(1, 2), step=0)
        await source.aclose()
        assert server.received == 0


class TestTestEndpoint:
    async def test_returns_rewards_and_latency(self, secret: str) -> None:
        with running(RewardServer(secret, latency_s=0.05)) as server:
            items = [
                RewardItem(id="a", prompt="p", completion="abc"),
                RewardItem(id="b", prompt="p", completion="a"),
            ]
            rewards, latency_ms = await test_endpoint(make_config(server.url, secret), items)
        assert rewards == [3.0, 1.0]
        assert 50 <= latency_ms < 2000

    async def test_error_is_precise_and_not_retried(self, secret: str) -> None:
        with running(RewardServer(secret, faults=lambda n, r: Fault(status=503))) as server:
            items = [RewardItem(id="a", prompt="p", completion="abc")]
            with pytest.raises(RewardUnavailable, match="HTTP 503"):
                await test_endpoint(make_config(server.url, secret), items)
        assert server.received == 1


class TestConfig:
    def test_bad_secret_and_reserved_headers_are_refused(self, secret: str) -> None:
        with pytest.raises(ValueError, match="whsec_"):
            make_config("http://127.0.0.1/", "not-a-secret")
        with pytest.raises(ValueError, match="may not set Webhook-Signature"):
            make_config("http://127.0.0.1/", secret, headers={"Webhook-Signature": "v1,x"})


class TestConfigUrl:
    def test_url_policy_applies_at_construction(self, secret: str) -> None:
        with pytest.raises(ValueError, match="scheme 'http' is not allowed"):
            make_config("http://rewards.example.com/", secret, allow_private=False)
        with pytest.raises(ValueError, match="is a loopback address"):
            make_config("https://0x7f000001/", secret, allow_private=False)
        assert make_config("https://rewards.example.com/", secret, allow_private=False).url


class TestBatchingUnits:
    def test_oversize_group_is_split_and_order_kept(self) -> None:
        items = [(0, i) for i in range(10)] + [(1, i) for i in range(3)] + [(2, i) for i in range(6)]
        batches = make_batches(items, max_batch_size=8, key=lambda x: x[0])
        assert [len(b) for b in batches] == [8, 5, 6]  # group 0 split 8+2, the 2 share with group 1
        assert [x for b in batches for x in b] == items
        assert all(len(b) <= 8 for b in batches)

    def test_interleaved_group_ids_are_gathered(self) -> None:
        items = [(g, i) for i in range(2) for g in range(3)]  # 0,1,2,0,1,2
        batches = make_batches(items, max_batch_size=4, key=lambda x: x[0])
        assert batches == [[(0, 0), (0, 1), (1, 0), (1, 1)], [(2, 0), (2, 1)]]


class TestBreakerUnits:
    def test_opens_after_threshold_and_half_opens_once(self) -> None:
        now = [0.0]
        breaker = CircuitBreaker(threshold=2, reset_after_s=10, clock=lambda: now[0])
        breaker.record_failure()
        assert breaker.allow() and not breaker.is_open
        breaker.record_failure()
        assert breaker.is_open and not breaker.allow()
        now[0] = 11.0
        assert breaker.allow()  # the trial
        assert not breaker.allow()  # only one trial at a time
        breaker.record_failure()  # trial failed: open for another period
        assert not breaker.allow()
        now[0] = 22.0
        assert breaker.allow()
        breaker.record_success()
        assert not breaker.is_open and breaker.allow() and breaker.consecutive_failures == 0


class TestCacheUnits:
    def test_lru_bound_and_cached_abstention(self) -> None:
        cache = RewardCache(max_entries=2)
        a, b, c = (cache_key("p", x, {}) for x in "abc")
        cache.put(a, None)
        cache.put(b, 1.0)
        assert cache.get(a) == (True, None)  # a cached abstention is a hit; a is now most recent
        cache.put(c, 2.0)  # evicts b
        assert cache.get(b) == (False, None) and cache.get(c) == (True, 2.0) and len(cache) == 2

    def test_key_separates_fields_and_metadata(self) -> None:
        assert cache_key("ab", "c", {}) != cache_key("a", "bc", {})
        assert cache_key("p", "c", {"answer": 1}) != cache_key("p", "c", {"answer": 2})
        assert cache_key("p", "c", {"x": 1, "y": 2}) == cache_key("p", "c", {"y": 2, "x": 1})


def test_multi_turn_items_carry_their_turns_and_single_turn_bodies_stay_as_they_were() -> None:
    turns = [{"role": "assistant", "text": "<tool_call>...</tool_call>", "tool_calls": [{"name": "add"}]},
             {"role": "tool", "name": "add", "text": "5"}]
    multi = RewardItem(id="0", prompt="p", completion="c", turns=turns)
    single = RewardItem(id="1", prompt="p", completion="c")
    body = json.loads(encode_request(RewardRequest(job_id="job_1", step=1, items=[multi, single])))
    assert body["items"][0]["turns"] == turns and "turns" not in body["items"][1]
    assert RewardRequest.model_validate(body).items[0].turns == turns  # what a user's server parses

    config = RemoteRewardConfig(reward_function_id="rf_1", url="grpc://127.0.0.1:9", secret=new_secret(),
                                job_id="job_1", allow_private=True)
    pending = [Pending(b"k", 0, RewardInput(prompt="p", completion="c", completion_ids=[1], turns=turns)),
               Pending(b"l", 1, RewardInput(prompt="p", completion="c", completion_ids=[1]))]
    items = reward_pb2.ScoreRequest.FromString(encode_score_request(config, pending, 1)).items
    assert json.loads(items[0].turns_json) == turns and not items[1].HasField("turns_json")
