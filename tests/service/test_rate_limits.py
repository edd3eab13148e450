"""Per-key rate limits against a real uvicorn server: concurrent clients, the exact budget, the headers, the
client honouring Retry-After. On SQLite the buckets are in-process (the embedded mode); on PostgreSQL they are
in the real Redis (production), shared with the gRPC server."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
import uvicorn

from client.sdk import APIError, GRPOClient
from contract.gen.grpo.v1 import jobs_pb2, jobs_pb2_grpc
from service.app import create_app
from service.grpc.server import running_grpc
from service.kit import db as kit_db
from service.kit.config import Settings, get_settings
from service.tenants.ratelimit import MemoryBuckets, RedisBuckets, decide, lease_size
from tests.grpc.helpers import bearer, error_code, trailer
from tests.service.factories import TenantHeaders, auth_headers, create_key
from tests.ship.conftest import free_port


@dataclass
class Live:
    url: str
    settings: Settings


@pytest.fixture
def limits(settings: Settings, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Callable[..., None]:
    """Set the budgets; on PostgreSQL the buckets go to the real Redis (db 14), on SQLite they stay in-process."""

    def apply(reads: int, writes: int, window_s: float) -> None:
        monkeypatch.setenv("GRPO_RATE_LIMIT_READS", str(reads))
        monkeypatch.setenv("GRPO_RATE_LIMIT_WRITES", str(writes))
        monkeypatch.setenv("GRPO_RATE_LIMIT_WINDOW_SECONDS", str(window_s))
        if settings.database_url.startswith("postgresql"):
            redis_url = request.getfixturevalue("redis_base_url")
            monkeypatch.setenv("GRPO_RATE_LIMIT_REDIS_URL", f"{redis_url}/14")
        get_settings.cache_clear()

    return apply


@pytest.fixture
def live(settings: Settings) -> Iterator[str]:
    """The real app under uvicorn on a free loopback port (a thread of this process).

    Keep-alive outlasts every test: a pooled connection left idle past uvicorn's default 5 s can be closed by the
    server just as the client sends on it (httpx then raises ReadError; clients retry such errors, as
    client/sdk.py does). On a loaded 2-core machine the 64-connection test leaves connections idle that long,
    and what it measures is admission, not keep-alive expiry."""
    port = free_port()
    config = uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=300)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def _new_key(tenant: TenantHeaders) -> str:
    with kit_db.session_scope() as session:
        return create_key(session, tenant.tenant_id, ["read", "write"])


async def _burst(url: str, headers: dict[str, str], method: str, path: str, n: int) -> list[httpx.Response]:
    """`n` requests at once, each on its own connection."""
    async def one() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await client.request(method, path, headers=headers)

    return list(await asyncio.gather(*(one() for _ in range(n))))


class TestBudget:
    def test_concurrent_clients_get_exactly_the_budget(
        self, limits: Callable[..., None], tenant_a: TenantHeaders, live: str
    ) -> None:
        limits(reads=8, writes=5, window_s=600)  # refills one write per 120 s: none during the test
        key = auth_headers(_new_key(tenant_a))
        responses = asyncio.run(_burst(live, key, "POST", "/v1/jobs/job_x/cancel", 20))
        passed = [r for r in responses if r.status_code != 429]
        refused = [r for r in responses if r.status_code == 429]
        assert len(passed) == 5 and {r.status_code for r in passed} == {404}  # admitted, then ran
        assert sorted(int(r.headers["RateLimit-Remaining"]) for r in passed) == [0, 1, 2, 3, 4]
        assert all(r.headers["RateLimit-Limit"] == "5" for r in passed)
        assert len(refused) == 15
        for response in refused:
            assert response.headers["RateLimit-Limit"] == "5"
            assert response.headers["RateLimit-Remaining"] == "0"
            retry_after = int(response.headers["Retry-After"])
            assert 100 <= retry_after <= 120  # one write per 120 s, a few seconds of which have passed
            assert 590 <= int(response.headers["RateLimit-Reset"]) <= 600  # empty bucket: a full window
            error = response.json()["error"]
            assert error["code"] == "rate_limited"
            assert error["details"]["class"] == "write" and error["details"]["limit"] == 5
        # Reads have their own budget, and other keys their own buckets.
        assert httpx.get(f"{live}/v1/jobs", headers=key).status_code == 200
        other = auth_headers(_new_key(tenant_a))
        assert httpx.post(f"{live}/v1/jobs/job_x/cancel", headers=other).status_code == 404

    def test_reads_are_counted_apart_from_writes(
        self, limits: Callable[..., None], tenant_a: TenantHeaders, live: str
    ) -> None:
        limits(reads=3, writes=100, window_s=600)
        key = auth_headers(_new_key(tenant_a))
        statuses = [r.status_code for r in asyncio.run(_burst(live, key, "GET", "/v1/jobs", 6))]
        assert sorted(statuses) == [200, 200, 200, 429, 429, 429]
        assert httpx.post(f"{live}/v1/jobs/job_x/cancel", headers=key).status_code == 404

    def test_no_limit_when_the_budget_is_zero(
        self, limits: Callable[..., None], tenant_a: TenantHeaders, live: str
    ) -> None:
        limits(reads=0, writes=0, window_s=1)
        responses = asyncio.run(_burst(live, tenant_a, "GET", "/v1/jobs", 10))
        assert {r.status_code for r in responses} == {200}
        assert "RateLimit-Limit" not in responses[0].headers


class TestClientHonoursRetryAfter:
    def test_a_rate_limited_write_is_retried_after_retry_after_and_succeeds(
        self, limits: Callable[..., None], tenant_a: TenantHeaders, live: str
    ) -> None:
        limits(reads=2, writes=2, window_s=2)  # one token a second
        with GRPOClient(live, api_key=_new_key(tenant_a)) as client:
            for _ in range(2):
                with pytest.raises(APIError) as err:
                    client.cancel_job("job_x")
                assert err.value.status == 404
            started = time.monotonic()
            # The bucket is empty: the first try gets 429 with Retry-After: 1, the client waits and the retry runs.
            with pytest.raises(APIError) as err:
                client.cancel_job("job_x")
            assert err.value.status == 404
            assert time.monotonic() - started >= 0.9

            for _ in range(2):
                client.list_jobs()
            started = time.monotonic()
            assert client.list_jobs().data == []
            assert time.monotonic() - started >= 0.9

    def test_a_retry_after_beyond_the_clients_patience_is_returned_at_once(
        self, limits: Callable[..., None], tenant_a: TenantHeaders, live: str
    ) -> None:
        limits(reads=1, writes=1, window_s=600)
        with GRPOClient(live, api_key=_new_key(tenant_a), max_retry_after=5) as client:
            client.list_jobs()
            started = time.monotonic()
            with pytest.raises(APIError) as err:
                client.list_jobs()
            assert err.value.status == 429 and err.value.code == "rate_limited"
            assert time.monotonic() - started < 5


class TestGrpc:
    async def test_resource_exhausted_with_the_delay_in_trailers(
        self, limits: Callable[..., None], tenant_a: TenantHeaders
    ) -> None:
        limits(reads=2, writes=2, window_s=600)
        key = bearer(_new_key(tenant_a))
        async with running_grpc(0) as (_server, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            jobs = jobs_pb2_grpc.JobServiceStub(channel)
            for _ in range(2):
                await jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=key)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=key)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_code(err.value) == "rate_limited"
            assert 299 <= int(trailer(err.value, "retry-after") or 0) <= 300
            assert 298_000 <= int(trailer(err.value, "grpo-retry-after-ms") or 0) <= 300_000
            assert trailer(err.value, "ratelimit-limit") == "2"
            assert trailer(err.value, "ratelimit-remaining") == "0"
            # Writes are a separate budget.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id="job_x"), metadata=key)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_busy_key_with_a_large_budget_is_served_from_leases(
    limits: Callable[..., None], tenant_a: TenantHeaders, live: str
) -> None:
    """64 connections polling with one key, as the load benchmark does: every request is answered and admitted."""
    limits(reads=1_000_000, writes=1_000_000, window_s=60)
    headers = auth_headers(_new_key(tenant_a))

    async def connection(client: httpx.AsyncClient) -> list[int]:
        return [(await client.get("/v1/jobs", headers=headers)).status_code for _ in range(15)]

    limits_ = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=live, limits=limits_, timeout=30) as client:
        statuses = await asyncio.wait_for(asyncio.gather(*(connection(client) for _ in range(64))), timeout=90)
    assert {s for per in statuses for s in per} == {200}


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_rest_and_grpc_share_one_budget_in_redis(
    limits: Callable[..., None], tenant_a: TenantHeaders, live: str
) -> None:
    limits(reads=100, writes=4, window_s=600)
    token = _new_key(tenant_a)
    async with httpx.AsyncClient(base_url=live) as client:
        for _ in range(2):
            assert (await client.post("/v1/jobs/job_x/cancel", headers=auth_headers(token))).status_code == 404
    async with running_grpc(0) as (_server, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        for expected in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id="job_x"), metadata=bearer(token))
            assert err.value.code() == expected


class TestBucketArithmetic:
    def test_refill_is_continuous_and_capped(self, monkeypatch: pytest.MonkeyPatch) -> None:
        now = [1000.0]
        monkeypatch.setattr(time, "monotonic", lambda: now[0])
        buckets = MemoryBuckets()
        taken = [buckets.take_now("k", 4, 8.0) for _ in range(5)]  # 0.5 token per second
        assert [d.allowed for d in taken] == [True, True, True, True, False]
        assert taken[-1].retry_after_s == pytest.approx(2.0)
        now[0] += 1.0
        assert not buckets.take_now("k", 4, 8.0).allowed  # half a token
        now[0] += 1.0
        assert buckets.take_now("k", 4, 8.0).allowed
        now[0] += 1000.0
        assert buckets.take_now("k", 4, 8.0).remaining == 3  # capped at 4, minus this one

    def test_headers(self) -> None:
        assert decide(2.5, True, 10, 60.0).headers() == {
            "RateLimit-Limit": "10",
            "RateLimit-Remaining": "2",
            "RateLimit-Reset": "45",
        }


class TestRedisLeases:
    """Budgets of 200 and more: a process takes up to 1 % of the budget per Redis call (`lease_size`)."""

    async def test_a_process_never_passes_more_than_the_budget(self, redis_base_url: str) -> None:
        buckets = RedisBuckets(f"{redis_base_url}/14")
        bucket = f"test-{uuid.uuid4().hex}:write"
        try:
            assert lease_size(300) == 3
            decisions = await asyncio.gather(*(buckets.take(bucket, 300, 3000.0) for _ in range(320)))
        finally:
            await buckets.close()
        assert sum(d.allowed for d in decisions) == 300

    async def test_unused_leased_tokens_go_back_to_the_shared_bucket(self, redis_base_url: str) -> None:
        first, second = RedisBuckets(f"{redis_base_url}/14"), RedisBuckets(f"{redis_base_url}/14")  # two processes
        bucket = f"test-{uuid.uuid4().hex}:read"
        try:
            assert (await first.take(bucket, 200, 3000.0)).allowed  # leases 2 tokens, uses 1
            taken = await asyncio.gather(*(second.take(bucket, 200, 3000.0) for _ in range(200)))
            assert sum(d.allowed for d in taken) == 198  # the first process still holds one
            for lease in first._leases.values():
                lease.until = 0.0  # its lease has run out: the next fetch gives the unused token back
            assert (await first.take(bucket, 200, 3000.0)).allowed
            assert not (await second.take(bucket, 200, 3000.0)).allowed
        finally:
            await first.close()
            await second.close()

    async def test_many_clients_looping_on_one_key_all_pass_within_the_budget(self, redis_base_url: str) -> None:
        """64 clients taking one at a time from shared leases, as requests do, all answered and all admitted."""
        buckets = RedisBuckets(f"{redis_base_url}/14")
        bucket = f"test-{uuid.uuid4().hex}:read"
        allowed = 0

        async def client() -> None:
            nonlocal allowed
            for _ in range(50):
                decision = await buckets.take(bucket, 1_000_000, 3000.0)
                allowed += decision.allowed  # after the await: `allowed += await ...` would read it before
                await asyncio.sleep(0)

        try:
            await asyncio.wait_for(asyncio.gather(*(client() for _ in range(64))), timeout=60)
        finally:
            await buckets.close()
        assert allowed == 64 * 50


def test_a_take_arriving_as_a_lease_fetch_finishes_uses_that_lease() -> None:
    """The moment between a lease fetch finishing and anything else running: a take arriving then must find the
    fetched lease. (Were the lease installed by a callback after the fetch, such a take would find the finished
    fetch, get its result without yielding, find no lease, and loop forever, stopping the event loop.)"""
    outcome: list[bool] = []

    async def scenario() -> None:
        buckets = RedisBuckets("redis://127.0.0.1:6379/14")  # never contacted: the Redis call is replaced
        release = asyncio.Event()

        async def answer_when_released(key: str, limit: int, window_s: float, count: int, refund: int) -> tuple[int, float]:
            await release.wait()
            return count, 100.0

        buckets._ask = answer_when_released  # type: ignore[method-assign]
        first = asyncio.ensure_future(buckets.take("k", 200, 60.0))  # starts a fetch of 2 tokens
        while not buckets._fetching:
            await asyncio.sleep(0)
        fetch = next(iter(buckets._fetching.values()))
        release.set()
        while not fetch.done():
            await asyncio.sleep(0)
        second = await buckets.take("k", 200, 60.0)
        outcome.extend([second.allowed, (await first).allowed])
        await buckets.close()

    # In a thread: a loop that spins would never let a timeout inside it fire.
    thread = threading.Thread(target=lambda: asyncio.run(scenario()), daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the take never returned: it spins on the finished fetch"
    assert outcome == [True, True]
