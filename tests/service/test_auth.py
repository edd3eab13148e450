"""API-key authentication: `authenticate_on_loop()` directly and the 401s of the REST API."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from service.kit.db import session_scope
from service.kit.errors import Unauthenticated
from service.tenants.auth import TenantContext, authenticate_on_loop
from service.tenants.keys import hash_key
from service.tenants.models import ApiKey
from tests.service.factories import TenantHeaders, auth_headers


def _authenticate(token: str | None) -> TenantContext:
    return asyncio.run(authenticate_on_loop(token))


class TestAuthenticate:
    def test_valid_key_resolves_to_its_tenant(self, tenant_a: TenantHeaders, tenant_b: TenantHeaders) -> None:
        assert _authenticate(tenant_a.api_key).tenant_id == tenant_a.tenant_id
        assert _authenticate(tenant_b.api_key).tenant_id == tenant_b.tenant_id

    def test_only_hash_and_prefix_are_stored(self, tenant_a: TenantHeaders) -> None:
        with session_scope() as session:
            key = session.query(ApiKey).filter_by(tenant_id=tenant_a.tenant_id).one()
            assert key.key_hash == hash_key(tenant_a.api_key)
            assert tenant_a.api_key.startswith("grpo_sk_")
            assert key.prefix in tenant_a.api_key and len(key.prefix) < len(tenant_a.api_key) // 2

    @pytest.mark.parametrize("token", [None, "", "grpo_sk_short", "Bearer x", "grpo_sk_" + "A" * 43])
    def test_bad_tokens_are_rejected(self, tenant_a: TenantHeaders, token: str | None) -> None:
        with pytest.raises(Unauthenticated):
            _authenticate(token)

    def test_same_prefix_wrong_secret_is_rejected(self, tenant_a: TenantHeaders) -> None:
        tampered = tenant_a.api_key[:-4] + ("AAAA" if not tenant_a.api_key.endswith("AAAA") else "BBBB")
        with pytest.raises(Unauthenticated):
            _authenticate(tampered)

    def test_revoked_key_is_rejected(self, tenant_a: TenantHeaders) -> None:
        from service.kit.db import utcnow

        with session_scope() as session:
            session.query(ApiKey).filter_by(tenant_id=tenant_a.tenant_id).update({"revoked_at": utcnow()})
        with pytest.raises(Unauthenticated):
            _authenticate(tenant_a.api_key)


class TestRest401:
    @pytest.mark.parametrize(
        "headers",
        [
            {},
            {"Authorization": "Basic dXNlcjpwYXNz"},
            auth_headers("grpo_sk_nope"),
            {"Authorization": "Bearer"},
        ],
    )
    def test_missing_or_invalid_key_is_401_in_error_shape(
        self, client: TestClient, tenant_a: TenantHeaders, headers: dict[str, str]
    ) -> None:
        for path in ("/v1/datasets", "/v1/reward-functions"):
            response = client.get(path, headers=headers)
            assert response.status_code == 401, response.text
            body = response.json()
            assert body["error"]["code"] == "unauthenticated"
            assert body["error"]["message"]

    def test_valid_key_is_accepted(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        assert client.get("/v1/datasets", headers=tenant_a).status_code == 200
