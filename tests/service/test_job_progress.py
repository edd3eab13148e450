"""What the worker reports (domain functions) and how the API shows it: events, metrics, samples."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.jobs import progress
from service.jobs import service as jobs_service
from service.jobs.schemas import SampleIn
from service.jobs.states import JobStatus
from service.kit.config import Settings
from service.kit.db import session_scope
from service.kit.errors import ValidationFailed
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset, start_job


def create(client: TestClient, headers: TenantHeaders) -> str:
    response = client.post("/v1/jobs", json=job_spec(make_dataset(headers.tenant_id)), headers=headers)
    assert response.status_code == 201
    job_id: str = response.json()["id"]
    return job_id


def record_steps(job_id: str, attempt: int, steps: range) -> None:
    for step in steps:
        with session_scope() as session:
            progress.record_metrics(
                session, job_id, attempt, step, {"loss": 1.0 / step, "reward": step * 0.1}
            )


class TestMetrics:
    def test_series_progress_and_latest_metrics(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        record_steps(job_id, attempt, range(1, 6))

        job = client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()
        assert job["progress"] == {"step": 5, "total_steps": 10}
        assert job["metrics"] == {"loss": pytest.approx(0.2), "reward": pytest.approx(0.5)}

        body = client.get(f"/v1/jobs/{job_id}/metrics", headers=tenant_a).json()
        assert body["series"]["reward"]["steps"] == [1, 2, 3, 4, 5]
        assert body["series"]["reward"]["values"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
        assert body["has_more"] is False

        only = client.get(
            f"/v1/jobs/{job_id}/metrics", params={"names": "loss", "since_step": 4}, headers=tenant_a
        ).json()
        assert list(only["series"]) == ["loss"]
        assert only["series"]["loss"]["steps"] == [4, 5]

    def test_the_latest_eval_stays_in_the_job_metrics_between_evals(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        with session_scope() as session:
            progress.record_metrics(session, job_id, attempt, 0, {"eval/accuracy": 0.4})
        record_steps(job_id, attempt, range(1, 3))
        with session_scope() as session:
            progress.record_metrics(session, job_id, attempt, 3, {"loss": 0.1, "eval/accuracy": 0.9})
        record_steps(job_id, attempt, range(4, 5))
        job = client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()
        assert job["metrics"] == {"loss": pytest.approx(0.25), "reward": pytest.approx(0.4), "eval/accuracy": 0.9}
        events = client.get(f"/v1/jobs/{job_id}/events", params={"types": "metrics"}, headers=tenant_a).json()["data"]
        assert "eval/accuracy" not in events[-1]["data"]["metrics"]  # the event carries that step's values only

    def test_pages_never_split_a_step(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create(client, tenant_a)
        record_steps(job_id, start_job(job_id), range(1, 4))  # 2 metrics per step
        page = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 3}, headers=tenant_a).json()
        assert page["series"]["loss"]["steps"] == [1]
        assert page["has_more"] is True and page["next_since_step"] == 2

    def test_a_re_run_step_replaces_its_values(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        record_steps(job_id, attempt, range(1, 3))
        with session_scope() as session:
            progress.record_metrics(session, job_id, attempt, 2, {"loss": 9.0})
        series = client.get(f"/v1/jobs/{job_id}/metrics", headers=tenant_a).json()["series"]
        assert series["loss"] == {"steps": [1, 2], "values": [1.0, 9.0]}

    def test_non_finite_metrics_are_rejected_by_name(
        self, settings: Settings, tenant_a: TenantHeaders
    ) -> None:
        with pytest.raises(ValidationFailed, match="loss"), session_scope() as session:
            progress.record_metrics(session, "job_x", 1, 1, {"loss": float("nan"), "ok": 1.0})


class TestEvents:
    def test_every_transition_and_report_is_an_event_in_order(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        record_steps(job_id, attempt, range(1, 3))
        with session_scope() as session:
            progress.record_event(session, job_id, attempt, "log", "loaded model", {"params": 123})
        with session_scope() as session:
            progress.worker_transition(session, job_id, attempt, JobStatus.succeeded, reason="done")

        events = client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a).json()["data"]
        kinds = [(e["type"], e["data"].get("to") or e["data"].get("step") or e["message"]) for e in events]
        assert kinds == [
            ("status", "queued"),
            ("status", "running"),
            ("metrics", 1),
            ("metrics", 2),
            ("log", "loaded model"),
            ("status", "succeeded"),
        ]
        ids = [e["id"] for e in events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)

        page = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 4}, headers=tenant_a).json()
        assert [e["id"] for e in page["data"]] == ids[:4] and page["next_after"] == ids[3]
        rest = client.get(f"/v1/jobs/{job_id}/events", params={"after": ids[3]}, headers=tenant_a).json()
        assert [e["id"] for e in rest["data"]] == ids[4:] and rest["has_more"] is False
        status_only = client.get(f"/v1/jobs/{job_id}/events", params={"types": "status"}, headers=tenant_a)
        assert [e["data"]["to"] for e in status_only.json()["data"]] == ["queued", "running", "succeeded"]

    def test_failed_job_shows_its_error(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        with session_scope() as session:
            progress.worker_transition(
                session,
                job_id,
                attempt,
                JobStatus.failed,
                reason="reward endpoint kept failing",
                error_code="reward_invalid_response",
                error_message="reward source 'remote:rf_1': 3 scores for 4 items",
            )
        job = client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()
        assert job["status"] == "failed"
        assert job["error"] == {
            "code": "reward_invalid_response",
            "message": "reward source 'remote:rf_1': 3 scores for 4 items",
        }
        assert job["finished_at"] is not None and job["started_at"] is not None


    def test_text_a_database_cannot_hold_is_recorded_with_replacement_characters(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        """An endpoint's error text with U+0000 or a lone surrogate (PostgreSQL refuses the first, UTF-8 the
        second) is recorded with U+FFFD in events and the job's error, instead of failing the report."""
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        with session_scope() as session:
            progress.record_event(session, job_id, attempt, "reward_degraded", "endpoint said \x00 and \ud800",
                                  {"detail": ["bad\x00"], "key\x00": 1})
            progress.worker_transition(session, job_id, attempt, JobStatus.failed, reason="endpoint said \x00",
                                       error_code="reward_invalid_response", error_message="\ud83d \x00")
        events = client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a).json()["data"]
        degraded = next(e for e in events if e["type"] == "reward_degraded")
        assert degraded["message"] == "endpoint said \ufffd and \ufffd"
        assert degraded["data"] == {"detail": ["bad\ufffd"], "key\ufffd": 1}
        assert events[-1]["data"]["reason"] == "endpoint said \ufffd"
        job = client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()
        assert job["error"]["message"] == "\ufffd \ufffd"


