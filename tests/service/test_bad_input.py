"""Input the database or an HTTP client cannot take is a 422 naming the field, on SQLite and PostgreSQL:
NUL characters (PostgreSQL text cannot hold them), integers beyond the columns' range, reward headers that
are not HTTP header text, non-finite numbers. An unhandled error is the JSON error shape, never text/plain.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.app import create_app
from service.jobs import progress
from service.jobs.schemas import SampleIn
from service.kit.config import Settings
from service.kit.db import session_scope
from service.rewards.models import RewardFunction
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset, start_job
from tests.worker.reward_servers import start_uvicorn, stop_uvicorn

BEYOND_INT64 = "99999999999999999999"
BEYOND_INT32 = str(2**31)


@pytest.fixture
def job_id(client: TestClient, tenant_a: TenantHeaders) -> str:
    """A job with a metrics row and a sample, so range checks meet real rows."""
    response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a)
    assert response.status_code == 201, response.text
    job: str = response.json()["id"]
    attempt = start_job(job)
    with session_scope() as session:
        progress.record_metrics(session, job, attempt, 1, {"loss": 1.0})
        progress.record_samples(session, job, attempt, 1, [SampleIn(prompt="p", completion="c")])
    return job


def assert_invalid(response: Any, field: str) -> None:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert field in [detail["field"] for detail in error["details"]], error


class TestNulCharacters:
    @pytest.mark.parametrize("path", ["/v1/jobs", "/v1/datasets", "/v1/reward-functions", "/v1/webhooks"])
    def test_in_a_list_cursor(self, client: TestClient, tenant_a: TenantHeaders, path: str) -> None:
        assert_invalid(client.get(f"{path}?after=%00", headers=tenant_a), "query.after")

    @pytest.mark.parametrize(
        ("path", "field"),
        [
            ("/v1/jobs/job_%00", "path.job_id"),
            ("/v1/jobs/job_%00/events", "path.job_id"),
            ("/v1/datasets/ds_%00", "path.dataset_id"),
            ("/v1/reward-functions/rf_%00", "path.reward_function_id"),
            ("/v1/webhooks/wh_%00", "path.webhook_id"),
            ("/v1/webhooks/wh_%00/deliveries", "path.webhook_id"),
            ("/v1/checkpoints/ckpt_%00", "path.checkpoint_id"),
            ("/v1/checkpoints/ckpt_x/files/a%00b", "path.path"),
        ],
    )
    def test_in_a_path_id(self, client: TestClient, tenant_a: TenantHeaders, path: str, field: str) -> None:
        assert_invalid(client.get(path, headers=tenant_a), field)

    @pytest.mark.parametrize(("query", "field"), [("types=status%00", "query.types"), ("", "")])
    def test_in_event_types(
        self, client: TestClient, tenant_a: TenantHeaders, job_id: str, query: str, field: str
    ) -> None:
        response = client.get(f"/v1/jobs/{job_id}/events?{query}", headers=tenant_a)
        if field:
            assert_invalid(response, field)
        else:
            assert response.status_code == 200

    def test_in_metric_names(self, client: TestClient, tenant_a: TenantHeaders, job_id: str) -> None:
        assert_invalid(client.get(f"/v1/jobs/{job_id}/metrics?names=loss%00", headers=tenant_a), "query.names")

    def test_in_a_webhook_description(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        body = {"url": "http://127.0.0.1:9/hook", "description": "CI\x00notifier"}
        assert_invalid(client.post("/v1/webhooks", json=body, headers=tenant_a), "body.description")

    @pytest.mark.parametrize(
        ("overrides", "field"),
        [
            ({"base_model": "builtin:tiny\x00"}, "body.base_model"),
            ({"train_dataset": "ds_\x00"}, "body.train_dataset"),
            ({"eval_dataset": "ds_\x00"}, "body.eval_dataset"),
            ({"metadata": {"team": "a\x00b"}}, "body.metadata.team"),
            ({"rewards": [{"type": "remote", "reward_function_id": "rf_\x00"}]}, "body.rewards.0.remote.reward_function_id"),
            ({"rewards": [{"type": "model", "model": "org/rm\x00"}]}, "body.rewards.0.model.model"),
        ],
    )
    def test_in_a_job_spec(
        self, client: TestClient, tenant_a: TenantHeaders, overrides: dict[str, Any], field: str
    ) -> None:
        spec = {**job_spec(make_dataset(tenant_a.tenant_id)), **overrides}
        assert_invalid(client.post("/v1/jobs", json=spec, headers=tenant_a), field)


class TestUnpairedSurrogatesAndNonStandardNumbers:
    """JSON can escape a lone surrogate (`"\\ud800"`), which no UTF-8 encoder (database, response, outgoing
    request) accepts, and Python's json reads NaN/Infinity, which JSON has not. Sent as raw bytes: a client
    library would refuse to encode them."""

    def post(self, client: TestClient, tenant: TenantHeaders, path: str, body: str) -> Any:
        return client.post(path, content=body.encode(), headers={**tenant, "Content-Type": "application/json"})

    def test_in_a_webhook_description(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        body = '{"url": "http://127.0.0.1:9/hook", "description": "CI \\ud800"}'
        assert_invalid(self.post(client, tenant_a, "/v1/webhooks", body), "body.description")

    def test_in_job_metadata(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        dataset = make_dataset(tenant_a.tenant_id)
        body = (
            f'{{"base_model": "builtin:tiny", "train_dataset": "{dataset}", "hyperparameters": {{"max_steps": 5}}, '
            '"rewards": [{"type": "builtin", "name": "exact_match"}], "metadata": {"team": "\\udc00"}}'
        )
        assert_invalid(self.post(client, tenant_a, "/v1/jobs", body), "body.metadata.team")

    def test_in_a_reward_dry_run_item(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        rf = client.post(
            "/v1/reward-functions", json={"name": "judge", "url": "http://127.0.0.1:9/score"}, headers=tenant_a
        ).json()
        body = '{"items": [{"prompt": "2+2=", "completion": "4\\ud800"}]}'
        assert_invalid(self.post(client, tenant_a, f"/v1/reward-functions/{rf['id']}/test", body), "body.items.0.completion")

    @pytest.mark.parametrize(
        ("line", "needle"),
        [
            (b'{"prompt": "2+2=\\ud800"}', "surrogate"),
            (b'{"prompt": "2+2=", "answer": "\\udc00"}', "surrogate"),
            (b'{"prompt": "2+2=", "answer": NaN}', "NaN is not a JSON number"),
            (b'{"prompt": "2+2=", "answer": [-Infinity]}', "-Infinity is not a JSON number"),
            (b'{"prompt": "\\ud83d\\ude00 2+2=", "answer": "\\ud83d\\ude00"}', ""),  # a pair is a character
        ],
    )
    def test_in_a_dataset_line(
        self, client: TestClient, tenant_a: TenantHeaders, line: bytes, needle: str
    ) -> None:
        lines = b'{"prompt": "fine"}\n' + line + b"\n"
        response = client.post("/v1/datasets", files={"file": ("d.jsonl", lines)}, headers=tenant_a)
        if not needle:
            assert response.status_code == 201, response.text
            return
        assert response.status_code == 422, response.text
        [detail] = response.json()["error"]["details"]
        assert detail["line"] == 2 and needle in detail["error"]

    @pytest.mark.parametrize("metadata", ['{"answer": "\\udc00"}', '{"answer": NaN}', '{"x": [Infinity]}'])
    def test_in_reward_dry_run_metadata(self, client: TestClient, tenant_a: TenantHeaders, metadata: str) -> None:
        rf = client.post(
            "/v1/reward-functions", json={"name": "judge", "url": "http://127.0.0.1:9/score"}, headers=tenant_a
        ).json()
        body = f'{{"items": [{{"prompt": "2+2=", "completion": "4", "metadata": {metadata}}}]}}'
        response = self.post(client, tenant_a, f"/v1/reward-functions/{rf['id']}/test", body)
        assert_invalid(response, "body.items.0.metadata")


class TestGeneratedText:
    def test_a_nul_in_a_logged_completion_is_stored_as_a_replacement_character(
        self, client: TestClient, tenant_a: TenantHeaders, job_id: str
    ) -> None:
        """A model can generate U+0000: the step's samples are still logged (PostgreSQL text cannot hold it)."""
        with session_scope() as session:  # attempt 1: the job_id fixture's start_job
            progress.record_samples(session, job_id, 1, 2, [SampleIn(prompt="p\x00", completion="a\x00b")])
        [sample] = client.get(f"/v1/jobs/{job_id}/samples?step=2", headers=tenant_a).json()["data"]
        assert (sample["prompt"], sample["completion"]) == ("p\ufffd", "a\ufffdb")


