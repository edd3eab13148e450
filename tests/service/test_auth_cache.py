"""The in-process cache of authenticated API keys: hits skip the database, revocation in this process is
immediate, elsewhere it waits at most GRPO_AUTH_CACHE_SECONDS, 0 disables it, and the cache is bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from service.kit import db as kit_db
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope, utcnow
from service.kit.errors import NotFound, ServiceUnavailable, Unauthenticated
from service.tenants import auth
from service.tenants import service as tenants
from service.tenants.auth import KEY_CACHE, TenantContext, authenticate_on_loop
from service.tenants.keycache import KeyCache
from service.tenants.models import ApiKey
from tests.service.factories import TenantHeaders


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    KEY_CACHE.clear()
    yield
    KEY_CACHE.clear()


@pytest.fixture
def statements(settings: Settings) -> Iterator[list[str]]:
    """Every SQL statement the service's engine sends while the test runs."""
    sent: list[str] = []
    engine = kit_db.get_engine()

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    yield sent
    event.remove(engine, "before_cursor_execute", record)


@pytest.fixture
def reads_through_sqlalchemy(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The polled reads through SQLAlchemy on PostgreSQL too, where `statements` sees them (test_reads.py
    covers the asyncpg path)."""
    monkeypatch.setenv("GRPO_DB_ASYNC_READS", "false")
    get_settings.cache_clear()


def _set_ttl(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setenv("GRPO_AUTH_CACHE_SECONDS", str(seconds))
    get_settings.cache_clear()


def _revoke_in_database(tenant_id: str) -> None:
    """What another process (another uvicorn worker, a script) revoking the key looks like to this one."""
    with session_scope() as session:
        session.query(ApiKey).filter_by(tenant_id=tenant_id).update({"revoked_at": utcnow()})


def _authenticate(token: str | None) -> TenantContext:
    return asyncio.run(authenticate_on_loop(token))


class TestCache:
    def test_second_authentication_sends_no_sql(self, tenant_a: TenantHeaders, statements: list[str]) -> None:
        assert _authenticate(tenant_a.api_key).tenant_id == tenant_a.tenant_id
        looked_up = len(statements)
        assert any("api_keys" in s for s in statements)
        assert _authenticate(tenant_a.api_key).tenant_id == tenant_a.tenant_id
        assert len(statements) == looked_up

    def test_get_job_with_a_cached_key_is_one_query(
        self, reads_through_sqlalchemy: None, client: TestClient, tenant_a: TenantHeaders, statements: list[str]
    ) -> None:
        missing = client.get("/v1/jobs/job_nope", headers=tenant_a)  # authenticates (and caches)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        statements.clear()
        assert client.get("/v1/jobs/job_nope", headers=tenant_a).status_code == 404
        selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
        assert len(selects) == 1 and "jobs" in selects[0] and "api_keys" not in selects[0], statements

    def test_wrong_keys_are_never_cached(self, tenant_a: TenantHeaders) -> None:
        wrong = tenant_a.api_key[:-4] + ("AAAA" if not tenant_a.api_key.endswith("AAAA") else "BBBB")
        for _ in range(2):
            with pytest.raises(Unauthenticated):
                _authenticate(wrong)
        assert len(KEY_CACHE) == 0


class TestRevocation:
    def test_revoked_in_this_process_is_refused_at_once(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200  # cached now
        with session_scope() as session:
            key_id = session.query(ApiKey).filter_by(tenant_id=tenant_a.tenant_id).one().id
            tenants.revoke_api_key(session, tenant_a.tenant_id, key_id)
        response = client.get("/v1/jobs", headers=tenant_a)
        assert response.status_code == 401 and response.json()["error"]["code"] == "unauthenticated"

    def test_rolled_back_revocation_keeps_the_key(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200
        with pytest.raises(RuntimeError), session_scope() as session:
            key_id = session.query(ApiKey).filter_by(tenant_id=tenant_a.tenant_id).one().id
            tenants.revoke_api_key(session, tenant_a.tenant_id, key_id)
            raise RuntimeError("abort")
        KEY_CACHE.clear()  # a database lookup must find the key still active
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200

    def test_other_tenants_key_is_not_found(self, tenant_a: TenantHeaders, tenant_b: TenantHeaders) -> None:
        with session_scope() as session:
            key_id = session.query(ApiKey).filter_by(tenant_id=tenant_a.tenant_id).one().id
            with pytest.raises(NotFound):
                tenants.revoke_api_key(session, tenant_b.tenant_id, key_id)

    def test_revoked_elsewhere_is_refused_after_the_ttl(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _set_ttl(monkeypatch, 0.5)
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200
        _revoke_in_database(tenant_a.tenant_id)
        # The documented delay: still accepted from the cache...
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200
        time.sleep(0.6)
        # ...and refused once the entry expired.
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 401

    def test_zero_disables_the_cache(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _set_ttl(monkeypatch, 0)
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 200
        assert len(KEY_CACHE) == 0
        _revoke_in_database(tenant_a.tenant_id)
        assert client.get("/v1/jobs", headers=tenant_a).status_code == 401


DEAD_DATABASE = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere?connect_timeout=2"  # nothing listens on port 1


def _key_lookups(statements: list[str]) -> int:
    """SELECTs of keys (the once-a-minute UPDATE of last_used_at is no lookup)."""
    return sum("api_keys" in s and s.lstrip().upper().startswith("SELECT") for s in statements)


async def _lookups_settled() -> None:
    """Wait for this loop's background key lookups to finish."""
    for _ in range(500):
        if not auth._LOOKUPS.get(asyncio.get_running_loop()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a key lookup never finished")


def _near_its_end(api_key: str, tenant: TenantContext) -> None:
    """The key's entry with 10 s of its 100 left: inside the refresh window (the last fifth)."""
    KEY_CACHE.put(auth.hash_key(api_key), tenant, 10)


class TestOnTheLoop:
    """`authenticate_on_loop`, what REST and gRPC call: one lookup per key at a time, refreshed before expiry."""

    def test_concurrent_misses_of_one_key_share_one_lookup(
        self, tenant_a: TenantHeaders, statements: list[str]
    ) -> None:
        async def many() -> list[str]:
            tenants_seen = await asyncio.gather(*(authenticate_on_loop(tenant_a.api_key) for _ in range(20)))
            return [t.tenant_id for t in tenants_seen]

        assert asyncio.run(many()) == [tenant_a.tenant_id] * 20
        assert _key_lookups(statements) == 1

    def test_a_caller_that_goes_away_does_not_cancel_the_others_lookup(self, tenant_a: TenantHeaders) -> None:
        async def one_cancelled() -> str:
            leaving = asyncio.create_task(authenticate_on_loop(tenant_a.api_key))
            staying = asyncio.create_task(authenticate_on_loop(tenant_a.api_key))
            await asyncio.sleep(0)
            leaving.cancel()
            return (await staying).tenant_id

        assert asyncio.run(one_cancelled()) == tenant_a.tenant_id

    def test_a_key_in_use_is_refreshed_before_it_expires(
        self, tenant_a: TenantHeaders, statements: list[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _set_ttl(monkeypatch, 100)

        async def poll() -> tuple[int, float]:
            tenant = await authenticate_on_loop(tenant_a.api_key)
            first = _key_lookups(statements)
            _near_its_end(tenant_a.api_key, tenant)
            assert (await authenticate_on_loop(tenant_a.api_key)) == tenant  # answered from the entry
            await _lookups_settled()
            entry = KEY_CACHE.lookup(auth.hash_key(tenant_a.api_key))
            assert entry is not None
            return _key_lookups(statements) - first, entry[1]

        refreshes, seconds_left = asyncio.run(poll())
        assert refreshes == 1
        assert seconds_left > 50  # a fresh entry, not the old one's last 10 s

    def test_a_refresh_that_finds_the_key_revoked_refuses_it_at_once(
        self, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _set_ttl(monkeypatch, 100)

        async def revoked_meanwhile() -> None:
            tenant = await authenticate_on_loop(tenant_a.api_key)
            _revoke_in_database(tenant_a.tenant_id)
            _near_its_end(tenant_a.api_key, tenant)
            await authenticate_on_loop(tenant_a.api_key)  # still inside the documented delay: accepted
            await _lookups_settled()
            with pytest.raises(Unauthenticated):  # though the entry had 10 s left
                await authenticate_on_loop(tenant_a.api_key)

        asyncio.run(revoked_meanwhile())

    def test_a_refresh_while_the_database_is_down_keeps_the_key_until_its_entry_expires(
        self, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _set_ttl(monkeypatch, 100)

        async def outage() -> None:
            tenant = await authenticate_on_loop(tenant_a.api_key)
            monkeypatch.setenv("GRPO_DATABASE_URL", DEAD_DATABASE)
            get_settings.cache_clear()
            _near_its_end(tenant_a.api_key, tenant)
            assert (await authenticate_on_loop(tenant_a.api_key)) == tenant  # its refresh fails in the background
            await _lookups_settled()
            # A database outage is not a revocation: the key still answers for the rest of its entry.
            assert (await authenticate_on_loop(tenant_a.api_key)) == tenant
            KEY_CACHE.clear()
            with pytest.raises(ServiceUnavailable):  # and a miss now is a 503, not a 401 or a 500
                await authenticate_on_loop(tenant_a.api_key)

        asyncio.run(outage())

    def test_no_key_is_refused_without_a_lookup(self, settings: Settings, statements: list[str]) -> None:
        with pytest.raises(Unauthenticated, match="missing API key"):
            asyncio.run(authenticate_on_loop(None))
        assert _key_lookups(statements) == 0


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_unreachable_database_on_a_key_lookup_is_a_503(
    tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.app import create_app

    monkeypatch.setenv("GRPO_DATABASE_URL", DEAD_DATABASE)
    get_settings.cache_clear()
    with TestClient(create_app()) as client:
        response = client.get("/v1/jobs", headers=tenant_a)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "service_unavailable"


@dataclass(frozen=True)
class _Ctx:
    api_key_id: str


class TestKeyCacheUnit:
    def test_bounded_evicting_the_oldest(self) -> None:
        cache: KeyCache[_Ctx] = KeyCache(max_entries=3)
        for i in range(5):
            cache.put(f"h{i}", _Ctx(f"k{i}"), 60)
        assert len(cache) == 3
        assert cache.get("h0") is None and cache.get("h1") is None
        assert cache.get("h4") == _Ctx("k4")

    def test_entries_expire(self) -> None:
        cache: KeyCache[_Ctx] = KeyCache()
        cache.put("h", _Ctx("k"), 0.05)
        assert cache.get("h") == _Ctx("k")
        time.sleep(0.06)
        assert cache.get("h") is None and len(cache) == 0

    def test_a_revocation_during_a_lookup_keeps_its_result_out(self) -> None:
        cache: KeyCache[_Ctx] = KeyCache()
        generation = cache.generation  # read before the lookup's SELECT
        cache.forget_key_id("k")  # the revocation commits meanwhile
        cache.put("h", _Ctx("k"), 60, generation)
        assert cache.get("h") is None
        cache.put("h", _Ctx("k"), 60, cache.generation)
        assert cache.get("h") == _Ctx("k")

    def test_forget_key_id_and_zero_ttl(self) -> None:
        cache: KeyCache[_Ctx] = KeyCache()
        cache.put("a", _Ctx("k1"), 60)
        cache.put("b", _Ctx("k2"), 60)
        cache.put("c", _Ctx("k3"), 0)  # ttl 0: not stored
        cache.forget_key_id("k1")
        assert cache.get("a") is None and cache.get("b") == _Ctx("k2") and cache.get("c") is None