class TestSamples:
    def test_samples_by_step_with_per_source_rewards(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        for step in (10, 20):
            samples = [
                SampleIn(
                    prompt=f"p{step}-{i}",
                    completion=f"c{i}",
                    reward=0.5 * i,
                    rewards={"exact_match": float(i), "remote:rf_1": None},
                    policy_version=step - 1 - i,  # i steps stale (async generation)
                )
                for i in range(3)
            ]
            with session_scope() as session:
                assert progress.record_samples(session, job_id, attempt, step, samples) == 3
        body = client.get(f"/v1/jobs/{job_id}/samples", params={"step": 20}, headers=tenant_a).json()
        assert [s["prompt"] for s in body["data"]] == ["p20-0", "p20-1", "p20-2"]
        assert body["data"][1]["rewards"] == {"exact_match": 1.0, "remote:rf_1": None}
        assert body["data"][1]["reward"] == 0.5
        assert [s["policy_version"] for s in body["data"]] == [19, 18, 17]
        everything = client.get(f"/v1/jobs/{job_id}/samples", params={"limit": 4}, headers=tenant_a).json()
        assert len(everything["data"]) == 4 and everything["has_more"] is True


class TestFencing:
    def test_a_stale_attempt_cannot_report(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        calls: list[Any] = [
            lambda s: progress.record_metrics(s, job_id, attempt + 1, 1, {"loss": 1.0}),
            lambda s: progress.record_event(s, job_id, attempt - 1, "log", "zombie"),
            lambda s: progress.worker_transition(s, job_id, attempt + 1, JobStatus.succeeded, reason="x"),
        ]
        for call in calls:
            with pytest.raises(progress.StaleAttempt), session_scope() as session:
                call(session)
        # Once the job left the worker (cancelled while queued again, say), even the right attempt is stale.
        client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant_a)  # -> cancelling: still the worker's
        with session_scope() as session:
            progress.worker_transition(session, job_id, attempt, JobStatus.cancelled, reason="stopped")
        with pytest.raises(progress.StaleAttempt), session_scope() as session:
            progress.record_metrics(session, job_id, attempt, 2, {"loss": 1.0})

    def test_status_events_only_come_from_transitions(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        with pytest.raises(ValidationFailed), session_scope() as session:
            progress.record_event(session, job_id, attempt, "status", "forged")

    def test_illegal_worker_transition_is_409_naming_the_state(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        from service.kit.errors import IllegalTransition

        job_id = create(client, tenant_a)
        attempt = start_job(job_id)
        client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant_a)
        with pytest.raises(IllegalTransition, match="cancelling"), session_scope() as session:
            progress.worker_transition(
                session, job_id, attempt, JobStatus.succeeded, reason="finished anyway"
            )


class TestDatasetInUse:
    def test_only_unfinished_jobs_hold_a_dataset(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        dataset_id = make_dataset(tenant_a.tenant_id)
        response = client.post("/v1/jobs", json=job_spec(dataset_id), headers=tenant_a)
        job_id = response.json()["id"]
        with session_scope() as session:
            assert jobs_service.dataset_in_use(session, tenant_a.tenant_id, dataset_id)
            assert not jobs_service.dataset_in_use(session, "tn_other", dataset_id)
        client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant_a)
        with session_scope() as session:
            assert not jobs_service.dataset_in_use(session, tenant_a.tenant_id, dataset_id)
