"""GET /v1/jobs/{id}/stream: Server-Sent Events with row ids, Last-Event-ID replay, live updates, and the end
of a stream whose key is revoked or expires."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.jobs import progress, stream
from service.jobs.states import JobStatus
from service.kit.config import get_settings
from service.kit.db import session_scope, utcnow
from service.storage import get_storage
from service.tenants.keys import lookup_prefix
from service.tenants.models import ApiKey
from tests.service.factories import TenantHeaders, auth_headers, create_key
from tests.service.jobs_support import job_spec, load_job, make_dataset, put_checkpoint, start_job


def parse_sse(text: str) -> list[dict[str, Any]]:
    """Messages with an id (comments and the retry hint are skipped)."""
    messages = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        if "id" in fields:
            messages.append(
                {"id": int(fields["id"]), "event": fields["event"], "data": json.loads(fields["data"])}
            )
    return messages


def read_stream(client: TestClient, job_id: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse(response.read().decode())


def finished_job(client: TestClient, tenant: TenantHeaders) -> str:
    job_id: str = client.post(
        "/v1/jobs", json=job_spec(make_dataset(tenant.tenant_id)), headers=tenant
    ).json()["id"]
    attempt = start_job(job_id)
    for step in (1, 2):
        with session_scope() as session:
            progress.record_metrics(session, job_id, attempt, step, {"loss": 1.0 / step})
    put_checkpoint(get_storage(), job_id, attempt, 2, {"model.safetensors": b"weights"})
    with session_scope() as session:
        progress.worker_transition(session, job_id, attempt, JobStatus.succeeded, reason="done")
    return job_id


class TestStream:
    def test_all_events_with_row_ids_then_the_stream_ends(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = finished_job(client, tenant_a)
        messages = read_stream(client, job_id, tenant_a)
        events = client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a).json()["data"]
        assert [m["id"] for m in messages] == [e["id"] for e in events]
        assert [m["event"] for m in messages] == [
            "status",
            "status",
            "metrics",
            "metrics",
            "checkpoint",
            "status",
        ]
        assert messages[2]["data"]["data"] == {"step": 1, "metrics": {"loss": 1.0}}
        assert messages[-1]["data"]["data"]["to"] == "succeeded"

    def test_last_event_id_replays_what_came_after(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = finished_job(client, tenant_a)
        everything = read_stream(client, job_id, tenant_a)
        resumed = read_stream(client, job_id, {**tenant_a, "Last-Event-ID": str(everything[2]["id"])})
        assert resumed == everything[3:]

    def test_live_updates_arrive_until_the_job_finishes(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = client.post(
            "/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a
        ).json()["id"]
        attempt = start_job(job_id)

        def worker() -> None:
            for step in range(1, 4):
                time.sleep(0.3)
                with session_scope() as session:
                    progress.record_metrics(session, job_id, attempt, step, {"reward": float(step)})
            with session_scope() as session:
                progress.worker_transition(session, job_id, attempt, JobStatus.succeeded, reason="done")

        thread = threading.Thread(target=worker)
        started = time.monotonic()
        thread.start()
        try:
            messages = read_stream(client, job_id, tenant_a)
        finally:
            thread.join()
        assert [m["data"]["data"].get("step") for m in messages if m["event"] == "metrics"] == [1, 2, 3]
        assert messages[-1]["event"] == "status" and messages[-1]["data"]["data"]["to"] == "succeeded"
        assert time.monotonic() - started < 10

    @pytest.mark.parametrize("value", ["abc", "null", "-1", "1.5", "99999999999999999999"])
    def test_a_last_event_id_that_is_not_an_event_id_starts_from_the_first_event(
        self, client: TestClient, tenant_a: TenantHeaders, value: str
    ) -> None:
        job_id = finished_job(client, tenant_a)
        everything = read_stream(client, job_id, tenant_a)
        assert read_stream(client, job_id, {**tenant_a, "Last-Event-ID": value}) == everything

    def test_the_largest_event_id_is_an_event_id(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = finished_job(client, tenant_a)
        assert read_stream(client, job_id, {**tenant_a, "Last-Event-ID": str(2**63 - 1)}) == []


class TestStreamOutlivingItsKey:
    """The stream re-checks its key before every poll: revoked (by another process: only the database knows) or
    expired, the key ends the stream with an `error` message within GRPO_AUTH_CACHE_SECONDS (+ one poll)."""

    @pytest.mark.parametrize("how", ["revoked", "expired"])
    def test_the_stream_ends_within_the_auth_cache_time(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch, how: str
    ) -> None:
        cache_s = 1.0
        monkeypatch.setenv("GRPO_AUTH_CACHE_SECONDS", str(cache_s))
        get_settings.cache_clear()
        job_id = client.post(
            "/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a
        ).json()["id"]
        attempt = start_job(job_id)  # running: the stream would go on until the job ends
        expires_at = datetime.now(UTC) + timedelta(seconds=2) if how == "expired" else None
        with session_scope() as session:
            key = create_key(session, tenant_a.tenant_id, ["read"], expires_at=expires_at)
        received: list[str] = []
        opened = threading.Event()

        def read() -> None:
            with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=auth_headers(key)) as response:
                assert response.status_code == 200
                for chunk in response.iter_text():
                    received.append(chunk)
                    opened.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert opened.wait(10), "the stream did not start"
        if how == "revoked":  # as another process would: in the database only, this process's cache untouched
            with session_scope() as session:
                session.execute(update(ApiKey).where(ApiKey.prefix == lookup_prefix(key)).values(revoked_at=utcnow()))
            refused_at = time.monotonic()
        else:
            assert expires_at is not None
            refused_at = time.monotonic() + (expires_at - datetime.now(UTC)).total_seconds()
        reader.join(timeout=cache_s + 5)
        ended_after = time.monotonic() - refused_at
        if reader.is_alive():  # the stream outlived its key: end the job so that the reader returns, then fail
            with session_scope() as session:
                progress.worker_transition(session, job_id, attempt, JobStatus.succeeded, reason="done")
            reader.join(timeout=10)
            pytest.fail(f"the stream kept sending {ended_after:.1f} s after its key was {how}")
        assert ended_after < cache_s + stream.POLL_INTERVAL_S + 1.0, ended_after
        last = "".join(received).strip().split("\n\n")[-1]
        assert last.startswith("event: error\ndata: "), last
        assert json.loads(last.partition("data: ")[2])["error"]["code"] == "unauthenticated"
        assert load_job(job_id).status == JobStatus.running  # the job went on; only the stream ended
