"""POST /v1/reward-functions/{id}/test against real loopback reward servers, and registration's DNS check.

The servers verify every signature with the user helpers; failures must come back with the code a job would
fail with and the endpoint's precise reason.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.kit.config import Settings
from service.kit.errors import UrlNotAllowed
from service.rewards.service import check_registration_url
from tests.service.factories import TenantHeaders
from tests.worker.grpc_reward_servers import GrpcRewardServer, running_grpc
from tests.worker.reward_servers import Fault, RewardServer, closed_port, new_secret, running

ITEMS: list[dict[str, Any]] = [
    {"prompt": "2+2=", "completion": "4", "metadata": {"answer": "4"}, "group_id": 0},
    {"prompt": "2+2=", "completion": "five", "metadata": {"answer": "4"}, "group_id": 0},
]


def register(client: TestClient, auth: TenantHeaders, url: str, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/reward-functions", headers=auth, json={"name": "judge", "url": url, **fields})
    assert response.status_code == 201, response.text
    return dict(response.json())


def dry_run(client: TestClient, auth: TenantHeaders, rf_id: str, items: Sequence[dict[str, Any]] = ITEMS) -> Any:
    return client.post(f"/v1/reward-functions/{rf_id}/test", headers=auth, json={"items": list(items)})


class TestDryRunHttp:
    def test_scores_with_a_signed_request_the_server_verifies(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        with running(RewardServer(new_secret())) as server:
            rf = register(client, tenant_a, server.url, headers={"Authorization": "Bearer t0k"})
            server.secret = rf["signing_secret"]  # the server verifies with the secret the API issued
            response = dry_run(client, tenant_a, rf["id"])
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["rewards"] == [1.0, 4.0] and body["latency_ms"] > 0
        assert server.rejected == [] and server.received == 1
        seen = server.seen[0]
        assert seen.headers["authorization"] == "Bearer t0k"
        sent = json.loads(seen.body)
        assert (sent["job_id"], sent["step"]) == ("test", 0)
        assert [i["metadata"] for i in sent["items"]] == [{"answer": "4"}, {"answer": "4"}]

    def test_batches_like_a_job(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        with running(RewardServer(new_secret())) as server:
            rf = register(client, tenant_a, server.url, max_batch_size=2)
            server.secret = rf["signing_secret"]
            items = [{"prompt": f"p{i}", "completion": "x" * i, "group_id": i} for i in range(5)]
            response = dry_run(client, tenant_a, rf["id"], items)
        assert response.status_code == 200, response.text
        assert response.json()["rewards"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert sorted(len(s.request.items) for s in server.seen) == [1, 2, 2]

    def test_invalid_response_is_422_with_the_precise_reason(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        plan = lambda n, r: Fault(body=b'{"rewards": [1.0]}')  # noqa: E731
        with running(RewardServer(new_secret(), faults=plan)) as server:
            rf = register(client, tenant_a, server.url)
            server.secret = rf["signing_secret"]
            response = dry_run(client, tenant_a, rf["id"])
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "reward_endpoint_invalid_response"
        assert "rewards has 1 values for 2 items" in error["message"] and server.url in error["message"]
        assert error["details"] == {"reward_function_id": rf["id"]}
        assert server.received == 1  # one attempt, no retries

    def test_permanent_http_error_is_422_with_status(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        with running(RewardServer(new_secret(), faults=lambda n, r: Fault(status=400, body=b"no"))) as server:
            rf = register(client, tenant_a, server.url)
            server.secret = rf["signing_secret"]
            response = dry_run(client, tenant_a, rf["id"])
        error = response.json()["error"]
        assert response.status_code == 422 and error["code"] == "reward_endpoint_http_error"
        assert error["details"]["status"] == 400 and "answered HTTP 400" in error["message"]

    def test_unreachable_endpoint_is_424(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        rf = register(client, tenant_a, f"http://127.0.0.1:{closed_port()}/score")
        response = dry_run(client, tenant_a, rf["id"])
        error = response.json()["error"]
        assert response.status_code == 424 and error["code"] == "reward_endpoint_unavailable"
        assert "connection failed" in error["message"] and "gave up after 1 attempts" in error["message"]

    def test_other_tenant_and_unknown_ids_are_the_same_404(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        with running(RewardServer(new_secret())) as server:
            rf = register(client, tenant_a, server.url)
            theirs = dry_run(client, tenant_b, rf["id"])
            unknown = dry_run(client, tenant_b, "rf_unknown")
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json()["error"]["message"].replace(rf["id"], "X") == unknown.json()["error"]["message"].replace(
            "rf_unknown", "X"
        )
        assert server.received == 0  # nothing was called on the other tenant's behalf

    @pytest.mark.parametrize(
        ("items", "field"),
        [([], "body.items"), ([{"prompt": "p", "completion": "c"}] * 65, "body.items"), ([{"prompt": "p"}], "body.items.0.completion")],
    )
    def test_bad_body_names_the_field(
        self, client: TestClient, tenant_a: TenantHeaders, items: list[dict[str, Any]], field: str
    ) -> None:
        rf = register(client, tenant_a, "http://127.0.0.1:9/score")
        response = dry_run(client, tenant_a, rf["id"], items)
        assert response.status_code == 422
        assert response.json()["error"]["details"][0]["field"] == field

    def test_function_registered_in_development_is_refused_in_production(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        rf = register(client, tenant_a, "http://127.0.0.1:9/score")
        monkeypatch.setattr(settings, "allow_private_reward_urls", False)
        error = dry_run(client, tenant_a, rf["id"]).json()["error"]
        assert error["code"] == "reward_endpoint_url_rejected" and "not allowed" in error["message"]


class TestDryRunGrpc:
    def test_grpc_endpoint_scores_with_verified_metadata_signature(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        with running_grpc(GrpcRewardServer(new_secret())) as server:
            rf = register(client, tenant_a, server.url, headers={"Authorization": "Bearer t0k"})
            assert rf["url"] == server.url
            server.secret = rf["signing_secret"]
            response = dry_run(client, tenant_a, rf["id"])
        assert response.status_code == 200, response.text
        assert response.json()["rewards"] == [1.0, 4.0]
        assert server.rejected == [] and server.seen[0].metadata["authorization"] == "Bearer t0k"
        assert server.seen[0].request.job_id == "test"
        assert json.loads(server.seen[0].request.items[0].extras_json["answer"]) == "4"

    def test_grpc_headers_must_be_valid_metadata_at_registration(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        response = client.post(
            "/v1/reward-functions",
            headers=tenant_a,
            # A tab is HTTP header text, but not gRPC metadata.
            json={"name": "g", "url": "grpc://127.0.0.1:50051", "headers": {"x-name": "a\tb"}},
        )
        assert response.status_code == 422 and "printable ASCII" in response.text


class TestRegistrationResolves:
    def test_hostname_resolving_to_loopback_is_refused_in_production(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # This machine's own name resolves (via /etc/hosts) to a loopback or private address: a real lookup.
        name = socket.gethostname().lower()
        try:
            answers = {str(info[4][0]) for info in socket.getaddrinfo(name, 443, type=socket.SOCK_STREAM)}
        except OSError:
            pytest.skip(f"{name!r} does not resolve here")
        if name == "localhost" or not all(a.startswith(("127.", "10.", "192.168.", "172.", "::1")) for a in answers):
            pytest.skip(f"{name!r} resolves to {answers}, not only to private addresses")
        monkeypatch.setattr(settings, "allow_private_reward_urls", False)
        response = client.post(
            "/v1/reward-functions", headers=tenant_a, json={"name": "r", "url": f"https://{name}:8443/score"}
        )
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "url_rejected" and f"{name} resolves to a" in error["message"]
        assert not any(answer in response.text for answer in answers)  # the internal addresses stay unsaid

    def test_every_answer_is_checked_and_development_skips_the_lookup(self) -> None:
        answers: list[list[str]] = [["93.184.215.14"], ["93.184.215.14", "10.0.0.7"]]
        asked: list[str] = []

        async def resolver(host: str, port: int) -> list[str]:
            asked.append(host)
            return answers[len(asked) - 1]

        url = "https://rewards.example.com/score"
        assert check_registration_url(url, allow_private=False, resolver=resolver) == url
        with pytest.raises(UrlNotAllowed, match=r"^url host rewards.example.com resolves to a private address$"):
            check_registration_url(url, allow_private=False, resolver=resolver)
        assert check_registration_url("grpc://reward-dev:50051", allow_private=True, resolver=resolver)
        assert asked == ["rewards.example.com", "rewards.example.com"]  # development: no lookup
