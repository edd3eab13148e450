"""Enqueue after commit: a task is sent only for a committed job, never for a rolled-back one."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from contract.spec import JobSpec
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.kit.config import Settings
from service.kit.db import session_scope
from service.kit.queue import get_job_queue
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, job_spec, make_dataset


class CommittedCheckingQueue(RecordingQueue):
    """Records, and checks at send time that the job is already visible to another connection."""

    def __init__(self) -> None:
        super().__init__()
        self.visible_at_send: list[bool] = []

    def send_job(self, job_id: str, *, queue: str) -> None:
        with session_scope() as other:
            self.visible_at_send.append(other.get(Job, job_id) is not None)
        super().send_job(job_id, queue=queue)


class BrokenQueue:
    def send_job(self, job_id: str, *, queue: str) -> None:
        raise ConnectionError("broker down")


def count_jobs() -> int:
    with session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


class TestEnqueueAfterCommit:
    def test_task_is_sent_after_the_row_is_committed(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        queue = CommittedCheckingQueue()
        client.app.dependency_overrides[get_job_queue] = lambda: queue  # type: ignore[attr-defined]
        response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a)
        assert response.status_code == 201
        assert queue.sent == [(response.json()["id"], "cpu")]
        assert queue.visible_at_send == [True]

    def test_failing_transaction_sends_nothing(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        queue = RecordingQueue()
        spec = JobSpec.model_validate(job_spec(make_dataset(tenant_a.tenant_id)))
        with pytest.raises(RuntimeError), session_scope() as session:
            jobs_service.create_job(session, tenant_a.tenant_id, spec, queue)  # registers the send
            raise RuntimeError("something after the job was created fails")
        assert queue.sent == []
        assert count_jobs() == 0
        # The session used next starts clean: a later successful commit sends only its own job.
        with session_scope() as session:
            job = jobs_service.create_job(session, tenant_a.tenant_id, spec, queue)
        assert queue.sent == [(job.id, "cpu")]

    def test_failing_commit_sends_nothing(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        queue = RecordingQueue()
        spec = JobSpec.model_validate(job_spec(make_dataset(tenant_a.tenant_id)))
        with pytest.raises(Exception, match="(?i)unique|duplicate"), session_scope() as session:
            job = jobs_service.create_job(session, tenant_a.tenant_id, spec, queue)
            session.expunge(job)
            # A second row with the same primary key makes the flush at commit time fail.
            clone = Job(**{c.key: getattr(job, c.key) for c in Job.__table__.columns if c.key != "metadata"})
            clone.metadata_ = {}
            session.add(clone)
        assert queue.sent == []
        assert count_jobs() == 0

    def test_broker_down_after_commit_keeps_the_job_queued(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        client.app.dependency_overrides[get_job_queue] = BrokenQueue  # type: ignore[attr-defined]
        response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a)
        assert response.status_code == 201  # the job exists; the sweeper re-sends lost messages
        got = client.get(f"/v1/jobs/{response.json()['id']}", headers=tenant_a)
        assert got.json()["status"] == "queued"
