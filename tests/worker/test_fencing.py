"""Direct tests of each fencing guard alone, on SQLite and PostgreSQL: `fence`, `load_owned_job`, `rewind_to`,
`Heartbeat.lost`. Each case changes one condition (the attempt, or the status) so a guard that dropped one of
its checks fails here even where another layer would have caught the write."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from service.checkpoints.models import Checkpoint
from service.execution import reporting
from service.execution.lease import (
    Claim,
    Heartbeat,
    LeaseLost,
    claim_job,
    fence,
    latest_checkpoint,
    rewind_to,
)
from service.jobs import progress
from service.jobs.models import Job, JobMetric, JobSample
from service.jobs.schemas import SampleIn
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.kit.errors import NotFound
from service.storage import checkpoint_key, get_storage
from tests.service.factories import TenantHeaders
from tests.worker.conftest import insert_job


@pytest.fixture
def claim(settings: Settings, tenant_a: TenantHeaders) -> Claim:
    with session_scope() as session:
        job_id = insert_job(session, tenant_a.tenant_id).id
    with session_scope() as session:
        claimed = claim_job(session, job_id, "w1", 60)
    assert claimed is not None
    return claimed


def _set(job_id: str, **values: object) -> None:
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def _job(job_id: str) -> Job:
    with session_scope() as session:
        return session.execute(select(Job).where(Job.id == job_id)).scalar_one()


def _lease(job_id: str) -> datetime:
    lease = _job(job_id).lease_until
    assert lease is not None
    return lease


def _newer_attempt_runs(claim: Claim) -> None:
    """Another attempt owns the job; the status stays `running`, so only the attempt check can refuse."""
    _set(claim.job_id, attempt=claim.attempt + 1)


class TestFence:
    def test_owner_renews_its_lease(self, claim: Claim) -> None:
        _set(claim.job_id, lease_until=utcnow() + timedelta(seconds=5))
        with session_scope() as session:
            fence(session, claim)
        assert _lease(claim.job_id) > utcnow() + timedelta(seconds=50)

    def test_older_attempt_of_a_running_job_is_refused(self, claim: Claim) -> None:
        _newer_attempt_runs(claim)
        lease_before = _job(claim.job_id).lease_until
        with pytest.raises(LeaseLost), session_scope() as session:
            fence(session, claim)
        assert _job(claim.job_id).lease_until == lease_before

    @pytest.mark.parametrize("status", ["queued", "paused", "succeeded", "cancelled"])
    def test_same_attempt_of_a_job_no_longer_running_is_refused(self, claim: Claim, status: str) -> None:
        _set(claim.job_id, status=status)
        with pytest.raises(LeaseLost), session_scope() as session:
            fence(session, claim)

    def test_cancelling_job_is_still_owned(self, claim: Claim) -> None:
        _set(claim.job_id, status="cancelling")
        with session_scope() as session:
            fence(session, claim)


class TestLoadOwnedJob:
    def test_owner_gets_the_row(self, claim: Claim) -> None:
        with session_scope() as session:
            assert progress.load_owned_job(session, claim.job_id, claim.attempt).id == claim.job_id

    def test_older_attempt_of_a_running_job_is_refused(self, claim: Claim) -> None:
        _newer_attempt_runs(claim)
        with pytest.raises(progress.StaleAttempt) as info, session_scope() as session:
            progress.load_owned_job(session, claim.job_id, claim.attempt)
        assert info.value.details == {"current_status": "running", "current_attempt": claim.attempt + 1}

    def test_same_attempt_of_a_paused_job_is_refused(self, claim: Claim) -> None:
        _set(claim.job_id, status="paused")
        with pytest.raises(progress.StaleAttempt), session_scope() as session:
            progress.load_owned_job(session, claim.job_id, claim.attempt)

    def test_unknown_job_is_not_found(self, claim: Claim) -> None:
        with pytest.raises(NotFound), session_scope() as session:
            progress.load_owned_job(session, "job_missing", claim.attempt)


def _checkpoint(claim: Claim, step: int) -> str:
    checkpoint_id = f"ckpt_fence{step}"
    get_storage().put_stream(checkpoint_key(claim.job_id, checkpoint_id, "a.bin"), [b"x"])
    reporting.record_checkpoint(
        claim, checkpoint_id=checkpoint_id, step=step, files={"a.bin": {"size": 1, "sha256": "0" * 64}}
    )
    return checkpoint_id


def _steps(job_id: str) -> tuple[list[int], list[int], list[int]]:
    with session_scope() as session:
        metrics = sorted(set(session.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id))))
        samples = sorted(set(session.scalars(select(JobSample.step).where(JobSample.job_id == job_id))))
        checkpoints = sorted(session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
    return metrics, samples, checkpoints


class TestRewindTo:
    def _history(self, claim: Claim) -> str:
        sample = [SampleIn(prompt="p", completion="c", reward=1.0, rewards={})]
        saved = []
        for step in (1, 2, 3, 4):
            reporting.record_step(claim, step, {"loss": float(step)}, sample)
            if step in (2, 4):
                saved.append(_checkpoint(claim, step))
        return saved[0]

    def test_rewinds_to_an_older_checkpoint(self, claim: Claim) -> None:
        older = self._history(claim)
        with session_scope() as session:
            checkpoint = latest_checkpoint(session, claim.job_id, before_step=4)
            assert checkpoint is not None and checkpoint.id == older
            rewind_to(session, claim, checkpoint)
        assert _steps(claim.job_id) == ([1, 2], [1, 2], [2])
        job = _job(claim.job_id)
        assert (job.current_step, job.resume_checkpoint_id) == (2, older)

    def test_rewinds_to_the_start_without_a_checkpoint(self, claim: Claim) -> None:
        self._history(claim)
        with session_scope() as session:
            rewind_to(session, claim, None)
        assert _steps(claim.job_id) == ([], [], [])
        job = _job(claim.job_id)
        assert (job.current_step, job.resume_checkpoint_id) == (0, None)

    def test_a_stale_attempt_rewinds_nothing(self, claim: Claim) -> None:
        self._history(claim)
        _newer_attempt_runs(claim)
        with pytest.raises(LeaseLost), session_scope() as session:
            rewind_to(session, claim, None)
        assert _steps(claim.job_id) == ([1, 2, 3, 4], [1, 2, 3, 4], [2, 4])
        assert _job(claim.job_id).current_step == 4


class TestHeartbeat:
    def _short_claim(self, claim: Claim) -> Claim:
        return Claim(claim.job_id, claim.attempt, claim.worker_id, 1, claim.resume_step, claim.resume_checkpoint_id)

    def test_renews_while_owned(self, claim: Claim) -> None:
        short = self._short_claim(claim)
        _set(claim.job_id, lease_until=utcnow() - timedelta(seconds=30))
        with Heartbeat(short) as heartbeat:
            deadline = time.monotonic() + 10
            while _lease(claim.job_id) < utcnow() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not heartbeat.lost.is_set()
        assert _lease(claim.job_id) > utcnow() - timedelta(seconds=1)

    @pytest.mark.parametrize("change", ["attempt", "status"])
    def test_sets_lost_when_the_job_is_taken(self, claim: Claim, change: str) -> None:
        with Heartbeat(self._short_claim(claim)) as heartbeat:
            assert not heartbeat.lost.wait(0.8)
            if change == "attempt":
                _newer_attempt_runs(claim)
            else:
                _set(claim.job_id, status="queued")
            assert heartbeat.lost.wait(10)
        with session_scope() as session:  # the lost heartbeat did not touch the row after that
            assert session.scalar(select(func.count()).select_from(Job).where(Job.id == claim.job_id)) == 1


class TestShouldStop:
    """The runner's between-steps poll: each condition alone stops it, and ownership loss also marks the lease."""

    def _poll(self, claim: Claim, settings: Settings) -> tuple[bool, bool]:
        from worker.runner import JobRunner

        heartbeat = Heartbeat(claim)  # not started: only its `lost` flag is used
        stop = JobRunner(claim.job_id, settings=settings, worker_id="w1")._should_stop(claim, heartbeat)
        return stop, heartbeat.lost.is_set()

    def test_owner_without_requests_goes_on(self, claim: Claim, settings: Settings) -> None:
        assert self._poll(claim, settings) == (False, False)

    def test_newer_attempt_stops_and_marks_the_lease_lost(self, claim: Claim, settings: Settings) -> None:
        _newer_attempt_runs(claim)
        assert self._poll(claim, settings) == (True, True)

    def test_job_no_longer_running_stops_and_marks_the_lease_lost(self, claim: Claim, settings: Settings) -> None:
        _set(claim.job_id, status="queued")
        assert self._poll(claim, settings) == (True, True)

    def test_pause_request_stops_without_losing_the_lease(self, claim: Claim, settings: Settings) -> None:
        _set(claim.job_id, pause_requested=True)
        assert self._poll(claim, settings) == (True, False)

    def test_cancel_stops_without_losing_the_lease(self, claim: Claim, settings: Settings) -> None:
        _set(claim.job_id, status="cancelling")
        assert self._poll(claim, settings) == (True, False)
