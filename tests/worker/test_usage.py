"""Usage metering and budgets with the real worker (JobRunner in-process, the engine on `builtin:tiny`), SQLite
and PostgreSQL: `/v1/usage` is the exact sum of the per-step records, tokens generated are the completion
lengths the engine reported, a re-run step counts once, a job pauses with `budget_exhausted` at the step that
reaches its budget (keeping that step's checkpoint) and completes once the budget is raised, and the estimate
of a CPU job is within 2x of what it used."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, select, update

from service.execution import reporting
from service.execution.lease import Claim, claim_job
from service.jobs.models import Job
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.storage import checkpoint_key, get_storage
from service.usage.models import JobUsage, UsageCalibration
from service.usage.service import StepUsageIn
from tests.service.factories import TenantHeaders
from tests.worker.conftest import insert_dataset, tiny_spec
from worker.runner import JobRunner
from worker.usage_meter import UsageMeter

FIELDS = ("tokens_generated", "tokens_trained", "reward_calls", "device_seconds")


def _submit(client: TestClient, tenant: TenantHeaders, spec: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json=spec, headers=tenant)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _run(job_id: str) -> str:
    return JobRunner(job_id, worker_id="w1").run()


def _records(tenant_id: str) -> list[JobUsage]:
    with session_scope() as session:
        rows = list(session.scalars(select(JobUsage).where(JobUsage.tenant_id == tenant_id)))
        session.expunge_all()
    return rows


def _sums(rows: list[JobUsage]) -> dict[str, float]:
    return {name: sum(getattr(r, name) for r in rows) for name in FIELDS} | {"steps": len(rows)}


def _totals(body: dict[str, Any]) -> dict[str, float]:
    return {name: body[name] for name in (*FIELDS, "steps")}


def _get(client: TestClient, tenant: TenantHeaders, path: str, **params: str) -> dict[str, Any]:
    response = client.get(path, headers=tenant, params=params)
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.fixture
def job_process() -> Iterator[None]:
    """This test process as a job's own would be, so that its CPU-seconds measure the jobs' work: one torch thread
    (not OpenMP spinning on a loaded machine), and the objects every earlier test of this pytest worker left behind
    frozen out of the garbage collector (a fresh job process has none; their full collections, at random steps,
    were billed to whichever job ran then)."""
    import torch  # only this fixture of the module touches torch directly

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(previous)


class TestUsage:
    def test_usage_is_the_sum_of_step_records_and_of_reported_completion_lengths(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders, client: TestClient,
        job_process: None,
    ) -> None:
        # In production each job runs in a fresh process and pays torch's first-step warm-up, which its
        # calibration then includes. Here every job shares this process: warm it up with another tenant's job
        # and forget what that one measured, so all jobs below run under the same conditions.
        with session_scope() as session:
            warm_up = _job(session, tenant_b.tenant_id, max_steps=2, checkpoint_every=2)
        assert _run(warm_up) == "succeeded"
        with session_scope() as session:
            session.execute(delete(UsageCalibration))
            dataset = insert_dataset(session, tenant_a.tenant_id)
        first = tiny_spec(dataset, max_steps=3, checkpoint_every=3)
        second = tiny_spec(dataset, max_steps=2, checkpoint_every=2, num_iterations=2, seed=1)
        second["rewards"].append({"type": "builtin", "name": "length_penalty", "weight": 0.1})

        before = client.post("/v1/jobs/estimate", json=first, headers=tenant_a)
        assert before.status_code == 200, before.text
        assert before.json()["calibration"]["source"] == "default"
        jobs = {_submit(client, tenant_a, first): first, _submit(client, tenant_a, second): second}
        for job_id in jobs:
            assert _run(job_id) == "succeeded"

        records = _records(tenant_a.tenant_id)
        assert sorted((r.job_id, r.step) for r in records) == sorted(
            (job_id, step) for job_id, spec in jobs.items() for step in range(1, spec["hyperparameters"]["max_steps"] + 1)
        )
        for group_by in ("job", "day"):
            report = _get(client, tenant_a, "/v1/usage", group_by=group_by)
            assert _totals(report["totals"]) == _sums(records)
            assert sum(g["tokens_generated"] for g in report["data"]) == report["totals"]["tokens_generated"]
        by_job = {g["key"]: _totals(g) for g in _get(client, tenant_a, "/v1/usage", group_by="job")["data"]}
        assert by_job == {job_id: _sums([r for r in records if r.job_id == job_id]) for job_id in jobs}

        for job_id, spec in jobs.items():
            hyper = spec["hyperparameters"]
            completions = hyper["num_generations"] * hyper["prompts_per_step"]
            series = _get(client, tenant_a, f"/v1/jobs/{job_id}/metrics")["series"]
            usage = _get(client, tenant_a, f"/v1/jobs/{job_id}/usage")
            assert _totals(usage["totals"]) == by_job[job_id]
            steps = usage["steps"]
            assert [s["step"] for s in steps] == series["completion_length/mean"]["steps"]
            for record, mean_length, step_s in zip(
                steps, series["completion_length/mean"]["values"], series["time/step_s"]["values"], strict=True
            ):
                assert record["tokens_generated"] == round(mean_length * completions)
                assert record["reward_calls"] == completions * len(spec["rewards"])
                # prompt + completion tokens, once per optimisation pass
                assert record["tokens_trained"] > record["tokens_generated"] * hyper.get("num_iterations", 1)
                assert record["tokens_trained"] % hyper.get("num_iterations", 1) == 0
                assert 0 < record["device_seconds"] < 60 * max(step_s, 1.0)  # CPU-seconds of a 2-core worker

        # Calibrated by the two jobs: the estimate of a third is within 2x of what it uses.
        third = tiny_spec(dataset, max_steps=3, checkpoint_every=3, seed=2)
        estimate = client.post("/v1/jobs/estimate", json=third, headers=tenant_a).json()
        assert estimate["calibration"]["source"] == "model" and estimate["calibration"]["steps_observed"] == 5
        job_id = _submit(client, tenant_a, third)
        assert _run(job_id) == "succeeded"
        used = _get(client, tenant_a, f"/v1/jobs/{job_id}/usage")["totals"]
        for name in ("tokens_generated", "tokens_trained", "tokens", "device_seconds"):
            assert used[name] / 2 <= estimate[name] <= used[name] * 2, (name, estimate, used)
        assert estimate["steps"] == used["steps"] == 3

    def test_usage_window_and_tenant_isolation(
        self, settings: Settings, tenant_a: TenantHeaders, tenant_b: TenantHeaders, client: TestClient
    ) -> None:
        with session_scope() as session:
            job_id = _job(session, tenant_a.tenant_id)
        claim = _claim(job_id, "w1")
        reporting.record_step(claim, 1, {"loss": 1.0}, [], _usage(10))
        now = utcnow()
        assert _get(client, tenant_a, "/v1/usage")["totals"]["tokens_generated"] == 10
        after = _get(client, tenant_a, "/v1/usage", start=(now + timedelta(seconds=5)).isoformat(),
                     end=(now + timedelta(hours=1)).isoformat())
        assert after["totals"]["tokens_generated"] == 0 and after["data"] == []
        day = _get(client, tenant_a, "/v1/usage", start=(now - timedelta(hours=1)).isoformat(),
                   end=(now + timedelta(hours=1)).isoformat(), group_by="day")
        assert [(g["key"], g["tokens_generated"]) for g in day["data"]] == [(now.date().isoformat(), 10)]
        assert _get(client, tenant_b, "/v1/usage")["totals"]["tokens_generated"] == 0
        assert client.get(f"/v1/jobs/{job_id}/usage", headers=tenant_b).status_code == 404


def _job(session: Any, tenant_id: str, **hyper: Any) -> str:
    from contract.spec import JobSpec
    from service.jobs import service as jobs_service
    from tests.worker.conftest import RecordingQueue

    spec = JobSpec.model_validate(tiny_spec(insert_dataset(session, tenant_id), **hyper))
    return jobs_service.create_job(session, tenant_id, spec, RecordingQueue()).id


def _claim(job_id: str, worker: str) -> Claim:
    with session_scope() as session:
        claim = claim_job(session, job_id, worker, 60)
    assert claim is not None
    return claim


def _usage(tokens: int, seconds: float = 1.0) -> StepUsageIn:
    return StepUsageIn(
        tokens_generated=tokens, tokens_trained=3 * tokens, reward_calls=4, device_seconds=seconds,
        completions=4, completion_capacity=32, num_iterations=1, parameters=1000,
    )


def _expire_lease(job_id: str) -> None:
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(lease_until=utcnow() - timedelta(seconds=1)))


class TestUsageMeter:
    @pytest.mark.parametrize("devices", [1, 4])
    def test_a_step_holds_every_device_of_the_job(self, devices: int, monkeypatch: pytest.MonkeyPatch) -> None:
        clock = iter([100.0, 102.5])
        monkeypatch.setattr("worker.usage_meter.time.monotonic", lambda: next(clock))
        meter = UsageMeter(tenant_id="t", num_sources=1, max_completion_length=8, num_iterations=1, parameters=10,
                           cpu=False, devices=devices)
        usage = meter.take({"usage/tokens_generated": 6, "usage/tokens_trained": 12, "usage/reward_calls": 2})
        assert usage is not None and usage.device_seconds == pytest.approx(2.5 * devices)


class TestRerunSteps:
    def test_a_step_rerun_after_a_crash_counts_once(
        self, settings: Settings, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        """Attempt 1 records steps 1-4 (checkpoint at 2) and dies; attempt 2 resumes at 2, re-runs step 3 and
        pauses: step 3 counts attempt 2's record, step 4 (never re-run) does not count at all."""
        with session_scope() as session:
            job_id = _job(session, tenant_a.tenant_id, max_steps=6)
        first = _claim(job_id, "w1")
        for step in (1, 2, 3, 4):
            reporting.record_step(first, step, {"loss": 1.0}, [], _usage(100 * step))
            if step == 2:
                get_storage().put_stream(checkpoint_key(job_id, "ckpt_use2", "a.bin"), [b"x"])
                reporting.record_checkpoint(first, checkpoint_id="ckpt_use2", step=2,
                                            files={"a.bin": {"size": 1, "sha256": "0" * 64}})
        _expire_lease(job_id)
        second = _claim(job_id, "w2")
        assert second.resume_step == 2
        reporting.record_step(second, 3, {"loss": 1.0}, [], _usage(7))
        reporting.record_step(second, 3, {"loss": 1.0}, [], _usage(7))  # a retried write of the same step

        usage = _get(client, tenant_a, f"/v1/jobs/{job_id}/usage")
        assert [(s["step"], s["attempt"], s["tokens_generated"]) for s in usage["steps"]] == [
            (1, 1, 100), (2, 1, 200), (3, 2, 7)
        ]
        assert usage["totals"]["tokens_generated"] == 307
        assert _get(client, tenant_a, "/v1/usage")["totals"]["tokens_generated"] == 307

    def test_a_stale_attempt_cannot_record_usage(self, settings: Settings, tenant_a: TenantHeaders) -> None:
        from service.execution.lease import LeaseLost

        with session_scope() as session:
            job_id = _job(session, tenant_a.tenant_id)
        first = _claim(job_id, "w1")
        _expire_lease(job_id)
        _claim(job_id, "w2")
        with pytest.raises(LeaseLost):
            reporting.record_step(first, 1, {"loss": 1.0}, [], _usage(5))
        assert _records(tenant_a.tenant_id) == []


