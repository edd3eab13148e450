"""Key management over the API: create, list, revoke; scopes, expiry and last use; `grpo admin` on the same
database from another process."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.kit import db as kit_db
from service.kit.config import Settings, get_settings
from service.tenants.auth import LAST_USED
from service.tenants.models import ApiKey
from tests.service.factories import TenantHeaders, auth_headers, create_key
from tests.service.test_cli_admin import grpo


@pytest.fixture
def key_of(tenant_a: TenantHeaders) -> Callable[..., dict[str, str]]:
    def make(*scopes: str) -> dict[str, str]:
        with kit_db.session_scope() as session:
            return auth_headers(create_key(session, tenant_a.tenant_id, scopes))

    return make


def _create(client: TestClient, headers: dict[str, str], **body: object) -> dict[str, object]:
    response = client.post("/v1/api-keys", json={"name": "ci", **body}, headers=headers)
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


class TestCreate:
    def test_an_admin_key_makes_a_key_with_exactly_its_scopes(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        created = _create(client, tenant_a, scopes=["read"])
        assert created["scopes"] == ["read"] and created["name"] == "ci" and created["revoked_at"] is None
        key = str(created["key"])
        assert key.startswith(str(created["prefix"]))
        assert client.get("/v1/jobs", headers=auth_headers(key)).status_code == 200
        refused = client.post("/v1/jobs/job_x/cancel", headers=auth_headers(key))
        assert refused.status_code == 403
        assert refused.json()["error"] == {
            "code": "insufficient_scope",
            "message": "this API key lacks the 'write' scope (it has: read)",
            "details": {"required_scope": "write", "key_scopes": ["read"]},
        }

    def test_default_scopes_are_read_and_write(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        created = _create(client, tenant_a)
        assert created["scopes"] == ["read", "write"]
        # ...so the new key cannot make keys itself.
        assert client.get("/v1/api-keys", headers=auth_headers(str(created["key"]))).status_code == 403

    @pytest.mark.parametrize("scopes", [["read"], ["read", "write"], ["write"]])
    def test_only_an_admin_key_manages_keys(
        self, client: TestClient, key_of: Callable[..., dict[str, str]], tenant_a: TenantHeaders, scopes: list[str]
    ) -> None:
        headers = key_of(*scopes)
        victim = _create(client, tenant_a)
        for response in (
            client.post("/v1/api-keys", json={"name": "x"}, headers=headers),
            client.get("/v1/api-keys", headers=headers),
            client.delete(f"/v1/api-keys/{victim['id']}", headers=headers),
        ):
            assert response.status_code == 403, response.text
            assert response.json()["error"]["details"]["required_scope"] == "admin"

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"name": "x", "scopes": ["read", "delete"]}, "body.scopes.1"),
            ({"name": "x", "scopes": []}, "body.scopes"),
            ({"name": ""}, "body.name"),
            ({"scopes": ["read"]}, "body.name"),
            ({"name": "x", "expires_at": "2030-01-01T00:00:00"}, "body.expires_at"),  # no time zone
            ({"name": "x", "expires_at": "2020-01-01T00:00:00Z"}, "expires_at"),  # in the past
            ({"name": "x", "owner": "someone"}, "body.owner"),
        ],
    )
    def test_bad_bodies_name_the_field(
        self, client: TestClient, tenant_a: TenantHeaders, body: dict[str, object], field: str
    ) -> None:
        response = client.post("/v1/api-keys", json=body, headers=tenant_a)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["details"][0]["field"] == field


class TestChildKeys:
    """A key made by a key never outgrows it: no scope the parent lacks, no expiry later than the parent's."""

    def test_an_admin_only_key_cannot_grant_scopes_it_lacks(
        self, client: TestClient, key_of: Callable[..., dict[str, str]]
    ) -> None:
        admin_only = key_of("admin")
        response = client.post(
            "/v1/api-keys", json={"name": "wide", "scopes": ["read", "write", "admin"]}, headers=admin_only
        )
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["code"] == "insufficient_scope" and error["message"].startswith("scopes: ")
        assert error["details"] == {"field": "scopes", "not_held": ["read", "write"], "key_scopes": ["admin"]}
        # The default scopes (read, write) are as much beyond it.
        assert client.post("/v1/api-keys", json={"name": "d"}, headers=admin_only).status_code == 403
        # What it has, it may grant.
        assert _create(client, admin_only, scopes=["admin"])["scopes"] == ["admin"]

    def test_a_key_grants_a_subset_of_its_scopes(
        self, client: TestClient, key_of: Callable[..., dict[str, str]]
    ) -> None:
        parent = key_of("read", "admin")
        assert _create(client, parent, scopes=["read"])["scopes"] == ["read"]
        refused = client.post("/v1/api-keys", json={"name": "x", "scopes": ["read", "write"]}, headers=parent)
        assert refused.status_code == 403 and refused.json()["error"]["details"]["not_held"] == ["write"]

    def test_a_key_expiring_soon_cannot_make_a_key_that_outlives_it(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GRPO_AUTH_CACHE_SECONDS", "60")
        get_settings.cache_clear()
        parent_expiry = datetime.now(UTC) + timedelta(seconds=3)
        with kit_db.session_scope() as session:
            parent = auth_headers(create_key(session, tenant_a.tenant_id, ["read", "admin"], expires_at=parent_expiry))
        for body in ({"name": "forever", "scopes": ["read"]},  # no expiry under an expiring parent
                     {"name": "later", "scopes": ["read"],
                      "expires_at": (parent_expiry + timedelta(seconds=1)).isoformat()}):
            response = client.post("/v1/api-keys", json=body, headers=parent)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["message"].startswith("expires_at: ") and error["details"][0]["field"] == "expires_at"
        child_expiry = parent_expiry - timedelta(seconds=1)
        child = _create(client, parent, scopes=["read"], expires_at=child_expiry.isoformat())
        assert datetime.fromisoformat(str(child["expires_at"]).replace("Z", "+00:00")) <= parent_expiry
        child_headers = auth_headers(str(child["key"]))
        assert client.get("/v1/jobs", headers=child_headers).status_code == 200
        # Once the parent has expired, so has every key it made.
        time.sleep(max(0.0, (parent_expiry - datetime.now(UTC)).total_seconds()) + 0.1)
        assert client.get("/v1/jobs", headers=parent).status_code == 401
        assert client.get("/v1/jobs", headers=child_headers).status_code == 401


class TestKeyCap:
    def test_active_keys_per_tenant_are_capped(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GRPO_MAX_API_KEYS_PER_TENANT", "3")
        get_settings.cache_clear()
        with kit_db.session_scope() as session:  # an expired key does not count
            create_key(session, tenant_a.tenant_id, ["read"], expires_at=datetime.now(UTC) - timedelta(hours=1))
        made = [_create(client, tenant_a, name=f"k{n}") for n in range(2)]  # with the fixture's key: 3
        refused = client.post("/v1/api-keys", json={"name": "one-too-many"}, headers=tenant_a)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "too_many_api_keys" and "GRPO_MAX_API_KEYS_PER_TENANT" in error["message"]
        assert error["details"] == {"limit": 3, "current": 3, "setting": "GRPO_MAX_API_KEYS_PER_TENANT"}
        assert _create(client, tenant_b, name="other-tenant")  # per tenant
        # A revoked key frees its place.
        assert client.delete(f"/v1/api-keys/{made[0]['id']}", headers=tenant_a).status_code == 204
        assert _create(client, tenant_a, name="again")


class TestListAndRevoke:
    def test_list_shows_the_tenants_keys_only_revoked_ones_included(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        made = _create(client, tenant_a, name="to-revoke")
        assert client.delete(f"/v1/api-keys/{made['id']}", headers=tenant_a).status_code == 204
        assert client.delete(f"/v1/api-keys/{made['id']}", headers=tenant_a).status_code == 204  # idempotent
        listed = client.get("/v1/api-keys", headers=tenant_a).json()["data"]
        assert len(listed) == 2  # the fixture's key and this one
        revoked = next(k for k in listed if k["id"] == made["id"])
        assert revoked["revoked_at"] is not None and "key" not in revoked
        other = client.get("/v1/api-keys", headers=tenant_b).json()["data"]
        assert made["id"] not in {k["id"] for k in other}
        assert client.delete(f"/v1/api-keys/{made['id']}", headers=tenant_b).status_code == 404

    def test_a_revoked_key_is_refused_at_once_by_the_process_that_revoked_it(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        made = _create(client, tenant_a)
        headers = auth_headers(str(made["key"]))
        assert client.get("/v1/jobs", headers=headers).status_code == 200  # now cached
        assert client.delete(f"/v1/api-keys/{made['id']}", headers=tenant_a).status_code == 204
        assert client.get("/v1/jobs", headers=headers).status_code == 401

    def test_pagination(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        for n in range(3):
            _create(client, tenant_a, name=f"k{n}")
        first = client.get("/v1/api-keys?limit=2", headers=tenant_a).json()
        assert first["has_more"] is True and [k["name"] for k in first["data"]] == ["k2", "k1"]
        rest = client.get(f"/v1/api-keys?limit=2&after={first['next_after']}", headers=tenant_a).json()
        assert [k["name"] for k in rest["data"]] == ["k0", ""] and rest["has_more"] is False  # "": the fixture's


class TestExpiry:
    def test_an_expired_key_is_refused_even_when_cached(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GRPO_AUTH_CACHE_SECONDS", "60")  # the cache must not outlive the key
        get_settings.cache_clear()
        expires = datetime.now(UTC) + timedelta(seconds=1.5)
        made = _create(client, tenant_a, expires_at=expires.isoformat())
        headers = auth_headers(str(made["key"]))
        assert client.get("/v1/jobs", headers=headers).status_code == 200
        time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.1)
        response = client.get("/v1/jobs", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "unauthenticated"


class TestLastUsed:
    def test_written_on_use_at_most_once_per_resolution(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        made = _create(client, tenant_a)
        headers = auth_headers(str(made["key"]))
        assert client.get("/v1/jobs", headers=headers).status_code == 200
        assert _wait_for_last_used(client, tenant_a, str(made["id"]), lambda v: v is not None)
        # Another request within the minute writes nothing: the marker set below stays.
        long_ago = datetime(2000, 1, 1, tzinfo=UTC)
        with kit_db.session_scope() as session:
            session.execute(update(ApiKey).where(ApiKey.id == made["id"]).values(last_used_at=long_ago))
        assert client.get("/v1/jobs", headers=headers).status_code == 200
        time.sleep(0.5)
        assert _last_used(client, tenant_a, str(made["id"])) == long_ago.isoformat().replace("+00:00", "Z")
        # Once the resolution has passed, the next request writes again.
        monkeypatch.setattr(LAST_USED, "resolution_s", 0.0)
        assert client.get("/v1/jobs", headers=headers).status_code == 200
        assert _wait_for_last_used(client, tenant_a, str(made["id"]), lambda v: v is not None and v > "2001")


def _last_used(client: TestClient, admin: TenantHeaders, key_id: str) -> str | None:
    keys = client.get("/v1/api-keys", headers=admin).json()["data"]
    value: str | None = next(k for k in keys if k["id"] == key_id)["last_used_at"]
    return value


def _wait_for_last_used(
    client: TestClient, admin: TenantHeaders, key_id: str, ok: Callable[[str | None], bool]
) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if ok(_last_used(client, admin, key_id)):
            return True
        time.sleep(0.05)
    return False


class TestAdminCli:
    def test_create_list_revoke_from_the_shell_is_honoured_within_the_cache_window(
        self, client: TestClient, settings: Settings, tenant_a: TenantHeaders, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("GRPO_AUTH_CACHE_SECONDS", "2")
        get_settings.cache_clear()
        url = settings.database_url
        made = grpo("admin", "create-key", tenant_a.tenant_id, "--scope", "read", "--name", "dashboard",
                    "--json", database_url=url, tmp_path=tmp_path)
        assert made.returncode == 0, made.stderr
        created = json.loads(made.stdout)
        assert created["scopes"] == ["read"] and created["name"] == "dashboard"
        headers = auth_headers(created["key"])
        assert client.get("/v1/jobs", headers=headers).status_code == 200
        assert client.post("/v1/jobs/job_x/cancel", headers=headers).status_code == 403

        listed = grpo("admin", "list-keys", tenant_a.tenant_id, "--json", database_url=url, tmp_path=tmp_path)
        assert created["id"] in {k["id"] for k in json.loads(listed.stdout)}

        revoked = grpo("admin", "revoke-key", tenant_a.tenant_id, created["id"], database_url=url, tmp_path=tmp_path)
        assert revoked.returncode == 0, revoked.stderr
        revoked_at = time.monotonic()
        # Another process revoked it: this one refuses it once its cached entry (<= 2 s) expires.
        while client.get("/v1/jobs", headers=headers).status_code == 200:
            assert time.monotonic() - revoked_at < 2.5
            time.sleep(0.1)
        assert client.get("/v1/jobs", headers=headers).status_code == 401
