"""Idempotency-Key on POST /v1/jobs: replay, mismatch, in-flight conflict, 50 concurrent duplicates."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from service.jobs.models import IdempotencyKey, Job
from service.kit.db import session_scope, utcnow
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, job_spec, make_dataset, recording_queue

__all__ = ["recording_queue"]


def count_jobs() -> int:
    with session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


class TestIdempotencyKey:
    def test_same_key_same_body_replays_the_original_response(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id))
        headers = {**tenant_a, "Idempotency-Key": "create-1"}
        first = client.post("/v1/jobs", json=spec, headers=headers)
        second = client.post("/v1/jobs", json=spec, headers=headers)
        assert first.status_code == second.status_code == 201
        assert second.json() == first.json()
        assert second.headers.get("Idempotent-Replayed") == "true"
        assert "Idempotent-Replayed" not in first.headers
        assert count_jobs() == 1
        assert len(recording_queue.sent) == 1

    def test_same_key_different_body_is_422(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id))
        headers = {**tenant_a, "Idempotency-Key": "create-1"}
        assert client.post("/v1/jobs", json=spec, headers=headers).status_code == 201
        response = client.post("/v1/jobs", json={**spec, "name": "other"}, headers=headers)
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "idempotency_key_reused"
        assert count_jobs() == 1

    def test_keys_are_scoped_to_the_tenant(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        for tenant in (tenant_a, tenant_b):
            spec = job_spec(make_dataset(tenant.tenant_id))
            response = client.post("/v1/jobs", json=spec, headers={**tenant, "Idempotency-Key": "shared"})
            assert response.status_code == 201
        assert count_jobs() == 2

    def test_a_failed_request_releases_the_key(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        headers = {**tenant_a, "Idempotency-Key": "retry-me"}
        bad = client.post("/v1/jobs", json=job_spec("ds_missing"), headers=headers)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"
        fixed = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=headers)
        assert fixed.status_code == 201

    def test_in_flight_duplicate_is_409_and_an_abandoned_claim_expires(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id))
        headers = {**tenant_a, "Idempotency-Key": "slow"}
        with session_scope() as session:  # a request still being processed holds the claim
            session.add(
                IdempotencyKey(
                    tenant_id=tenant_a.tenant_id,
                    key="slow",
                    request_hash=_hash_of(spec),
                    state="in_flight",
                    created_at=utcnow(),
                )
            )
        response = client.post("/v1/jobs", json=spec, headers=headers)
        assert response.status_code == 409
        assert response.json()["error"]["code"] == "idempotency_key_in_flight"
        with session_scope() as session:  # ... whose process died long ago
            session.execute(update(IdempotencyKey).values(created_at=utcnow() - timedelta(hours=1)))
        assert client.post("/v1/jobs", json=spec, headers=headers).status_code == 201

    def test_completed_key_older_than_the_ttl_can_be_reused(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        headers = {**tenant_a, "Idempotency-Key": "old"}
        first = client.post(
            "/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=headers
        ).json()
        with session_scope() as session:
            session.execute(update(IdempotencyKey).values(created_at=utcnow() - timedelta(hours=25)))
        again = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=headers)
        assert again.status_code == 201 and again.json()["id"] != first["id"]

    def test_invalid_key_is_422(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id))
        response = client.post("/v1/jobs", json=spec, headers={**tenant_a, "Idempotency-Key": "x" * 256})
        assert response.status_code == 422
        assert "Idempotency-Key" in response.json()["error"]["message"]

    def test_50_concurrent_posts_with_one_key_create_exactly_one_job(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id))
        headers = {**tenant_a, "Idempotency-Key": "burst"}

        def post(_: int) -> tuple[int, str | None]:
            response = client.post("/v1/jobs", json=spec, headers=headers)
            return response.status_code, response.json().get("id")

        with ThreadPoolExecutor(max_workers=50) as pool:
            results = list(pool.map(post, range(50)))
        statuses = Counter(status for status, _ in results)
        assert set(statuses) <= {201, 409}, statuses
        created_ids = {job_id for status, job_id in results if status == 201}
        assert len(created_ids) == 1
        assert count_jobs() == 1
        assert [job_id for job_id, _ in recording_queue.sent] == list(created_ids)


def _hash_of(spec: dict[str, object]) -> str:
    from contract.spec import JobSpec
    from service.jobs.idempotency import request_hash

    return request_hash(JobSpec.model_validate(spec).model_dump(mode="json"))
