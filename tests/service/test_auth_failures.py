"""Failed API-key lookups are bounded: a refused key is refused from memory for a documented window, and
each client address may fail only GRPO_AUTH_LOOKUPS_PER_MINUTE database lookups; beyond, its unknown keys
get 429 and its lookups run one at a time, while valid keys (cached or not) keep working. SQL is counted
on the service's own engine."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from contract.gen.grpo.v1 import jobs_pb2, jobs_pb2_grpc
from service.grpc.server import running_grpc
from service.kit import db as kit_db
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.kit.errors import Unauthenticated
from service.tenants.auth import KEY_CACHE, authenticate_on_loop
from service.tenants.failures import TooManyAuthFailures
from service.tenants.keys import KEY_PREFIX, hash_key, lookup_prefix
from service.tenants.models import ApiKey
from tests.service.factories import TenantHeaders, auth_headers, create_key


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    KEY_CACHE.clear()
    yield
    KEY_CACHE.clear()


@pytest.fixture
def key_queries(settings: Settings) -> Iterator[list[str]]:
    """Every query the service's engine sends that reads the api_keys table."""
    sent: list[str] = []
    engine = kit_db.get_engine()

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "api_keys" in statement:
            sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    yield sent
    event.remove(engine, "before_cursor_execute", record)


def _configure(monkeypatch: pytest.MonkeyPatch, **values: object) -> None:
    for name, value in values.items():
        monkeypatch.setenv(f"GRPO_{name.upper()}", str(value))
    get_settings.cache_clear()


