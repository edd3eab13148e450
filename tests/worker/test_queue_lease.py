"""Claim, fencing and reaper semantics on real SQLite and PostgreSQL (no broker, no torch)."""

from __future__ import annotations

import os
from dataclasses import asdict
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from service.checkpoints.models import Checkpoint
from service.execution import reporting
from service.execution.lease import Claim, LeaseLost, claim_job
from service.execution.reaper import LEASE_EXPIRED_EVENT, WORKER_LOST, reap_once
from service.jobs.models import IdempotencyKey, Job, JobEvent, JobMetric
from service.jobs.states import JobStatus
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.storage import checkpoint_key, get_storage
from tests.service.factories import TenantHeaders
from tests.worker.conftest import RecordingQueue, insert_job
from worker.nodes import Invitation, attempt_owns_job, join


@pytest.fixture
def job_id(settings: Settings, tenant_a: TenantHeaders) -> str:
    with session_scope() as session:
        return insert_job(session, tenant_a.tenant_id).id


def _claim(job_id: str, worker: str = "w1", lease: int = 60) -> Claim | None:
    with session_scope() as session:
        return claim_job(session, job_id, worker, lease)


def _job(job_id: str) -> Job:
    with session_scope() as session:
        return session.execute(select(Job).where(Job.id == job_id)).scalar_one()


def _expire_lease(job_id: str) -> None:
    with session_scope() as session:
        session.execute(
            update(Job).where(Job.id == job_id).values(lease_until=utcnow() - timedelta(seconds=1))
        )


def _event_types(job_id: str) -> list[str]:
    with session_scope() as session:
        return list(
            session.scalars(select(JobEvent.type).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
        )


class TestClaim:
    def test_first_claim_starts_attempt_one(self, job_id: str) -> None:
        claim = _claim(job_id)
        assert claim is not None and claim.attempt == 1 and claim.resume_step == 0
        job = _job(job_id)
        assert (job.status, job.attempt, job.worker_id) == ("running", 1, "w1")
        assert job.lease_until is not None and job.lease_until > utcnow()

    def test_duplicate_delivery_is_refused(self, job_id: str) -> None:
        assert _claim(job_id, "w1") is not None
        assert _claim(job_id, "w2") is None
        assert _job(job_id).attempt == 1

    def test_cancelled_queued_job_never_starts(self, job_id: str) -> None:
        with session_scope() as session:
            job = session.get(Job, job_id)
            assert job is not None
            from service.jobs.service import cancel_job

            cancel_job(session, job.tenant_id, job_id)
        assert _claim(job_id) is None
        assert _job(job_id).status == "cancelled"

    def test_expired_lease_can_be_taken_over(self, job_id: str) -> None:
        first = _claim(job_id, "w1")
        assert first is not None
        _expire_lease(job_id)
        second = _claim(job_id, "w2")
        assert second is not None and second.attempt == 2
        assert "lease_taken_over" in _event_types(job_id)


class TestFencing:
    def test_old_attempt_writes_are_refused_after_takeover(self, job_id: str) -> None:
        old = _claim(job_id, "w1")
        assert old is not None
        reporting.record_step(old, 1, {"loss": 0.5}, [])
        _expire_lease(job_id)
        new = _claim(job_id, "w2")
        assert new is not None
        with pytest.raises(LeaseLost):
            reporting.record_step(old, 2, {"loss": 0.4}, [])
        with pytest.raises(LeaseLost):
            reporting.finish(old, JobStatus.succeeded, reason="late")
        reporting.record_step(new, 1, {"loss": 0.3}, [])
        with session_scope() as session:
            rows = session.execute(
                select(JobMetric.step, JobMetric.attempt).where(JobMetric.job_id == job_id)
            ).all()
        assert sorted(rows) == [(1, 2)]
        assert _job(job_id).status == "running"

    def test_claim_discards_steps_after_latest_checkpoint(self, job_id: str) -> None:
        old = _claim(job_id)
        assert old is not None
        for step in (1, 2, 3):
            reporting.record_step(old, step, {"loss": float(step)}, [])
        get_storage().put_stream(checkpoint_key(job_id, "ckpt_test2", "a.bin"), [b"x"])
        reporting.record_checkpoint(
            old, checkpoint_id="ckpt_test2", step=2, files={"a.bin": {"size": 1, "sha256": "0" * 64}}
        )
        _expire_lease(job_id)
        new = _claim(job_id, "w2")
        assert new is not None and new.resume_step == 2 and new.resume_checkpoint_id == "ckpt_test2"
        with session_scope() as session:
            steps = sorted(session.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)))
            assert session.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job_id)) == "ckpt_test2"
        assert steps == [1, 2]
        assert _job(job_id).current_step == 2

    def test_finish_honours_a_cancel_requested_meanwhile(self, job_id: str) -> None:
        claim = _claim(job_id)
        assert claim is not None
        with session_scope() as session:
            from service.jobs.service import cancel_job

            cancel_job(session, _job(job_id).tenant_id, job_id)
        assert reporting.finish(claim, JobStatus.succeeded, reason="done") is JobStatus.cancelled
        assert _job(job_id).status == "cancelled"


