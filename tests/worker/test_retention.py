"""Checkpoint retention and job deletion on SQLite and PostgreSQL, through the worker's reporting calls and the
API (REST and gRPC share `service.jobs.service.delete_job`): newest N kept plus the best by metric, never a
checkpoint being downloaded, the resume point, or another unfinished job's base model; files deleted with rows."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from contract.spec import JobSpec
from service.checkpoints import retention
from service.checkpoints.models import Checkpoint, CheckpointPin
from service.checkpoints.retention import best_checkpoint, checkpoints_to_prune
from service.execution import reporting
from service.execution.lease import Claim, claim_job
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.jobs.states import JobStatus
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.storage import checkpoint_key, get_storage, job_prefix
from tests.service.factories import TenantHeaders
from tests.worker.conftest import insert_job


def _claimed_job(tenant_id: str, **hyper: Any) -> Claim:
    with session_scope() as session:
        job_id = insert_job(session, tenant_id, **hyper).id
    with session_scope() as session:
        claim = claim_job(session, job_id, "w1", 60)
    assert claim is not None
    return claim


def _save(claim: Claim, step: int, metrics: dict[str, float] | None = None) -> str:
    checkpoint_id = f"ckpt_{claim.job_id[-6:]}s{step}"
    get_storage().put_stream(checkpoint_key(claim.job_id, checkpoint_id, "a.bin"), [b"x"])
    reporting.record_checkpoint(claim, checkpoint_id=checkpoint_id, step=step,
                                files={"a.bin": {"size": 1, "sha256": "0" * 64}}, metrics=metrics or {"loss": 1.0})
    return checkpoint_id


def _kept(job_id: str) -> list[int]:
    with session_scope() as session:
        rows = session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step))
        return list(rows)


def _stored(job_id: str) -> set[str]:
    return {key.split("/")[2] for key in get_storage().list(job_prefix(job_id))}


class TestPruneLogic:
    def _checkpoints(self, values: list[float | None]) -> list[Checkpoint]:
        return [
            Checkpoint(id=f"c{step}", step=step, metrics={} if value is None else {"eval/reward/mean": value})
            for step, value in enumerate(values, start=1)
        ]

    def test_newest_n_kept(self) -> None:
        pruned = checkpoints_to_prune(self._checkpoints([None] * 5), 3)
        assert [c.step for c in pruned] == [2, 1]
        assert checkpoints_to_prune(self._checkpoints([None] * 5), None) == []

    def test_best_kept_beyond_the_limit(self) -> None:
        checkpoints = self._checkpoints([0.1, 0.9, 0.2, 0.3, 0.4])
        pruned = checkpoints_to_prune(checkpoints, 2, best_metric="eval/reward/mean")
        assert [c.step for c in pruned] == [3, 1]  # step 2 is the best

    def test_lower_is_better_for_losses_and_nan_ignored(self) -> None:
        checkpoints = [Checkpoint(id=f"c{i}", step=i, metrics={"eval/loss": v})
                       for i, v in enumerate([0.5, 0.1, float("nan"), 0.3], start=1)]
        best = best_checkpoint(checkpoints, "eval/loss", None)
        assert best is not None and best.step == 2
        best = best_checkpoint(checkpoints, "eval/loss", True)
        assert best is not None and best.step == 1
        assert best_checkpoint(checkpoints, "missing", None) is None

    def test_protected_kept(self) -> None:
        pruned = checkpoints_to_prune(self._checkpoints([None] * 4), 1, protected=frozenset({"c1"}))
        assert [c.step for c in pruned] == [3, 2]


class TestRetention:
    def test_newest_three_kept_in_rows_and_storage(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        claim = _claimed_job(tenant_a.tenant_id, save_total_limit=3)
        ids = [_save(claim, step) for step in range(1, 6)]
        assert _kept(claim.job_id) == [3, 4, 5]
        assert _stored(claim.job_id) == set(ids[2:])

    def test_best_by_metric_is_kept(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        claim = _claimed_job(tenant_a.tenant_id, save_total_limit=2, metric_for_best_model="eval/reward/mean")
        for step, value in enumerate([0.2, 0.8, 0.1, 0.3, 0.4], start=1):
            _save(claim, step, {"eval/reward/mean": value})
        assert _kept(claim.job_id) == [2, 4, 5]

    def test_a_checkpoint_being_downloaded_is_kept_until_later(
        self, settings: Settings, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        claim = _claimed_job(tenant_a.tenant_id, save_total_limit=1)
        first = _save(claim, 1)
        # A download in progress pins it (the pin ends with the download, so take one as it starts).
        retention.pin(first)
        _save(claim, 2)
        assert _kept(claim.job_id) == [1, 2] and first in _stored(claim.job_id)
        with session_scope() as session:  # the download's pin has run out
            session.execute(update(CheckpointPin).where(CheckpointPin.checkpoint_id == first)
                            .values(expires_at=utcnow() - timedelta(seconds=1)))
        _save(claim, 3)
        assert _kept(claim.job_id) == [3] and first not in _stored(claim.job_id)

    def test_base_model_of_an_unfinished_job_is_kept(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        claim = _claimed_job(tenant_a.tenant_id, save_total_limit=1)
        first = _save(claim, 1)
        with session_scope() as session:
            other = insert_job(session, tenant_a.tenant_id)
            other.base_model = f"checkpoint:{first}"
            other.spec = {**other.spec, "base_model": f"checkpoint:{first}"}
            JobSpec.model_validate(other.spec)
        _save(claim, 2)
        assert _kept(claim.job_id) == [1, 2]
        with session_scope() as session:
            session.execute(update(Job).where(Job.id == other.id).values(status="cancelled"))
        _save(claim, 3)
        assert _kept(claim.job_id) == [3]


class TestDeleteJob:
    def test_unfinished_job_is_409_naming_its_state(
        self, settings: Settings, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        claim = _claimed_job(tenant_a.tenant_id)
        _save(claim, 1)
        response = client.delete(f"/v1/jobs/{claim.job_id}", headers=tenant_a)
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["code"] == "job_not_finished" and "running" in error["message"]
        assert error["details"] == {"current_status": "running"}
        assert _kept(claim.job_id) == [1] and _stored(claim.job_id)

    def test_finished_job_and_its_files_are_deleted(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders, client: TestClient
    ) -> None:
        claim = _claimed_job(tenant_a.tenant_id)
        first = _save(claim, 1)
        reporting.finish(claim, JobStatus.succeeded, reason="done")
        assert client.delete(f"/v1/jobs/{claim.job_id}", headers=tenant_b).status_code == 404  # not theirs
        response = client.delete(f"/v1/jobs/{claim.job_id}", headers=tenant_a)
        assert response.status_code == 204, response.text
        assert _kept(claim.job_id) == [] and _stored(claim.job_id) == set()
        assert client.get(f"/v1/jobs/{claim.job_id}", headers=tenant_a).status_code == 404
        assert client.get(f"/v1/checkpoints/{first}", headers=tenant_a).status_code == 404
        assert client.delete(f"/v1/jobs/{claim.job_id}", headers=tenant_a).status_code == 404

    def test_checkpoint_in_use_is_409(self, settings: Settings, tenant_a: TenantHeaders, client: TestClient) -> None:
        claim = _claimed_job(tenant_a.tenant_id)
        first = _save(claim, 1)
        reporting.finish(claim, JobStatus.succeeded, reason="done")
        with client.stream("GET", f"/v1/checkpoints/{first}/archive", headers=tenant_a) as download:
            assert download.status_code == 200
            response = client.delete(f"/v1/jobs/{claim.job_id}", headers=tenant_a)  # while it streams
            assert response.status_code == 409 and response.json()["error"]["code"] == "checkpoint_in_use"
            assert _stored(claim.job_id)
            download.read()
        # The finished download released its pin: now the job can go.
        assert client.delete(f"/v1/jobs/{claim.job_id}", headers=tenant_a).status_code == 204

    def test_domain_function_refuses_a_paused_job(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        claim = _claimed_job(tenant_a.tenant_id)
        reporting.finish(claim, JobStatus.paused, reason="paused")
        with pytest.raises(jobs_service.JobNotFinished, match="paused"), session_scope() as session:
            jobs_service.delete_job(session, tenant_a.tenant_id, claim.job_id, get_storage())


class TestUnrecordedFiles:
    def test_files_without_a_row_are_deleted(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        from service.checkpoints.retention import delete_unrecorded
        from service.storage import tensorboard_key

        claim = _claimed_job(tenant_a.tenant_id, save_total_limit=5)
        recorded = _save(claim, 1)
        storage = get_storage()
        storage.put_stream(checkpoint_key(claim.job_id, "ckpt_orphan", "a.bin"), [b"x"])
        storage.put_stream(tensorboard_key(claim.job_id, "attempt-1/events"), [b"x"])
        with session_scope() as session:
            assert delete_unrecorded(session, storage, claim.job_id) == ["ckpt_orphan"]
        assert _stored(claim.job_id) == {recorded, "tensorboard"}
