"""The fair claim (service.execution.lease.claim_next) on real SQLite and PostgreSQL: which queued job a delivery starts.

Deliveries are simulated by calling claim_next with the id a message would carry; the end-to-end version with a
real worker process is tests/worker/test_fair_scheduling.py.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update

from contract.spec import JobSpec
from service.execution import reporting
from service.execution.lease import Claim, ClaimLimits, claim_next
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.jobs.states import JobStatus
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.quotas.models import TenantQuota
from tests.service.factories import TenantHeaders
from tests.worker.conftest import RecordingQueue, insert_dataset, insert_job, tiny_spec

UNLIMITED = ClaimLimits()


def _queue(tenant_id: str, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        with session_scope() as session:
            ids.append(insert_job(session, tenant_id).id)
    return ids


def _deliver(job_id: str, limits: ClaimLimits = UNLIMITED, worker: str = "w1") -> Claim | None:
    with session_scope() as session:
        return claim_next(session, job_id, worker, 60, limits)


def _finish(claim: Claim) -> None:
    reporting.finish(claim, JobStatus.succeeded, reason="done")


def _status(job_id: str) -> str:
    with session_scope() as session:
        return str(session.scalar(select(Job.status).where(Job.id == job_id)))


def _set(job_id: str, **values: object) -> None:
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def _override(tenant_id: str, **limits: int) -> None:
    with session_scope() as session:
        session.add(TenantQuota(tenant_id=tenant_id, **limits))


class TestFairChoice:
    def test_the_named_job_runs_when_it_is_the_only_one(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        [job_id] = _queue(tenant_a.tenant_id, 1)
        claim = _deliver(job_id)
        assert claim is not None and claim.job_id == job_id and claim.attempt == 1
        assert _deliver(job_id) is None  # a duplicate finds nothing else to start

    def test_tenant_with_fewer_running_jobs_goes_first(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        a1, a2, a3 = _queue(tenant_a.tenant_id, 3)
        [b1] = _queue(tenant_b.tenant_id, 1)
        first = _deliver(a1)
        assert first is not None and first.job_id == a1
        second = _deliver(a2)  # A runs one job, B none: B's job, although A's are older
        assert second is not None and second.job_id == b1
        assert _status(a2) == "queued"
        third = _deliver(a3)  # one each: back to A, oldest first
        assert third is not None and third.job_id == a2

    def test_with_one_worker_tenants_take_turns(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        a_jobs = _queue(tenant_a.tenant_id, 4)
        claim = _deliver(a_jobs[0])
        assert claim is not None and claim.job_id == a_jobs[0]
        [b1] = _queue(tenant_b.tenant_id, 1)
        _finish(claim)
        # Nobody runs anything now: B, never served, goes before A's second job.
        claim = _deliver(a_jobs[1])
        assert claim is not None and claim.job_id == b1
        _finish(claim)
        started = []
        for job_id in a_jobs[1:]:
            claim = _deliver(job_id)
            assert claim is not None
            started.append(claim.job_id)
            _finish(claim)
        assert started == a_jobs[1:]
        assert _deliver(b1) is None

    def test_priority_orders_a_tenants_own_jobs_but_not_other_tenants(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        a1, a2, a3 = _queue(tenant_a.tenant_id, 3)
        [b1] = _queue(tenant_b.tenant_id, 1)
        _set(a3, priority=5)
        first = _deliver(a1)
        assert first is not None and first.job_id == a3  # A's highest priority before its older jobs
        _set(a2, priority=100)
        second = _deliver(a1)
        assert second is not None and second.job_id == b1  # a priority does not jump the tenants' turns

    def test_the_specs_priority_is_what_the_claim_orders_by(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        with session_scope() as session:
            dataset_id = insert_dataset(session, tenant_a.tenant_id)
            low, high = (
                jobs_service.create_job(
                    session, tenant_a.tenant_id, JobSpec.model_validate({**tiny_spec(dataset_id), "priority": p}),
                    RecordingQueue(),
                ).id
                for p in (0, 7)
            )
        claim = _deliver(low)
        assert claim is not None and claim.job_id == high

    def test_delivery_for_a_cancelled_job_starts_the_fair_choice(
        self, settings: Settings, tenant_a: TenantHeaders
    ) -> None:
        a1, a2 = _queue(tenant_a.tenant_id, 2)
        _set(a1, status=JobStatus.cancelled.value)
        claim = _deliver(a1)
        assert claim is not None and claim.job_id == a2
        assert _status(a1) == "cancelled"

    def test_expired_lease_of_the_named_job_is_taken_over_before_anything_queued(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        [a1] = _queue(tenant_a.tenant_id, 1)
        claim = _deliver(a1)
        assert claim is not None
        [b1] = _queue(tenant_b.tenant_id, 1)
        _set(a1, lease_until=utcnow() - timedelta(seconds=1))
        taken = _deliver(a1, worker="w2")
        assert taken is not None and taken.job_id == a1 and taken.attempt == 2
        assert _status(b1) == "queued"

    def test_jobs_of_the_other_queue_are_left_alone(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        a1, a2 = _queue(tenant_a.tenant_id, 2)
        _set(a1, queue="gpu")
        claim = _deliver(a2)
        assert claim is not None and claim.job_id == a2  # a1 is older but in the gpu queue
        assert _deliver(a2) is None


class TestQuotasAtClaim:
    def test_running_quota_leaves_the_job_queued_until_one_finishes(
        self, settings: Settings, tenant_a: TenantHeaders
    ) -> None:
        a1, a2 = _queue(tenant_a.tenant_id, 2)
        _override(tenant_a.tenant_id, max_running_jobs=1)
        claim = _deliver(a1)
        assert claim is not None and claim.job_id == a1
        assert _deliver(a2) is None
        assert _status(a2) == "queued"
        _finish(claim)
        claim = _deliver(a2)
        assert claim is not None and claim.job_id == a2

    def test_default_running_quota_applies_without_an_override(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        a1, a2 = _queue(tenant_a.tenant_id, 2)
        limits = ClaimLimits(max_running_jobs=1)
        assert (claim := _deliver(a1, limits)) is not None and claim.job_id == a1
        assert _deliver(a2, limits) is None
        _override(tenant_a.tenant_id, max_running_jobs=2)  # an override replaces the default
        assert (claim := _deliver(a2, limits)) is not None and claim.job_id == a2

    def test_a_tenant_at_its_quota_does_not_block_the_others(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        a1, a2 = _queue(tenant_a.tenant_id, 2)
        [b1] = _queue(tenant_b.tenant_id, 1)
        _override(tenant_a.tenant_id, max_running_jobs=0)
        claim = _deliver(a1)
        assert claim is not None and claim.job_id == b1
        assert _deliver(a2) is None

    def test_devices_quota_leaves_the_job_queued(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        a1, a2 = _queue(tenant_a.tenant_id, 2)
        _set(a2, devices=2)
        _override(tenant_a.tenant_id, max_devices=2)
        claim = _deliver(a1)
        assert claim is not None and claim.job_id == a1
        assert _deliver(a2) is None  # 1 in use + 2 > 2
        _finish(claim)
        claim = _deliver(a2)
        assert claim is not None and claim.job_id == a2