class TestIntegerRanges:
    @pytest.mark.parametrize(
        ("query", "field"),
        [
            (f"events?after={BEYOND_INT64}", "query.after"),
            (f"samples?after={BEYOND_INT64}", "query.after"),
            (f"samples?step={BEYOND_INT32}", "query.step"),
            (f"metrics?since_step={BEYOND_INT32}", "query.since_step"),
        ],
    )
    def test_beyond_the_column(
        self, client: TestClient, tenant_a: TenantHeaders, job_id: str, query: str, field: str
    ) -> None:
        assert_invalid(client.get(f"/v1/jobs/{job_id}/{query}", headers=tenant_a), field)

    @pytest.mark.parametrize(
        "query", [f"events?after={2**63 - 1}", f"samples?after={2**63 - 1}&step={2**31 - 1}",
                  f"metrics?since_step={2**31 - 1}"],
    )
    def test_the_largest_values_are_accepted(
        self, client: TestClient, tenant_a: TenantHeaders, job_id: str, query: str
    ) -> None:
        response = client.get(f"/v1/jobs/{job_id}/{query}", headers=tenant_a)
        assert response.status_code == 200, response.text

    def test_delivery_cursor(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        webhook = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook"}, headers=tenant_a).json()
        response = client.get(f"/v1/webhooks/{webhook['id']}/deliveries?after={BEYOND_INT64}", headers=tenant_a)
        assert_invalid(response, "query.after")

    @pytest.mark.parametrize(
        ("hyperparameters", "field"),
        [
            ({"max_steps": 2**31}, "body.hyperparameters.max_steps"),
            ({"max_steps": 10, "seed": 2**63}, "body.hyperparameters.seed"),
            ({"max_steps": 10, "warmup_steps": 2**40}, "body.hyperparameters.warmup_steps"),
        ],
    )
    def test_in_a_job_spec(
        self, client: TestClient, tenant_a: TenantHeaders, hyperparameters: dict[str, Any], field: str
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id), hyperparameters=hyperparameters)
        assert_invalid(client.post("/v1/jobs", json=spec, headers=tenant_a), field)