class TestBudget:
    def test_job_pauses_at_the_step_that_reaches_max_tokens_and_completes_after_raising_it(
        self, settings: Settings, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        with session_scope() as session:
            dataset = insert_dataset(session, tenant_a.tenant_id)
        spec = tiny_spec(dataset, max_steps=4, checkpoint_every=100)
        spec["budget"] = {"max_tokens": 1}
        hook = client.post("/v1/webhooks", json={"url": "https://hooks.example.com/grpo"}, headers=tenant_a)
        assert hook.status_code == 201, hook.text
        job_id = _submit(client, tenant_a, spec)

        assert _run(job_id) == "paused"  # step 1 reaches 1 token
        job = _get(client, tenant_a, f"/v1/jobs/{job_id}")
        assert job["progress"]["step"] == 1
        assert job["error"]["code"] == "budget_exhausted" and "budget.max_tokens" in job["error"]["message"]
        checkpoints = _get(client, tenant_a, f"/v1/jobs/{job_id}/checkpoints")["data"]
        assert [c["step"] for c in checkpoints] == [1]  # saved at the pause, not at checkpoint_every
        events = _get(client, tenant_a, f"/v1/jobs/{job_id}/events")["data"]
        exhausted = [e for e in events if e["type"] == "budget_exhausted"]
        assert [(e["step"], e["data"]["field"], e["data"]["limit"]) for e in exhausted] == [
            (1, "budget.max_tokens", 1)
        ]

        deliveries = _get(client, tenant_a, f"/v1/webhooks/{hook.json()['id']}/deliveries")["data"]
        announced = [d["event_type"] for d in deliveries]
        assert "job.budget_exhausted" in announced and "job.paused" in announced

        refused = client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "budget_exhausted"
        assert refused.json()["error"]["details"]["field"] == "budget.max_tokens"

        used = _get(client, tenant_a, f"/v1/jobs/{job_id}/usage")["totals"]["tokens"]
        raised = client.patch(f"/v1/jobs/{job_id}", json={"budget": {"max_tokens": used + 1}}, headers=tenant_a)
        assert raised.status_code == 200, raised.text
        assert raised.json()["spec"]["budget"] == {"max_tokens": used + 1, "max_device_seconds": None}
        assert client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a).status_code == 200
        assert _run(job_id) == "paused"  # step 2 reaches the raised budget
        job = _get(client, tenant_a, f"/v1/jobs/{job_id}")
        assert job["progress"]["step"] == 2 and job["error"]["code"] == "budget_exhausted"
        assert [c["step"] for c in _get(client, tenant_a, f"/v1/jobs/{job_id}/checkpoints")["data"]] == [1, 2]

        assert client.patch(f"/v1/jobs/{job_id}", json={"budget": None}, headers=tenant_a).status_code == 200
        assert client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a).status_code == 200
        assert _run(job_id) == "succeeded"
        usage = _get(client, tenant_a, f"/v1/jobs/{job_id}/usage")
        assert [s["step"] for s in usage["steps"]] == [1, 2, 3, 4]
        assert [s["attempt"] for s in usage["steps"]] == [1, 2, 3, 3]
        job = _get(client, tenant_a, f"/v1/jobs/{job_id}")
        assert job["status"] == "succeeded" and job["error"] is None

    def test_tenant_monthly_cap_pauses_the_job(
        self, settings: Settings, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        from service.usage import repository

        with session_scope() as session:
            repository.set_tenant_budget(
                session, tenant_a.tenant_id, monthly_max_device_seconds=None, monthly_max_tokens=1
            )
            job_id = _job(session, tenant_a.tenant_id, max_steps=3, checkpoint_every=100)
        assert _run(job_id) == "paused"
        job = _get(client, tenant_a, f"/v1/jobs/{job_id}")
        assert job["progress"]["step"] == 1
        assert "tenant.monthly_max_tokens" in job["error"]["message"]


class TestCapAtClaim:
    """Issue 30: a job whose tenant reached its monthly cap after the job was queued is paused at claim with
    `budget_exhausted`, and no step of it runs (it used to run one step first)."""

    def test_a_queued_job_over_the_tenant_cap_is_paused_at_claim_without_a_step(
        self, settings: Settings, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        from service.usage import repository

        with session_scope() as session:
            repository.set_tenant_budget(
                session, tenant_a.tenant_id, monthly_max_device_seconds=None, monthly_max_tokens=1
            )
            first = _job(session, tenant_a.tenant_id, max_steps=3, checkpoint_every=100)
            second = _job(session, tenant_a.tenant_id, max_steps=3, checkpoint_every=100)  # queued under the cap
        assert _run(first) == "paused"  # its step 1 reaches the cap
        assert _run(second) == "duplicate"  # nothing this tenant may start: the claim paused it instead

        job = _get(client, tenant_a, f"/v1/jobs/{second}")
        assert (job["status"], job["attempt"], job["progress"]["step"]) == ("paused", 0, 0)
        assert job["error"]["code"] == "budget_exhausted"
        assert job["error"]["message"].startswith("tenant.monthly_max_tokens 1 reached")
        assert [r.job_id for r in _records(tenant_a.tenant_id)] == [first]  # no step of `second` recorded
        assert _get(client, tenant_a, f"/v1/jobs/{second}/metrics")["series"] == {}
        events = _get(client, tenant_a, f"/v1/jobs/{second}/events")["data"]
        assert [e["type"] for e in events] == ["status", "budget_exhausted", "status"]
        assert events[1]["data"]["field"] == "tenant.monthly_max_tokens"
        assert events[2]["data"]["to"] == "paused"

        # Once the cap allows more, the job resumes and runs.
        with session_scope() as session:
            repository.set_tenant_budget(
                session, tenant_a.tenant_id, monthly_max_device_seconds=None, monthly_max_tokens=None
            )
        assert client.post(f"/v1/jobs/{second}/resume", headers=tenant_a).status_code == 200
        assert _run(second) == "succeeded"
