"""Webhooks: registry API, the outbox written with job events, delivery to a real loopback receiver.

The receiver is a real HTTP server on 127.0.0.1 that verifies every request with the `standardwebhooks`
package (independent of our signing code) and answers from a script (e.g. 500 then 200).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select
from standardwebhooks import Webhook

from service.app import create_app
from service.execution import reporting
from service.execution.lease import Claim, claim_job
from service.grpc.server import create_grpc_server
from service.jobs.models import JobEvent
from service.jobs.schemas import SampleIn
from service.jobs.states import JobStatus, transition
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope, utcnow
from service.storage import get_storage
from service.webhooks import outbox
from service.webhooks.delivery import DeliveryConfig, Dispatcher, start_dispatcher_thread
from service.webhooks.models import WebhookDelivery
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset, put_checkpoint
from worker.celery_app import create_celery_app


class Receiver:
    """A loopback webhook receiver. `script` is the status codes to answer, in order (then 200)."""

    def __init__(self, secret: str | None = None, script: list[int] | None = None) -> None:
        self.secret = secret
        self.script = list(script or [])
        self.requests: list[dict[str, Any]] = []  # {"headers", "body", "verified", "answered"}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                verified = None
                if receiver.secret is not None:
                    verified = Webhook(receiver.secret).verify(body, headers)  # raises if the signature is bad
                with receiver.lock:
                    status = receiver.script.pop(0) if receiver.script else 200
                    receiver.requests.append(
                        {"headers": headers, "body": body, "verified": verified, "answered": status}
                    )
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def wait_for(self, count: int, timeout: float = 15.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.requests) >= count:
                    return list(self.requests)
            time.sleep(0.02)
        raise AssertionError(f"receiver got {len(self.requests)} requests, expected {count}")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def register(client: TestClient, headers: TenantHeaders, url: str) -> dict[str, Any]:
    response = client.post("/v1/webhooks", json={"url": url, "description": "test"}, headers=headers)
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def create_job(client: TestClient, headers: TenantHeaders) -> str:
    response = client.post("/v1/jobs", json=job_spec(make_dataset(headers.tenant_id)), headers=headers)
    assert response.status_code == 201, response.text
    job_id: str = response.json()["id"]
    return job_id


def claim(job_id: str) -> Claim:
    with session_scope() as session:
        result = claim_job(session, job_id, "test-worker", lease_seconds=60)
    assert result is not None
    return result


def deliveries(job_id: str | None = None) -> list[WebhookDelivery]:
    with session_scope() as session:
        stmt = select(WebhookDelivery).order_by(WebhookDelivery.id)
        if job_id is not None:
            stmt = stmt.where(WebhookDelivery.job_id == job_id)
        return list(session.scalars(stmt))


def fast_config(**overrides: Any) -> DeliveryConfig:
    values: dict[str, Any] = {"backoff_s": 0.05, "backoff_max_s": 0.2, "poll_interval_s": 0.05,
                              "allow_private": True, "timeout_s": 5.0}
    values.update(overrides)
    return DeliveryConfig(**values)


def one_pass(config: DeliveryConfig, *, ahead_s: float = 0.0) -> Any:
    """One dispatcher pass, `ahead_s` seconds in the future (so backed-off rows are due)."""

    async def run() -> Any:
        dispatcher = Dispatcher(config)
        try:
            return await dispatcher.deliver_due(now=utcnow() + timedelta(seconds=ahead_s))
        finally:
            await dispatcher.aclose()

    return asyncio.run(run())


class TestListenerRegistration:
    """The outbox listener is turned on explicitly by each entry point, not by importing a module."""

    @pytest.fixture
    def unregistered(self) -> Iterator[None]:
        listener = outbox._enqueue_deliveries
        event.remove(JobEvent, "after_insert", listener)
        try:
            yield
        finally:
            outbox.register()

    def _registered(self) -> bool:
        return event.contains(JobEvent, "after_insert", outbox._enqueue_deliveries)

    def test_register_is_idempotent(self, unregistered: None) -> None:
        outbox.register()
        outbox.register()
        assert self._registered()
        event.remove(JobEvent, "after_insert", outbox._enqueue_deliveries)
        assert not self._registered()  # registered once: one removal leaves none

    def test_the_app_the_grpc_server_and_the_worker_register_it(self, unregistered: None) -> None:
        create_app()
        assert self._registered()
        event.remove(JobEvent, "after_insert", outbox._enqueue_deliveries)

        async def build_grpc() -> None:
            server, _ = await create_grpc_server(0)
            await server.stop(None)

        asyncio.run(build_grpc())
        assert self._registered()
        event.remove(JobEvent, "after_insert", outbox._enqueue_deliveries)
        create_celery_app()
        assert self._registered()


class TestRegistry:
    def test_create_shows_secret_once_then_list_get_delete(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        created = register(client, tenant_a, "https://hooks.example.com/grpo")
        assert created["id"].startswith("wh_") and created["secret"].startswith("whsec_")
        assert "job.checkpoint_saved" in created["event_types"] and len(created["event_types"]) == 10
        assert "job.health" in created["event_types"] and "job.budget_exhausted" in created["event_types"]
        webhook_id = created["id"]

        got = client.get(f"/v1/webhooks/{webhook_id}", headers=tenant_a).json()
        assert got["url"] == "https://hooks.example.com/grpo" and "secret" not in got
        listed = client.get("/v1/webhooks", headers=tenant_a).json()
        assert [w["id"] for w in listed["data"]] == [webhook_id] and "secret" not in listed["data"][0]

        # Another tenant sees nothing, and gets the same 404 as for a missing id.
        assert client.get("/v1/webhooks", headers=tenant_b).json()["data"] == []
        other = client.get(f"/v1/webhooks/{webhook_id}", headers=tenant_b)
        missing = client.get("/v1/webhooks/wh_missing", headers=tenant_b)
        assert other.status_code == missing.status_code == 404
        assert client.delete(f"/v1/webhooks/{webhook_id}", headers=tenant_b).status_code == 404

        assert client.delete(f"/v1/webhooks/{webhook_id}", headers=tenant_a).status_code == 204
        assert client.get(f"/v1/webhooks/{webhook_id}", headers=tenant_a).status_code == 404

    def test_requires_auth_and_valid_fields(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        assert client.get("/v1/webhooks").status_code == 401
        bad_scheme = client.post("/v1/webhooks", json={"url": "ftp://hooks.example.com/x"}, headers=tenant_a)
        assert bad_scheme.status_code == 422 and bad_scheme.json()["error"]["code"] == "url_rejected"
        extra = client.post("/v1/webhooks", json={"url": "https://a.example.com", "x": 1}, headers=tenant_a)
        assert extra.status_code == 422 and "x" in extra.json()["error"]["message"]

    @pytest.mark.parametrize(
        "url", ["http://127.0.0.1:8080/hook", "https://127.0.0.1/hook", "https://10.1.2.3/hook",
                "https://169.254.169.254/latest", "https://user:pw@hooks.example.com/"]
    )
    def test_production_refuses_private_and_plain_http(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch, url: str
    ) -> None:
        monkeypatch.setenv("GRPO_ENV", "production")
        get_settings.cache_clear()
        response = client.post("/v1/webhooks", json={"url": url}, headers=tenant_a)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "url_rejected"
        assert client.get("/v1/webhooks", headers=tenant_a).json()["data"] == []


class TestOutbox:
    def test_every_lifecycle_event_is_queued_for_delivery(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, settings: Settings
    ) -> None:
        register(client, tenant_a, "https://hooks.example.com/a")
        register(client, tenant_a, "https://hooks.example.com/b")
        register(client, tenant_b, "https://hooks.example.com/other-tenant")

        job_id = create_job(client, tenant_a)
        held = claim(job_id)
        reporting.record_step(held, 1, {"reward/mean": 0.5}, [SampleIn(prompt="p", completion="c")])  # not announced
        reporting.record_step(held, 2, {"reward/mean": 0.6, "eval/reward/mean": 0.7}, [])
        reporting.record_event(held, "health", "kl_blowup: KL to the reference 3.1 > 2.0",
                               {"kind": "kl_blowup", "severity": "warning", "step": 2, "evidence": {"kl": 3.1}})
        put_checkpoint(get_storage(), job_id, held.attempt, 2, {"model.safetensors": b"weights"})
        reporting.finish(held, JobStatus.succeeded, reason="trained 2 steps")

        rows = deliveries(job_id)
        per_endpoint: dict[str, list[str]] = {}
        for row in rows:
            per_endpoint.setdefault(row.endpoint_id, []).append(row.event_type)
            assert row.tenant_id == tenant_a.tenant_id and row.status == "pending"
        assert len(per_endpoint) == 2  # both of tenant a's endpoints, none of tenant b's
        for events in per_endpoint.values():
            assert events == ["job.queued", "job.running", "job.eval_completed", "job.health",
                              "job.checkpoint_saved", "job.succeeded"]
        by_type = {row.event_type: row for row in rows}
        assert by_type["job.eval_completed"].payload["data"]["metrics"] == {"eval/reward/mean": 0.7}
        assert by_type["job.checkpoint_saved"].payload["data"]["step"] == 2
        assert by_type["job.health"].payload["data"]["evidence"] == {"kl": 3.1}
        succeeded = by_type["job.succeeded"].payload
        assert succeeded["type"] == "job.succeeded"
        assert succeeded["data"]["status"] == "succeeded" and succeeded["data"]["previous_status"] == "running"
        assert succeeded["data"]["job_id"] == job_id and succeeded["data"]["attempt"] == held.attempt

    def test_pause_cancel_and_failure_are_announced(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        register(client, tenant_a, "https://hooks.example.com/a")
        paused = create_job(client, tenant_a)
        assert client.post(f"/v1/jobs/{paused}/pause", headers=tenant_a).status_code == 200
        assert client.post(f"/v1/jobs/{paused}/cancel", headers=tenant_a).status_code == 200
        failed = create_job(client, tenant_a)
        reporting.finish(claim(failed), JobStatus.failed, reason="boom", error_code="training_error")
        assert [r.event_type for r in deliveries(paused)] == ["job.queued", "job.paused", "job.cancelled"]
        assert [r.event_type for r in deliveries(failed)] == ["job.queued", "job.running", "job.failed"]
        assert deliveries(failed)[-1].payload["data"]["reason"] == "boom"

    def test_rolled_back_transition_announces_nothing(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        register(client, tenant_a, "https://hooks.example.com/a")
        job_id = create_job(client, tenant_a)
        with pytest.raises(RuntimeError), session_scope() as session:
            from service.jobs.repository import get_job_any_tenant

            job = get_job_any_tenant(session, job_id)
            assert job is not None
            transition(session, job, JobStatus.cancelled, reason="test")
            raise RuntimeError("the request failed after the transition")
        assert [r.event_type for r in deliveries(job_id)] == ["job.queued"]


class TestDelivery:
    def test_signed_delivery_retried_after_500_until_success(
        self, client: TestClient, tenant_a: TenantHeaders, receiver: Receiver, settings: Settings
    ) -> None:
        created = register(client, tenant_a, receiver.url)
        receiver.secret = created["secret"]
        receiver.script = [500]  # the first attempt fails
        fast = settings.model_copy(update={"webhook_backoff_s": 0.05, "webhook_backoff_max_s": 0.2,
                                           "webhook_poll_interval_s": 0.05})
        thread, stop = start_dispatcher_thread(fast)  # the loop `grpo serve` runs
        try:
            job_id = create_job(client, tenant_a)
            requests = receiver.wait_for(2)
        finally:
            stop.set()
            thread.join(timeout=10)

        first, second = requests[:2]
        assert [first["answered"], second["answered"]] == [500, 200]
        # The same message id on every retry (receivers deduplicate on it); each attempt freshly signed
        # and verified by the standardwebhooks package inside the receiver.
        assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]
        assert first["verified"] is not None and second["verified"] is not None
        body = json.loads(second["body"])
        assert body["type"] == "job.queued" and body["data"]["job_id"] == job_id
        assert second["headers"]["content-type"] == "application/json"
        with pytest.raises(Exception, match="No matching signature"):
            Webhook("whsec_" + "B" * 32).verify(second["body"], second["headers"])

        (row,) = deliveries(job_id)
        assert row.status == "delivered" and row.attempts == 2 and row.last_status_code == 200
        listed = client.get(f"/v1/webhooks/{created['id']}/deliveries", headers=tenant_a).json()
        assert [(d["event_type"], d["status"], d["attempts"]) for d in listed["data"]] == [
            ("job.queued", "delivered", 2)
        ]

    def test_gives_up_after_max_attempts(self, client: TestClient, tenant_a: TenantHeaders,
                                         receiver: Receiver) -> None:
        register(client, tenant_a, receiver.url)
        receiver.script = [503, 503, 503]
        job_id = create_job(client, tenant_a)
        config = fast_config(max_attempts=3)
        reports = [one_pass(config, ahead_s=10 * i) for i in range(4)]
        assert [len(r.retrying) for r in reports] == [1, 1, 0, 0]
        assert [len(r.failed) for r in reports] == [0, 0, 1, 0]
        (row,) = deliveries(job_id)
        assert row.status == "failed" and row.attempts == 3
        assert row.last_error is not None and row.last_error.startswith("HTTP 503")
        assert len(receiver.requests) == 3

    def test_backoff_grows_and_is_capped(self) -> None:
        dispatcher_config = fast_config(backoff_s=1.0, backoff_max_s=10.0)

        async def delays() -> list[float]:
            dispatcher = Dispatcher(dispatcher_config)
            try:
                return [dispatcher.backoff(n) for n in range(1, 8)]
            finally:
                await dispatcher.aclose()

        waits = asyncio.run(delays())
        assert 1.0 <= waits[0] <= 2.0 and 2.0 <= waits[1] <= 3.0 and 4.0 <= waits[2] <= 5.0
        assert all(w <= 10.0 for w in waits) and waits[-1] == 10.0

    def test_url_refused_by_policy_at_delivery_fails_without_sending(
        self, client: TestClient, tenant_a: TenantHeaders, receiver: Receiver
    ) -> None:
        # Registered in development mode (loopback allowed); delivered by a production dispatcher.
        register(client, tenant_a, receiver.url)
        job_id = create_job(client, tenant_a)
        report = one_pass(fast_config(allow_private=False))
        assert len(report.failed) == 1
        (row,) = deliveries(job_id)
        assert row.status == "failed" and row.attempts == 1
        assert row.last_error is not None and row.last_error.startswith("url_rejected")
        assert receiver.requests == []

    def test_deleted_webhook_gets_nothing_more(
        self, client: TestClient, tenant_a: TenantHeaders, receiver: Receiver
    ) -> None:
        created = register(client, tenant_a, receiver.url)
        create_job(client, tenant_a)
        assert client.delete(f"/v1/webhooks/{created['id']}", headers=tenant_a).status_code == 204
        report = one_pass(fast_config())
        assert len(report) == 0 and receiver.requests == [] and deliveries() == []
