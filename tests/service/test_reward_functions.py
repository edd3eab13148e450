"""Reward-function registry API: create (secret once), list/get (never the secret), delete, rotate, isolation."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.kit.config import Settings
from service.kit.db import session_scope
from service.rewards.models import RewardFunction
from tests.service.factories import TenantHeaders

BODY: dict[str, Any] = {
    "name": "math-checker",
    "url": "https://rewards.example.com/score",
    "timeout_s": 5,
    "max_batch_size": 32,
    "max_concurrency": 2,
    "headers": {"Authorization": "Bearer endpoint-token", "X-Team": "ml"},
}


def create(client: TestClient, auth: dict[str, str], **overrides: Any) -> Any:
    return client.post("/v1/reward-functions", headers=auth, json={**BODY, **overrides})


def _secret_ok(secret: str) -> bool:
    return secret.startswith("whsec_") and len(base64.b64decode(secret.removeprefix("whsec_"))) == 24


class TestCreate:
    def test_create_returns_the_secret_once_and_stores_it_for_the_worker(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        response = create(client, tenant_a)
        assert response.status_code == 201, response.text
        body = response.json()
        assert body["id"].startswith("rf_") and _secret_ok(body["signing_secret"])
        assert body["url"] == BODY["url"] and body["timeout_s"] == 5
        assert body["max_batch_size"] == 32 and body["max_concurrency"] == 2
        assert body["headers"] == {"Authorization": "<redacted>", "X-Team": "<redacted>"}
        with session_scope() as session:
            row = session.get(RewardFunction, body["id"])
            assert row is not None
            assert row.signing_secret == body["signing_secret"]
            assert row.headers["Authorization"] == "Bearer endpoint-token"

    def test_defaults(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = client.post(
            "/v1/reward-functions", headers=tenant_a, json={"name": "r", "url": BODY["url"]}
        )
        assert response.status_code == 201, response.text
        body = response.json()
        assert (body["timeout_s"], body["max_batch_size"], body["max_concurrency"], body["headers"]) == (
            10.0,
            64,
            4,
            {},
        )
        policy = ("max_attempts", "backoff_s", "breaker_threshold", "step_deadline_s", "max_abstain_fraction")
        assert tuple(body[name] for name in policy) == (5, 0.5, 3, 300.0, 0.25)

    def test_failure_policy_is_stored_for_the_worker(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        policy = {"max_attempts": 2, "backoff_s": 0.1, "breaker_threshold": 7, "step_deadline_s": 30.0,
                  "max_abstain_fraction": 0.5}
        response = create(client, tenant_a, **policy)
        assert response.status_code == 201, response.text
        assert {name: response.json()[name] for name in policy} == policy
        with session_scope() as session:
            row = session.get(RewardFunction, response.json()["id"])
            assert row is not None
            assert {name: getattr(row, name) for name in policy} == policy

    @pytest.mark.parametrize(
        ("override", "field"),
        [
            ({"timeout_s": 0}, "timeout_s"),
            ({"timeout_s": 301}, "timeout_s"),
            ({"max_batch_size": 0}, "max_batch_size"),
            ({"max_batch_size": 5000}, "max_batch_size"),
            ({"max_concurrency": 65}, "max_concurrency"),
            ({"name": ""}, "name"),
            ({"headers": {"Content-Type": "text/plain"}}, "headers"),
            ({"headers": {"webhook-signature": "v1,x"}}, "headers"),
            ({"headers": {"Host": "internal"}}, "headers"),
            ({"headers": {"X-A": "a\r\nX-B: b"}}, "headers.X-A"),
            ({"headers": {"bad name": "x"}}, "headers"),
            ({"unknown": 1}, "unknown"),
            ({"max_attempts": 0}, "max_attempts"),
            ({"max_attempts": 11}, "max_attempts"),
            ({"backoff_s": 0.01}, "backoff_s"),
            ({"backoff_s": 31}, "backoff_s"),
            ({"breaker_threshold": 0}, "breaker_threshold"),
            ({"breaker_threshold": 21}, "breaker_threshold"),
            ({"step_deadline_s": 0.5}, "step_deadline_s"),
            ({"step_deadline_s": 3601}, "step_deadline_s"),
            ({"max_abstain_fraction": -0.1}, "max_abstain_fraction"),
            ({"max_abstain_fraction": 1.5}, "max_abstain_fraction"),
        ],
    )
    def test_bad_fields_are_422_naming_the_field(
        self, client: TestClient, tenant_a: TenantHeaders, override: dict[str, Any], field: str
    ) -> None:
        response = create(client, tenant_a, **override)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "validation_error"
        assert error["details"][0]["field"] == f"body.{field}"

    @pytest.mark.parametrize(
        "url",
        [
            "ftp://rewards.example.com/x",
            "https://user:pw@rewards.example.com/x",
            "file:///etc/passwd",
            "not a url",
        ],
    )
    def test_bad_urls_are_rejected(self, client: TestClient, tenant_a: TenantHeaders, url: str) -> None:
        response = create(client, tenant_a, url=url)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "url_rejected"

    def test_private_urls_follow_the_setting(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert settings.allow_private_reward_urls is True  # development default
        assert create(client, tenant_a, url="http://127.0.0.1:9000/score").status_code == 201
        monkeypatch.setattr(settings, "allow_private_reward_urls", False)
        response = create(client, tenant_a, url="https://127.0.0.1:9000/score")
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "url_rejected"


class TestReadDeleteRotate:
    def test_every_header_value_is_redacted_on_read(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        # Names that do not look secret carry credentials too.
        headers = {"X-Credential": "c-123", "X-Pass": "hunter2", "X-Api": "ak-77f3", "Authorization": "Bearer t0k-9"}
        created = create(client, tenant_a, headers=headers)
        assert created.status_code == 201, created.text
        one = client.get(f"/v1/reward-functions/{created.json()['id']}", headers=tenant_a).json()
        listed = client.get("/v1/reward-functions", headers=tenant_a).json()["data"][0]
        for shown in (created.json()["headers"], one["headers"], listed["headers"]):
            assert shown == dict.fromkeys(headers, "<redacted>")
        for secret in headers.values():
            assert secret not in created.text and secret not in str(one) and secret not in str(listed)

    def test_list_and_get_never_show_the_secret(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        ids = [create(client, tenant_a, name=f"r{i}").json()["id"] for i in range(3)]
        one = client.get(f"/v1/reward-functions/{ids[0]}", headers=tenant_a)
        assert one.status_code == 200 and "signing_secret" not in one.json()
        assert one.json()["headers"]["Authorization"] == "<redacted>"
        page = client.get("/v1/reward-functions?limit=2", headers=tenant_a).json()
        assert [r["id"] for r in page["data"]] == [ids[2], ids[1]] and page["has_more"]
        rest = client.get(f"/v1/reward-functions?after={page['next_after']}", headers=tenant_a).json()
        assert [r["id"] for r in rest["data"]] == [ids[0]] and not rest["has_more"]
        assert all("signing_secret" not in r for r in page["data"] + rest["data"])
        assert "whsec_" not in client.get("/v1/reward-functions", headers=tenant_a).text

    def test_rotate_secret_returns_a_new_secret(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        created = create(client, tenant_a).json()
        rotated = client.post(f"/v1/reward-functions/{created['id']}/rotate-secret", headers=tenant_a)
        assert rotated.status_code == 200, rotated.text
        secret = rotated.json()["signing_secret"]
        assert _secret_ok(secret) and secret != created["signing_secret"]
        with session_scope() as session:
            row = session.get(RewardFunction, created["id"])
            assert row is not None and row.signing_secret == secret

    def test_delete_hides_it_but_keeps_the_row_for_running_jobs(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        rf_id = create(client, tenant_a).json()["id"]
        assert client.delete(f"/v1/reward-functions/{rf_id}", headers=tenant_a).status_code == 204
        assert client.get(f"/v1/reward-functions/{rf_id}", headers=tenant_a).status_code == 404
        assert client.delete(f"/v1/reward-functions/{rf_id}", headers=tenant_a).status_code == 404
        assert client.post(f"/v1/reward-functions/{rf_id}/rotate-secret", headers=tenant_a).status_code == 404
        assert client.get("/v1/reward-functions", headers=tenant_a).json()["data"] == []
        with session_scope() as session:
            row = session.get(RewardFunction, rf_id)
            assert row is not None and row.deleted_at is not None

    def test_other_tenants_function_is_the_same_404_as_a_random_id(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        rf_id = create(client, tenant_a).json()["id"]
        random_id = "rf_01J00000000000000000000000"
        for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/rotate-secret")):
            theirs = client.request(method, f"/v1/reward-functions/{rf_id}{suffix}", headers=tenant_b)
            missing = client.request(method, f"/v1/reward-functions/{random_id}{suffix}", headers=tenant_b)
            assert theirs.status_code == missing.status_code == 404
            assert theirs.text == missing.text.replace(random_id, rf_id)
        assert client.get("/v1/reward-functions", headers=tenant_b).json()["data"] == []
        assert client.get(f"/v1/reward-functions/{rf_id}", headers=tenant_a).status_code == 200
