"""Quotas through the real ASGI app, on SQLite and PostgreSQL: each limit's refusal with its exact error body, the
defaults from settings, per-tenant overrides, and the admin routes (`/v1/admin/tenants/{id}/quotas`).

The running-jobs and devices quotas at claim time are in tests/worker/test_fair_claim.py; a job waiting for the
running quota and then running, with real workers, in tests/worker/test_quota_wait.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from contract.api.quotas import QuotaLimits
from service.jobs.states import JobStatus, transition
from service.kit import db as kit_db
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.quotas import service as quotas
from service.storage import get_storage
from tests.service.factories import TenantHeaders, auth_headers, create_key
from tests.service.jobs_support import (
    RecordingQueue,
    job_spec,
    load_job,
    make_dataset,
    recording_queue,
    start_job,
)

__all__ = ["recording_queue"]  # the fixture, re-exported for pytest


def _override(tenant_id: str, **limits: int) -> None:
    with session_scope() as session:
        quotas.set_overrides(session, tenant_id, QuotaLimits(**limits))


def _submit(client: TestClient, headers: TenantHeaders) -> Any:
    return client.post("/v1/jobs", json=job_spec(make_dataset(headers.tenant_id)), headers=headers)


def _upload(client: TestClient, headers: TenantHeaders, size: int) -> Any:
    line = json.dumps({"prompt": "x" * (size - 15)}) + "\n"
    assert len(line) == size
    return client.post("/v1/datasets", files={"file": ("d.jsonl", line.encode(), "application/jsonl")}, headers=headers)


def _quota_error(quota: str, limit: int, current: int, requested: int) -> dict[str, Any]:
    return {
        "error": {
            "code": "quota_exceeded",
            "message": f"quota {quota} exceeded: limit {limit}, in use {current}, requested {requested}",
            "details": {"quota": quota, "limit": limit, "current": current, "requested": requested},
        }
    }


@pytest.fixture
def use_settings(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> Callable[..., None]:
    """Change settings for the rest of the test (environment variables, as a deployment sets them)."""

    def apply(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(f"GRPO_{name.upper()}", value)
        get_settings.cache_clear()

    return apply


class TestQueuedJobsQuota:
    def test_job_past_the_override_is_refused_with_429(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_queued_jobs=2)
        assert [_submit(client, tenant_a).status_code for _ in range(2)] == [201, 201]
        response = _submit(client, tenant_a)
        assert response.status_code == 429
        assert response.json() == _quota_error("max_queued_jobs", 2, 2, 1)
        assert len(recording_queue.sent) == 2  # nothing enqueued for the refused job
        assert _submit(client, tenant_b).status_code == 201  # another tenant is not affected

    def test_default_from_settings_applies_and_an_override_replaces_it(
        self, client: TestClient, tenant_a: TenantHeaders, use_settings: Callable[..., None],
        recording_queue: RecordingQueue,
    ) -> None:
        use_settings(quota_max_queued_jobs="1")
        assert _submit(client, tenant_a).status_code == 201
        assert _submit(client, tenant_a).json() == _quota_error("max_queued_jobs", 1, 1, 1)
        _override(tenant_a.tenant_id, max_queued_jobs=3)
        assert _submit(client, tenant_a).status_code == 201

    def test_running_jobs_do_not_count_and_resuming_past_the_quota_is_refused(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_queued_jobs=1)
        first = _submit(client, tenant_a).json()["id"]
        start_job(first)  # running: no longer waiting
        second = _submit(client, tenant_a).json()["id"]
        assert client.get(f"/v1/jobs/{second}", headers=tenant_a).json()["status"] == "queued"
        _pause_running(first)  # the worker paused it at a checkpoint: 1 queued, 1 paused
        response = client.post(f"/v1/jobs/{first}/resume", headers=tenant_a)
        assert response.status_code == 429
        assert response.json() == _quota_error("max_queued_jobs", 1, 1, 1)
        assert client.get(f"/v1/jobs/{first}", headers=tenant_a).json()["status"] == "paused"
        start_job(second)  # the queued job starts: resuming fits again
        assert client.post(f"/v1/jobs/{first}/resume", headers=tenant_a).json()["status"] == "queued"

    def test_paused_jobs_count_towards_the_limit(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        """Issue 30: 9 paused and 3 queued jobs at a limit of 3 (pause, submit again, ...) are no longer possible."""
        _override(tenant_a.tenant_id, max_queued_jobs=3)
        waiting = [_submit(client, tenant_a).json()["id"] for _ in range(3)]
        for job_id in waiting[:2]:
            assert client.post(f"/v1/jobs/{job_id}/pause", headers=tenant_a).json()["status"] == "paused"
        refused = _submit(client, tenant_a)  # 1 queued + 2 paused: the limit is reached
        assert refused.status_code == 429
        assert refused.json() == _quota_error("max_queued_jobs", 3, 3, 1)
        assert client.post(f"/v1/jobs/{waiting[2]}/pause", headers=tenant_a).json()["status"] == "paused"
        assert _submit(client, tenant_a).status_code == 429  # 3 paused: still full
        body = client.get(f"/v1/admin/tenants/{tenant_a.tenant_id}/quotas", headers=tenant_a).json()
        assert body["usage"]["queued_jobs"] == 3
        # A paused job is already counted: resuming one moves it back to the queue and is not refused.
        assert client.post(f"/v1/jobs/{waiting[0]}/resume", headers=tenant_a).json()["status"] == "queued"
        # Cancelling a paused job frees its place.
        assert client.post(f"/v1/jobs/{waiting[1]}/cancel", headers=tenant_a).json()["status"] == "cancelled"
        assert _submit(client, tenant_a).status_code == 201
        statuses = [job["status"] for job in client.get("/v1/jobs", headers=tenant_a).json()["data"]]
        assert sorted(statuses) == ["cancelled", "paused", "queued", "queued"]


def _pause_running(job_id: str) -> None:
    """What the worker does at a checkpoint after a pause request: running -> paused."""
    with session_scope() as session:
        job = session.merge(load_job(job_id))
        transition(session, job, JobStatus.paused, reason="paused by test worker")


class TestRunningJobsQuota:
    def test_a_job_past_the_running_quota_is_accepted_and_queued(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_running_jobs=0)
        response = _submit(client, tenant_a)
        assert response.status_code == 201 and response.json()["status"] == "queued"
        assert recording_queue.sent == [(response.json()["id"], "cpu")]


class TestDevicesQuota:
    def test_a_job_needing_more_devices_than_the_limit_is_refused_with_409(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_devices=0)
        response = _submit(client, tenant_a)
        assert response.status_code == 409
        assert response.json() == _quota_error("max_devices", 0, 0, 1)
        assert recording_queue.sent == []

    def test_the_job_counts_the_devices_its_spec_asks_for(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_devices=1)
        spec = job_spec(make_dataset(tenant_a.tenant_id))
        spec["resources"] = {"devices": 2}
        spec["hyperparameters"] = {**spec.get("hyperparameters", {}), "prompts_per_step": 2}
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 409, response.text
        assert response.json() == _quota_error("max_devices", 1, 0, 2)
        assert recording_queue.sent == []

    def test_devices_in_use_are_reported_but_a_fitting_job_still_queues(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_devices=1)
        start_job(_submit(client, tenant_a).json()["id"])
        response = _submit(client, tenant_a)  # waits for the device at claim time, not refused
        assert response.status_code == 201 and response.json()["status"] == "queued"
        body = client.get(f"/v1/admin/tenants/{tenant_a.tenant_id}/quotas", headers=tenant_a).json()
        assert body["usage"]["devices"] == 1 and body["usage"]["running_jobs"] == 1


class TestDatasetStorageQuota:
    def test_upload_past_the_quota_is_refused_with_409_and_leaves_nothing(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, settings: Settings
    ) -> None:
        _override(tenant_a.tenant_id, max_dataset_storage_bytes=100)
        assert _upload(client, tenant_a, 60).status_code == 201
        response = _upload(client, tenant_a, 50)
        assert response.status_code == 409
        assert response.json() == _quota_error("max_dataset_storage_bytes", 100, 60, 50)
        assert len(client.get("/v1/datasets", headers=tenant_a).json()["data"]) == 1
        assert len(get_storage().list("datasets")) == 1  # the refused upload's blob is gone
        assert _upload(client, tenant_b, 50).status_code == 201

    def test_deleting_a_dataset_frees_its_bytes(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings
    ) -> None:
        _override(tenant_a.tenant_id, max_dataset_storage_bytes=100)
        first = _upload(client, tenant_a, 60).json()["id"]
        assert _upload(client, tenant_a, 60).status_code == 409
        assert client.delete(f"/v1/datasets/{first}", headers=tenant_a).status_code == 204
        assert _upload(client, tenant_a, 60).status_code == 201


class TestAdminRoutes:
    @pytest.fixture
    def operator(self, use_settings: Callable[..., None], tenant_a: TenantHeaders) -> TenantHeaders:
        use_settings(operator_tenants='["tenant-a"]')
        return tenant_a

    def test_an_admin_key_reads_its_own_tenants_quotas(
        self, client: TestClient, tenant_b: TenantHeaders, settings: Settings
    ) -> None:
        _override(tenant_b.tenant_id, max_running_jobs=3)
        response = client.get(f"/v1/admin/tenants/{tenant_b.tenant_id}/quotas", headers=tenant_b)
        assert response.status_code == 200
        assert response.json() == {
            "object": "tenant_quotas",
            "tenant_id": tenant_b.tenant_id,
            "limits": {
                "max_running_jobs": 3,
                "max_queued_jobs": settings.quota_max_queued_jobs,
                "max_devices": None,
                "max_dataset_storage_bytes": settings.quota_max_dataset_storage_bytes,
            },
            "overrides": {
                "max_running_jobs": 3, "max_queued_jobs": None, "max_devices": None, "max_dataset_storage_bytes": None
            },
            "usage": {"running_jobs": 0, "queued_jobs": 0, "devices": 0, "dataset_storage_bytes": 0},
        }

    def test_an_operator_sets_another_tenants_quotas(
        self, client: TestClient, operator: TenantHeaders, tenant_b: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        url = f"/v1/admin/tenants/{tenant_b.tenant_id}/quotas"
        response = client.put(url, json={"max_queued_jobs": 1, "max_running_jobs": 2}, headers=operator)
        assert response.status_code == 200, response.text
        assert response.json()["overrides"]["max_queued_jobs"] == 1
        assert response.json()["limits"]["max_running_jobs"] == 2
        assert client.get(url, headers=operator).json()["overrides"]["max_running_jobs"] == 2
        assert _submit(client, tenant_b).status_code == 201
        assert _submit(client, tenant_b).json() == _quota_error("max_queued_jobs", 1, 1, 1)
        # null: back to the default
        response = client.put(url, json={"max_queued_jobs": None}, headers=operator)
        assert response.json()["overrides"] == {
            "max_running_jobs": None, "max_queued_jobs": None, "max_devices": None, "max_dataset_storage_bytes": None
        }
        assert _submit(client, tenant_b).status_code == 201

    def test_raising_a_quota_wakes_the_waiting_jobs(
        self, client: TestClient, operator: TenantHeaders, tenant_b: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        job_id = _submit(client, tenant_b).json()["id"]
        recording_queue.sent.clear()
        url = f"/v1/admin/tenants/{tenant_b.tenant_id}/quotas"
        assert client.put(url, json={"max_running_jobs": 5}, headers=operator).status_code == 200
        assert recording_queue.sent == [(job_id, "cpu")]

    def test_a_tenant_admin_cannot_change_its_own_quotas(
        self, client: TestClient, tenant_b: TenantHeaders, settings: Settings
    ) -> None:
        response = client.put(
            f"/v1/admin/tenants/{tenant_b.tenant_id}/quotas", json={"max_running_jobs": 100}, headers=tenant_b
        )
        assert response.status_code == 403
        assert response.json() == {
            "error": {
                "code": "operator_required",
                "message": "only an admin key of an operator tenant (settings operator_tenants) may change quotas",
                "details": {"tenant_id": tenant_b.tenant_id},
            }
        }

    def test_another_tenants_quotas_read_as_not_found_unless_operator(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, settings: Settings
    ) -> None:
        url = f"/v1/admin/tenants/{tenant_a.tenant_id}/quotas"
        assert client.get(url, headers=tenant_b).status_code == 404
        response = client.put(url, json={}, headers=tenant_b)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"

    def test_an_operator_gets_404_for_an_unknown_tenant(self, client: TestClient, operator: TenantHeaders) -> None:
        response = client.get("/v1/admin/tenants/ten_nope/quotas", headers=operator)
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "tenant 'ten_nope' not found"

    def test_a_key_without_the_admin_scope_is_refused(
        self, client: TestClient, operator: TenantHeaders
    ) -> None:
        with kit_db.session_scope() as session:
            headers = auth_headers(create_key(session, operator.tenant_id, ["read", "write"]))
        response = client.get(f"/v1/admin/tenants/{operator.tenant_id}/quotas", headers=headers)
        assert response.status_code == 403 and response.json()["error"]["code"] == "insufficient_scope"

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"max_running_jobs": -1}, "body.max_running_jobs"),
            ({"max_devices": "many"}, "body.max_devices"),
            ({"max_dataset_storage_bytes": 2**63}, "body.max_dataset_storage_bytes"),
            ({"max_jobs": 1}, "body.max_jobs"),
        ],
    )
    def test_bad_values_are_422_naming_the_field(
        self, client: TestClient, operator: TenantHeaders, body: dict[str, Any], field: str
    ) -> None:
        response = client.put(f"/v1/admin/tenants/{operator.tenant_id}/quotas", json=body, headers=operator)
        assert response.status_code == 422
        assert [d["field"] for d in response.json()["error"]["details"]] == [field]
