"""The usage and cost-control API without a worker (SQLite and PostgreSQL): budgets validated on submission and
on PATCH with a 4xx naming the field, the usage window's parameters, estimates from the defaults, a model's
calibration or its size bucket, and tenant isolation. The real-worker behaviour is in tests/worker/test_usage.py."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.jobs.states import JobStatus, transition
from service.kit.db import session_scope
from service.usage import service as usage
from service.usage.service import StepUsageIn, bucket_from_name, size_bucket
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import (
    RecordingQueue,
    job_spec,
    load_job,
    make_dataset,
    recording_queue,
    start_job,
)

__all__ = ["recording_queue"]  # the fixture, re-exported for pytest


def _field_errors(response: Any) -> list[str]:
    return [d["field"] for d in response.json()["error"]["details"]]


@pytest.fixture
def dataset(tenant_a: TenantHeaders) -> str:
    return make_dataset(tenant_a.tenant_id)


def _create(client: TestClient, tenant: TenantHeaders, spec: dict[str, Any]) -> Any:
    return client.post("/v1/jobs", json=spec, headers=tenant)


class TestBudgetValidation:
    @pytest.mark.parametrize(
        ("budget", "field"),
        [
            ({"max_tokens": 0}, "budget.max_tokens"),
            ({"max_tokens": -5}, "budget.max_tokens"),
            ({"max_tokens": 10**15 + 1}, "budget.max_tokens"),
            ({"max_tokens": 1.5}, "budget.max_tokens"),
            ({"max_device_seconds": 0}, "budget.max_device_seconds"),
            ({"max_device_seconds": 2e9}, "budget.max_device_seconds"),
            ({"max_device_seconds": "lots"}, "budget.max_device_seconds"),
            ({}, "budget"),
            ({"max_dollars": 3}, "budget.max_dollars"),
        ],
    )
    def test_bad_budget_on_create_and_patch_is_422_naming_the_field(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue, dataset: str,
        budget: dict[str, Any], field: str,
    ) -> None:
        response = _create(client, tenant_a, job_spec(dataset, budget=budget))
        assert response.status_code == 422, response.text
        assert f"body.{field}" in _field_errors(response)

        job_id = _create(client, tenant_a, job_spec(dataset)).json()["id"]
        patched = client.patch(f"/v1/jobs/{job_id}", json={"budget": budget}, headers=tenant_a)
        assert patched.status_code == 422, patched.text
        assert f"body.{field}" in _field_errors(patched)

    def test_patch_needs_the_budget_key_and_nothing_else(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue, dataset: str
    ) -> None:
        job_id = _create(client, tenant_a, job_spec(dataset)).json()["id"]
        missing = client.patch(f"/v1/jobs/{job_id}", json={}, headers=tenant_a)
        assert missing.status_code == 422 and "body.budget" in _field_errors(missing)
        extra = client.patch(f"/v1/jobs/{job_id}", json={"budget": None, "name": "x"}, headers=tenant_a)
        assert extra.status_code == 422 and "body.name" in _field_errors(extra)

    def test_patch_sets_and_removes_the_budget_and_logs_it(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue, dataset: str
    ) -> None:
        job_id = _create(client, tenant_a, job_spec(dataset, budget={"max_device_seconds": 60})).json()["id"]
        response = client.patch(f"/v1/jobs/{job_id}", json={"budget": {"max_tokens": 500}}, headers=tenant_a)
        assert response.status_code == 200, response.text
        assert response.json()["spec"]["budget"] == {"max_tokens": 500, "max_device_seconds": None}
        assert client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()["spec"]["budget"]["max_tokens"] == 500
        removed = client.patch(f"/v1/jobs/{job_id}", json={"budget": None}, headers=tenant_a)
        assert removed.json()["spec"]["budget"] is None
        events = client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a).json()["data"]
        assert [e["data"]["budget"] for e in events if e["type"] == "budget_changed"] == [
            {"max_tokens": 500, "max_device_seconds": None}, None
        ]

    def test_patch_of_a_finished_or_foreign_job_is_refused(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, recording_queue: RecordingQueue,
        dataset: str,
    ) -> None:
        job_id = _create(client, tenant_a, job_spec(dataset)).json()["id"]
        body = {"budget": {"max_tokens": 10}}
        assert client.patch(f"/v1/jobs/{job_id}", json=body, headers=tenant_b).status_code == 404
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant_a).status_code == 200
        finished = client.patch(f"/v1/jobs/{job_id}", json=body, headers=tenant_a)
        assert finished.status_code == 409, finished.text
        assert finished.json()["error"]["details"]["current_status"] == "cancelled"


class TestUsageQuery:
    @pytest.mark.parametrize(
        ("params", "field"),
        [
            ({"start": "yesterday"}, "query.start"),
            ({"end": "2026-13-01"}, "query.end"),
            ({"group_by": "week"}, "query.group_by"),
            ({"start": "2026-11-20T00:00:00Z", "end": "2026-11-19T00:00:00Z"}, "end"),  # the service's check
            ({"start": "2026-11-20T00:00:00Z", "end": "2026-11-20T00:00:00Z"}, "end"),
        ],
    )
    def test_bad_parameters_are_422_naming_the_field(
        self, client: TestClient, tenant_a: TenantHeaders, params: dict[str, str], field: str
    ) -> None:
        response = client.get("/v1/usage", params=params, headers=tenant_a)
        assert response.status_code == 422, response.text
        assert field in _field_errors(response)

    def test_empty_usage_and_authentication(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        body = client.get("/v1/usage", headers=tenant_a).json()
        assert body["totals"] == {"steps": 0, "tokens_generated": 0, "tokens_trained": 0, "tokens": 0,
                                  "reward_calls": 0, "device_seconds": 0.0}
        assert body["group_by"] == "day" and body["data"] == []
        assert body["start"][8:10] == "01"  # the month's start
        assert client.get("/v1/usage").status_code == 401

    def test_a_tenant_sees_only_its_own_usage(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, recording_queue: RecordingQueue,
        dataset: str,
    ) -> None:
        job_id = _create(client, tenant_a, job_spec(dataset)).json()["id"]
        attempt = start_job(job_id)
        _record(job_id, 1, attempt, tokens=40)
        _record(job_id, 2, attempt, tokens=2)
        by_job = client.get("/v1/usage", params={"group_by": "job"}, headers=tenant_a).json()
        assert [(g["key"], g["tokens_generated"], g["tokens_trained"], g["steps"]) for g in by_job["data"]] == [
            (job_id, 42, 84, 2)
        ]
        assert client.get("/v1/usage", headers=tenant_b).json()["totals"]["tokens"] == 0
        assert client.get(f"/v1/jobs/{job_id}/usage", headers=tenant_b).status_code == 404


def _record(job_id: str, step: int, attempt: int, *, tokens: int) -> None:
    with session_scope() as session:
        job = load_job(job_id)
        job = session.merge(job)
        usage.record_step(session, job, step, attempt, StepUsageIn(
            tokens_generated=tokens, tokens_trained=2 * tokens, reward_calls=8, device_seconds=0.5 * tokens,
            completions=8, completion_capacity=8 * 16, num_iterations=1, parameters=5_000_000,
        ))


class TestEstimate:
    def test_defaults_without_calibration(
        self, client: TestClient, tenant_a: TenantHeaders, dataset: str
    ) -> None:
        spec = job_spec(dataset, hyperparameters={"max_steps": 10, "num_generations": 4, "prompts_per_step": 2,
                                                  "max_completion_length": 16})
        response = client.post("/v1/jobs/estimate", json=spec, headers=tenant_a)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["steps"] == 10 and body["tokens_generated"] == 10 * 8 * 16 and body["reward_calls"] == 80
        assert body["calibration"]["source"] == "default" and body["calibration"]["seconds_per_token"] == 0.01
        assert body["device_seconds"] == pytest.approx(body["tokens"] * 0.01)
        assert client.get("/v1/jobs", headers=tenant_a).json()["data"] == []  # nothing created

    def test_from_the_model_then_its_bucket(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue, dataset: str
    ) -> None:
        job_id = _create(client, tenant_a, job_spec(dataset)).json()["id"]
        _record(job_id, 1, start_job(job_id), tokens=64)  # half of the 128-token capacity
        spec = job_spec(dataset, hyperparameters={"max_steps": 2, "num_generations": 4, "prompts_per_step": 2,
                                                  "max_completion_length": 16, "num_iterations": 3})
        body = client.post("/v1/jobs/estimate", json=spec, headers=tenant_a).json()
        assert body["calibration"] == {"source": "model", "bucket": "<10M", "steps_observed": 1,
                                       "seconds_per_token": pytest.approx(32 / 192), "completion_fill": 0.5,
                                       "trained_per_generated": 6.0}
        assert body["tokens_generated"] == 2 * 8 * 8 and body["tokens_trained"] == 6 * 128
        assert body["device_seconds"] == pytest.approx((128 + 768) * 32 / 192)

    def test_bad_spec_is_422_naming_the_field(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = client.post("/v1/jobs/estimate", json=job_spec("ds_nope"), headers=tenant_a)
        assert response.status_code == 422 and "train_dataset" in _field_errors(response)


class TestBuckets:
    def test_sizes(self) -> None:
        assert [size_bucket(n) for n in (5_000_000, 50_000_000, 5 * 10**8, 7 * 10**9, 7 * 10**10)] == [
            "<10M", "10M-100M", "100M-1B", "1B-10B", "10B+"
        ]
        assert bucket_from_name("Qwen/Qwen2.5-0.5B-Instruct") == "100M-1B"
        assert bucket_from_name("HuggingFaceTB/SmolLM2-135M") == "100M-1B"
        assert bucket_from_name("meta-llama/Llama-3.2-1B") == "1B-10B"
        assert bucket_from_name("mistralai/Mistral-7b-v0.1") == "1B-10B"
        assert bucket_from_name("gpt2") is None and bucket_from_name("builtin:tiny") is None


def test_resume_refused_while_the_budget_is_reached(
    client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue, dataset: str
) -> None:
    job_id = _create(client, tenant_a, job_spec(dataset, budget={"max_device_seconds": 10})).json()["id"]
    attempt = start_job(job_id)
    _record(job_id, 1, attempt, tokens=20)  # 10 device-seconds: reached
    with session_scope() as session:
        job = session.merge(load_job(job_id))
        transition(session, job, JobStatus.paused, reason="test")
    refused = client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a)
    assert refused.status_code == 409
    assert refused.json()["error"]["details"] == {"field": "budget.max_device_seconds", "limit": 10, "used": 10.0}
    assert client.get(f"/v1/jobs/{job_id}/usage", headers=tenant_a).json()["budget"]["exhausted"] == (
        "budget.max_device_seconds"
    )
    client.patch(f"/v1/jobs/{job_id}", json={"budget": {"max_device_seconds": 11}}, headers=tenant_a)
    assert client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a).status_code == 200


def test_allow_header_of_the_estimate_route_and_of_a_job(client: TestClient, tenant_a: TenantHeaders) -> None:
    """`/v1/jobs/estimate` is its own resource, not a job id: a 405 there allows POST only."""
    estimate = client.request("PUT", "/v1/jobs/estimate", headers=tenant_a)
    assert estimate.status_code == 405 and estimate.headers["Allow"] == "POST"
    job = client.request("PUT", "/v1/jobs/job_123", headers=tenant_a)
    assert job.status_code == 405 and job.headers["Allow"] == "DELETE, GET, PATCH"


def _cap(tenant_id: str, *, tokens: int | None = None, device_seconds: float | None = None) -> None:
    from service.usage import repository

    with session_scope() as session:
        repository.set_tenant_budget(
            session, tenant_id, monthly_max_device_seconds=device_seconds, monthly_max_tokens=tokens
        )


def _job_ids(tenant_id: str) -> list[str]:
    from sqlalchemy import select

    from service.jobs.models import Job

    with session_scope() as session:
        return list(session.scalars(select(Job.id).where(Job.tenant_id == tenant_id)))


class TestMonthlyCapAtSubmission:
    """Issue 30: a tenant at or over a monthly cap is refused at submission, before any job exists or any step
    runs (it used to get 201 and a step before the worker paused the job with `budget_exhausted`)."""

    def _use(self, client: TestClient, tenant: TenantHeaders, dataset: str, tokens: int) -> str:
        job_id = _create(client, tenant, job_spec(dataset)).json()["id"]
        _record(job_id, 1, start_job(job_id), tokens=tokens)  # tokens generated + 2x trained
        return str(job_id)

    def test_over_the_token_cap_post_is_409_naming_the_cap_and_creates_nothing(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, dataset: str,
        recording_queue: RecordingQueue,
    ) -> None:
        used = self._use(client, tenant_a, dataset, tokens=20)  # 60 tokens this month
        _cap(tenant_a.tenant_id, tokens=50)
        sent = list(recording_queue.sent)
        response = _create(client, tenant_a, job_spec(dataset))
        assert response.status_code == 409, response.text
        assert response.json()["error"] == {
            "code": "budget_exhausted",
            "message": "tenant.monthly_max_tokens 50 reached (used 60): no job can start until the cap is raised or "
            "the month ends",
            "details": {"field": "tenant.monthly_max_tokens", "limit": 50, "used": 60},
        }
        assert _job_ids(tenant_a.tenant_id) == [used] and recording_queue.sent == sent
        # Another tenant is not affected; raising the cap lets the tenant submit again.
        assert _create(client, tenant_b, job_spec(make_dataset(tenant_b.tenant_id))).status_code == 201
        _cap(tenant_a.tenant_id, tokens=61)
        assert _create(client, tenant_a, job_spec(dataset)).status_code == 201

    def test_at_the_cap_exactly_is_refused_below_it_is_not(
        self, client: TestClient, tenant_a: TenantHeaders, dataset: str, recording_queue: RecordingQueue
    ) -> None:
        self._use(client, tenant_a, dataset, tokens=20)  # 10 device-seconds
        _cap(tenant_a.tenant_id, device_seconds=10.5)
        assert _create(client, tenant_a, job_spec(dataset)).status_code == 201
        _cap(tenant_a.tenant_id, device_seconds=10)
        refused = _create(client, tenant_a, job_spec(dataset))
        assert refused.status_code == 409
        assert refused.json()["error"]["details"] == {
            "field": "tenant.monthly_max_device_seconds", "limit": 10.0, "used": 10.0
        }

    def test_the_default_cap_from_settings_applies(
        self, client: TestClient, tenant_a: TenantHeaders, dataset: str, recording_queue: RecordingQueue,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        from service.kit.config import get_settings

        self._use(client, tenant_a, dataset, tokens=20)
        monkeypatch.setenv("GRPO_MONTHLY_MAX_TOKENS", "60")
        get_settings.cache_clear()
        refused = _create(client, tenant_a, job_spec(dataset))
        assert refused.status_code == 409 and refused.json()["error"]["details"]["field"] == "tenant.monthly_max_tokens"

    def test_the_openai_compatible_door_refuses_too(
        self, client: TestClient, tenant_a: TenantHeaders, dataset: str, recording_queue: RecordingQueue
    ) -> None:
        from tests.service.test_openai_api import BASE, job_body, upload

        file_id = upload(client, tenant_a)["id"]
        used = self._use(client, tenant_a, dataset, tokens=20)
        _cap(tenant_a.tenant_id, tokens=1)
        response = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=job_body(file_id))
        assert response.status_code == 409, response.text
        assert "tenant.monthly_max_tokens 1 reached" in response.json()["error"]["message"]
        assert _job_ids(tenant_a.tenant_id) == [used]