def random_key() -> str:
    """Shaped like a real key (so it reaches the database), matching none."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _authenticate(token: str, address: str) -> Any:
    return asyncio.run(authenticate_on_loop(token, address))


class TestFlood:
    def test_a_flood_of_unknown_keys_leaves_valid_keys_working(
        self, client: TestClient, tenant_a: TenantHeaders, key_queries: list[str]
    ) -> None:
        # The review's reproduction: garbage keys from one address, then a valid key this process has not seen.
        per_minute = get_settings().auth_lookups_per_minute
        assert per_minute == 60  # the default
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200  # a good key, now cached
        statuses = [
            client.get("/v1/jobs", headers={"Authorization": f"Bearer {random_key()}"}).status_code
            for _ in range(100)
        ]
        # A token refills every second: a slow run may earn a few more 401s.
        assert statuses[:60] == [401] * 60
        assert set(statuses[60:]) <= {401, 429} and statuses.count(429) >= 30, statuses
        throttled = client.get("/v1/jobs", headers={"Authorization": f"Bearer {random_key()}"})
        assert throttled.status_code == 429
        error = throttled.json()["error"]
        assert error["code"] == "too_many_auth_failures" and error["details"]["limit_per_minute"] == 60
        # From the same address: a valid key not yet cached authenticates (a database lookup)...
        with session_scope() as session:
            uncached = create_key(session, tenant_a.tenant_id, ["read"])
        key_queries.clear()
        assert client.get("/v1/jobs", headers=auth_headers(uncached)).status_code == 200
        assert len(key_queries) == 1
        # ...and so does the cached one.
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200

    async def test_an_address_over_its_budget_has_its_lookups_run_one_at_a_time(
        self, settings: Settings, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _configure(monkeypatch, auth_lookups_per_minute=1)
        engine = kit_db.get_engine()
        at_once = {"now": 0, "most": 0}
        lock = threading.Lock()

        def started(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if "api_keys" in statement:
                with lock:
                    at_once["now"] += 1
                    at_once["most"] = max(at_once["most"], at_once["now"])
                time.sleep(0.02)  # widen the window in which lookups could overlap

        def finished(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if "api_keys" in statement:
                with lock:
                    at_once["now"] -= 1

        async def flood(addresses: list[str]) -> list[BaseException | Any]:
            return await asyncio.gather(
                *(authenticate_on_loop(random_key(), address) for address in addresses), return_exceptions=True
            )

        event.listen(engine, "before_cursor_execute", started)
        event.listen(engine, "after_cursor_execute", finished)
        try:
            # Control: addresses with budget left look up side by side (the measure sees overlap).
            results = await flood([f"10.0.5.{i}" for i in range(12)])
            assert all(isinstance(r, Unauthenticated) for r in results), results
            assert at_once["most"] > 1, at_once
            at_once["most"] = 0
            # 10.0.5.0 has spent its one failure: its twelve lookups take turns.
            results = await flood(["10.0.5.0"] * 12)
            assert all(isinstance(r, TooManyAuthFailures) for r in results), results
            assert at_once["most"] == 1, at_once
        finally:
            event.remove(engine, "before_cursor_execute", started)
            event.remove(engine, "after_cursor_execute", finished)

    def test_the_budget_is_per_address(
        self, tenant_a: TenantHeaders, key_queries: list[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _configure(monkeypatch, auth_lookups_per_minute=3)
        for _ in range(3):
            with pytest.raises(Unauthenticated):
                _authenticate(random_key(), "10.0.0.1")
        with pytest.raises(TooManyAuthFailures):
            _authenticate(random_key(), "10.0.0.1")
        with pytest.raises(Unauthenticated):  # another address still gets its lookups
            _authenticate(random_key(), "10.0.0.2")
        # A valid key not yet cached authenticates, from another address and from the throttled one.
        with session_scope() as session:
            uncached = create_key(session, tenant_a.tenant_id, ["read"])
        assert _authenticate(tenant_a.api_key, "10.0.0.3").tenant_id == tenant_a.tenant_id
        assert _authenticate(uncached, "10.0.0.1").tenant_id == tenant_a.tenant_id
        with pytest.raises(TooManyAuthFailures):  # ...which still spent nothing of the budget it has not got
            _authenticate(random_key(), "10.0.0.1")
        assert len(key_queries) == 8

    def test_valid_lookups_spend_no_budget(
        self, tenant_a: TenantHeaders, key_queries: list[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _configure(monkeypatch, auth_lookups_per_minute=2, auth_cache_seconds=0)
        for _ in range(10):  # no positive cache: ten lookups, all valid
            assert _authenticate(tenant_a.api_key, "10.0.0.9").tenant_id == tenant_a.tenant_id
        with pytest.raises(Unauthenticated):
            _authenticate(random_key(), "10.0.0.9")
        assert len(key_queries) == 11

    def test_malformed_keys_cost_no_query_and_no_budget(
        self, tenant_a: TenantHeaders, key_queries: list[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _configure(monkeypatch, auth_lookups_per_minute=1)
        for i in range(10):
            with pytest.raises(Unauthenticated):
                _authenticate(f"not-a-key-{i}", "10.0.0.5")
        assert key_queries == []
        assert _authenticate(tenant_a.api_key, "10.0.0.5").tenant_id == tenant_a.tenant_id

    def test_zero_means_no_limit(self, key_queries: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
        _configure(monkeypatch, auth_lookups_per_minute=0)
        for _ in range(30):
            with pytest.raises(Unauthenticated):
                _authenticate(random_key(), "10.0.0.4")
        assert len(key_queries) == 30

    async def test_grpc_uses_the_peer_address(
        self, settings: Settings, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _configure(monkeypatch, auth_lookups_per_minute=2)
        async with running_grpc(0) as (_server, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = jobs_pb2_grpc.JobServiceStub(channel)
            good_key = (("authorization", f"Bearer {tenant_a.api_key}"),)
            await stub.ListJobs(jobs_pb2.ListJobsRequest(), metadata=good_key)  # authenticated: now cached
            codes = []
            for _ in range(4):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListJobs(jobs_pb2.ListJobsRequest(), metadata=(("authorization", f"Bearer {random_key()}"),))
                codes.append(err.value.code())
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
            assert list((await stub.ListJobs(jobs_pb2.ListJobsRequest(), metadata=good_key)).jobs) == []
            # A valid key this process has not seen, from the throttled peer, still authenticates.
            with session_scope() as session:
                uncached = create_key(session, tenant_a.tenant_id, ["read"])
            reply = await stub.ListJobs(jobs_pb2.ListJobsRequest(), metadata=(("authorization", f"Bearer {uncached}"),))
            assert list(reply.jobs) == []


class TestNegativeCache:
    def test_a_refused_key_sent_again_costs_no_query(
        self, key_queries: list[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _configure(monkeypatch, auth_lookups_per_minute=0)
        bad = random_key()
        for address in ("10.0.1.1", "10.0.1.2", "10.0.1.3"):  # from any address
            for _ in range(5):
                with pytest.raises(Unauthenticated):
                    _authenticate(bad, address)
        assert len(key_queries) == 1

    def test_a_key_that_becomes_valid_is_accepted_after_the_window(
        self, tenant_a: TenantHeaders, key_queries: list[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _configure(monkeypatch, auth_negative_cache_seconds=0.5, auth_lookups_per_minute=0)
        token = random_key()
        with pytest.raises(Unauthenticated):
            _authenticate(token, "10.0.2.1")
        with session_scope() as session:  # the key is issued afterwards (e.g. written by another process)
            session.add(ApiKey(id="key_later", tenant_id=tenant_a.tenant_id, prefix=lookup_prefix(token),
                               key_hash=hash_key(token)))
        refused_at = time.monotonic()
        with pytest.raises(Unauthenticated):  # within the window: refused from memory
            _authenticate(token, "10.0.2.1")
        assert len(key_queries) == 1
        time.sleep(max(0.0, 0.6 - (time.monotonic() - refused_at)))
        assert _authenticate(token, "10.0.2.1").tenant_id == tenant_a.tenant_id
        assert len(key_queries) == 2

    def test_zero_disables_the_negative_cache(self, key_queries: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
        _configure(monkeypatch, auth_negative_cache_seconds=0, auth_lookups_per_minute=0)
        bad = random_key()
        for _ in range(3):
            with pytest.raises(Unauthenticated):
                _authenticate(bad, "10.0.3.1")
        assert len(key_queries) == 3