class TestReaper:
    def test_expired_lease_is_requeued_then_failed_after_max_attempts(
        self, job_id: str, settings: Settings
    ) -> None:
        queue = RecordingQueue()
        for attempt in range(1, settings.max_attempts + 1):
            claim = _claim(job_id, f"w{attempt}")
            assert claim is not None and claim.attempt == attempt
            assert not reap_once(queue, settings).requeued  # lease still valid: untouched
            _expire_lease(job_id)
            report = reap_once(queue, settings)
            if attempt < settings.max_attempts:
                assert report.requeued == [job_id]
                assert _job(job_id).status == "queued"
            else:
                assert report.failed == [job_id]
        job = _job(job_id)
        assert job.status == "failed" and job.error_code == WORKER_LOST
        assert queue.sent == [(job_id, job.queue)] * (settings.max_attempts - 1)
        assert _event_types(job_id).count(LEASE_EXPIRED_EVENT) == settings.max_attempts

    def test_pause_requested_job_whose_worker_died_is_paused(self, job_id: str, settings: Settings) -> None:
        assert _claim(job_id) is not None
        with session_scope() as session:
            from service.jobs.service import pause_job

            pause_job(session, _job(job_id).tenant_id, job_id)
        _expire_lease(job_id)
        assert reap_once(RecordingQueue(), settings).paused == [job_id]
        assert _job(job_id).status == "paused"

    def test_stale_queued_job_is_resent_once_per_period(self, job_id: str, settings: Settings) -> None:
        queue = RecordingQueue()
        assert not reap_once(queue, settings).resent
        later = utcnow() + timedelta(seconds=settings.queued_resend_seconds + 1)
        assert reap_once(queue, settings, now=later).resent == [job_id]
        assert not reap_once(queue, settings, now=later).resent
        assert queue.sent == [(job_id, _job(job_id).queue)]

    def test_idempotency_keys_older_than_the_ttl_are_deleted(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        now = utcnow()
        cutoff = now - timedelta(hours=settings.idempotency_ttl_hours)
        ages = {  # key -> created_at; a key created exactly at the cutoff is not yet expired (as claims see it)
            "old": cutoff - timedelta(seconds=1),
            "old-in-flight": cutoff - timedelta(days=30),
            "at-cutoff": cutoff,
            "fresh": cutoff + timedelta(seconds=1),
            "new": now,
        }
        with session_scope() as session:
            for tenant in (tenant_a, tenant_b):
                for key, created_at in ages.items():
                    in_flight = key.endswith("in-flight")
                    session.add(IdempotencyKey(
                        tenant_id=tenant.tenant_id, key=key, request_hash="0" * 64,
                        state="in_flight" if in_flight else "completed", created_at=created_at,
                        status_code=None if in_flight else 201, response=None if in_flight else {"id": key},
                    ))
        report = reap_once(RecordingQueue(), settings, now=now)
        assert report.idempotency_keys_purged == 4 and report
        with session_scope() as session:
            left = session.execute(select(IdempotencyKey.tenant_id, IdempotencyKey.key)).all()
        assert sorted(left) == sorted(
            (tenant.tenant_id, key) for tenant in (tenant_a, tenant_b) for key in ("at-cutoff", "fresh", "new")
        )
        assert not reap_once(RecordingQueue(), settings, now=now).idempotency_keys_purged


class TestNodeInvitation:
    """worker.nodes.join: an invitation whose attempt no longer owns the job launches nothing."""

    @staticmethod
    def _invitation(claim: Claim) -> Invitation:
        return Invitation(
            claim=asdict(claim), queue="cpu", endpoint="127.0.0.1:1", run_id="0" * 32, node_rank=1, nnodes=2,
            nproc_per_node=1,
        )

    def test_an_invitation_of_an_attempt_that_was_taken_over_is_dropped(self, job_id: str) -> None:
        first = _claim(job_id)
        assert first is not None and attempt_owns_job(job_id, first.attempt)
        _expire_lease(job_id)
        second = _claim(job_id, worker="w2")
        assert second is not None and second.attempt == 2
        assert not attempt_owns_job(job_id, first.attempt) and attempt_owns_job(job_id, second.attempt)
        assert join(self._invitation(first)) == "stale"

    def test_an_invitation_of_a_finished_job_is_dropped(self, job_id: str) -> None:
        claim = _claim(job_id)
        assert claim is not None
        reporting.finish(claim, JobStatus.succeeded, reason="done")
        assert join(self._invitation(claim)) == "stale"


def test_worker_parent_and_api_never_import_torch() -> None:
    """The Celery parent forks job children: it must not import torch (CUDA). Nor may the API."""
    import subprocess
    import sys

    code = "import sys, worker.tasks, cli, service.app, service.execution.reaper; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("preload", "loaded"), [("false", False), ("true", True)])
def test_the_worker_parent_imports_the_engine_only_when_told_to(preload: str, loaded: bool) -> None:
    """GRPO_WORKER_PRELOAD_ENGINE (CPU-only workers): the parent imports the engine before its pool forks."""
    import subprocess
    import sys

    code = "import sys; from worker.celery_app import preload_engine; preload_engine(); print('torch' in sys.modules)"
    env = {**os.environ, "GRPO_WORKER_PRELOAD_ENGINE": preload}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == str(loaded)


def test_worker_process_knows_every_table() -> None:
    """What `grpo worker` imports resolves every foreign key (jobs.tenant_id -> tenants), so its writes can flush."""
    import subprocess
    import sys

    code = (
        "import cli, worker.tasks; from service.kit.db import Base; "
        "print(sorted(t.name for t in Base.metadata.sorted_tables))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "tenants" in out.stdout and "jobs" in out.stdout, out.stdout