class TestNonFiniteNumbers:
    """JSON bodies are parsed by Python's json, which reads NaN and Infinity; neither can be stored as JSON."""

    @pytest.mark.parametrize(
        ("hyperparameters", "field"),
        [
            ('{"max_steps": 10, "max_grad_norm": Infinity}', "body.hyperparameters.max_grad_norm"),
            ('{"num_epochs": Infinity}', "body.hyperparameters.num_epochs"),
            ('{"max_steps": 10, "weight_decay": NaN}', "body.hyperparameters.weight_decay"),
        ],
    )
    def test_in_hyperparameters(
        self, client: TestClient, tenant_a: TenantHeaders, hyperparameters: str, field: str
    ) -> None:
        dataset = make_dataset(tenant_a.tenant_id)
        body = (
            f'{{"base_model": "builtin:tiny", "train_dataset": "{dataset}", '
            f'"rewards": [{{"type": "builtin", "name": "exact_match"}}], "hyperparameters": {hyperparameters}}}'
        )
        response = client.post(
            "/v1/jobs", content=body, headers={**tenant_a, "Content-Type": "application/json"}
        )
        assert_invalid(response, field)

    def test_in_builtin_reward_params(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        dataset = make_dataset(tenant_a.tenant_id)
        body = (
            f'{{"base_model": "builtin:tiny", "train_dataset": "{dataset}", "hyperparameters": {{"max_steps": 5}}, '
            '"rewards": [{"type": "builtin", "name": "boxed_answer", "params": {"format_reward": NaN}}]}'
        )
        response = client.post(
            "/v1/jobs", content=body, headers={**tenant_a, "Content-Type": "application/json"}
        )
        assert response.status_code == 422, response.text
        assert "format_reward" in response.json()["error"]["message"]


class TestRewardHeaders:
    @pytest.mark.parametrize("value", ["café", "a\x01b", "tab\tinside is fine", " leading", "trailing "])
    def test_values_must_be_http_header_text(self, client: TestClient, tenant_a: TenantHeaders, value: str) -> None:
        body = {"name": "judge", "url": "http://127.0.0.1:9/score", "headers": {"X-Token": value}}
        response = client.post("/v1/reward-functions", json=body, headers=tenant_a)
        if value == "tab\tinside is fine":
            assert response.status_code == 201, response.text
        else:
            assert_invalid(response, "body.headers.X-Token")


class TestStoredRewardHeaders:
    def test_a_stored_header_that_is_not_header_text_is_a_422_on_test_not_a_500(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        """A reward function stored before registration checked header values: its dry run names the header."""
        rf = client.post(
            "/v1/reward-functions", json={"name": "judge", "url": "http://127.0.0.1:9/score"}, headers=tenant_a
        ).json()
        with session_scope() as session:
            session.get(RewardFunction, rf["id"]).headers = {"X-Token": "café"}  # type: ignore[union-attr]
        body = {"items": [{"prompt": "2+2=", "completion": "4"}]}
        response = client.post(f"/v1/reward-functions/{rf['id']}/test", json=body, headers=tenant_a)
        assert response.status_code == 422, response.text
        assert "X-Token" in response.json()["error"]["message"]


class TestUnhandledErrors:
    @pytest.fixture
    def failing_app(self, settings: Settings) -> Iterator[FastAPI]:
        def boom() -> None:
            raise RuntimeError("a bug")

        app = create_app()  # its own: the `app` fixture's is shared by the process's tests
        app.add_api_route("/boom", boom)
        yield app

    def test_a_bug_is_a_json_500_with_a_request_id_and_the_connection_stays_open(
        self, failing_app: FastAPI, caplog: pytest.LogCaptureFixture
    ) -> None:
        with TestClient(failing_app) as client:
            response = client.get("/boom")
            assert response.status_code == 500
            assert response.headers["content-type"] == "application/json"
            error = response.json()["error"]
            request_id = response.headers["x-request-id"]
            assert error["code"] == "internal_error" and error["details"] == {"request_id": request_id}
            assert request_id in error["message"]
            assert any(request_id in record.getMessage() and record.exc_info for record in caplog.records)
            assert client.get("/healthz").status_code == 200

    def test_a_real_server_keeps_the_connection_open_after_a_500(self, failing_app: FastAPI) -> None:
        server, thread, port = start_uvicorn(failing_app)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                stream = sock.makefile("rb")
                for path in ("/boom", "/healthz"):  # both on the one connection
                    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
                    status_line = stream.readline()
                    headers = {}
                    while (line := stream.readline()) not in (b"\r\n", b""):
                        name, _, value = line.decode().partition(":")
                        headers[name.strip().lower()] = value.strip()
                    body = stream.read(int(headers["content-length"]))
                    if path == "/boom":
                        assert status_line.startswith(b"HTTP/1.1 500"), status_line
                        assert headers["content-type"] == "application/json"
                        assert json.loads(body)["error"]["code"] == "internal_error"
                        assert headers.get("connection") != "close"
                    else:
                        assert status_line.startswith(b"HTTP/1.1 200"), status_line
        finally:
            stop_uvicorn(server, thread)


class TestMethodNotAllowed:
    @pytest.mark.parametrize(
        ("path", "allowed"),
        [
            ("/v1/jobs", {"GET", "POST"}),
            ("/v1/jobs/job_x", {"GET", "DELETE", "PATCH"}),
            ("/v1/datasets/ds_x", {"GET", "DELETE"}),
            ("/openai/v1/files", {"GET", "POST"}),  # OpenAI's error shape, the same Allow
            ("/healthz", {"GET"}),
        ],
    )
    def test_405_names_every_allowed_method(
        self, client: TestClient, tenant_a: TenantHeaders, path: str, allowed: set[str]
    ) -> None:
        for method in sorted({"TRACE", "PATCH", "PUT"} - allowed):
            response = client.request(method, path, headers=tenant_a)
            assert response.status_code == 405
            assert response.json()["error"]["code"] == "method_not_allowed"
            assert set(response.headers["allow"].split(", ")) == allowed
