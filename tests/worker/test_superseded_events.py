"""After a crash the next attempt re-runs the steps after the last checkpoint. Their events from the dead
attempt are marked superseded (SQLite and PostgreSQL): the event log and the SSE stream list each step's metrics
once, and the SDK's `JobProgress` / `watch_job` never count a step twice, even for a consumer that saw the dead
attempt's events live."""

from __future__ import annotations

from datetime import timedelta

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

from client.sdk import GRPOClient, JobProgress
from contract.api.jobs import EventOut
from service.execution import reporting
from service.execution.lease import Claim, claim_job
from service.jobs.models import Job
from service.jobs.states import JobStatus
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.storage import checkpoint_key, get_storage
from tests.service.factories import TenantHeaders
from tests.worker.conftest import insert_job
from tests.worker.reward_servers import serving


def _claim(job_id: str, worker: str) -> Claim:
    with session_scope() as session:
        claim = claim_job(session, job_id, worker, 60)
    assert claim is not None
    return claim


def _crashed_and_resumed_job(tenant_id: str) -> str:
    """Attempt 1: steps 1-4, checkpoint at 2, then its worker dies. Attempt 2 resumes at 2 and finishes."""
    with session_scope() as session:
        job_id = insert_job(session, tenant_id, max_steps=4).id
    first = _claim(job_id, "w1")
    for step in (1, 2, 3, 4):
        reporting.record_step(first, step, {"loss": float(step)}, [])
        if step == 2:
            get_storage().put_stream(checkpoint_key(job_id, "ckpt_sup2", "a.bin"), [b"x"])
            reporting.record_checkpoint(first, checkpoint_id="ckpt_sup2", step=2,
                                        files={"a.bin": {"size": 1, "sha256": "0" * 64}})
    with session_scope() as session:  # the worker died: its lease runs out
        session.execute(update(Job).where(Job.id == job_id).values(lease_until=utcnow() - timedelta(seconds=1)))
    second = _claim(job_id, "w2")
    assert second.resume_step == 2
    for step in (3, 4):
        reporting.record_step(second, step, {"loss": 10.0 * step}, [])
    reporting.finish(second, JobStatus.succeeded, reason="done")
    return job_id


def _events(client: TestClient, tenant: TenantHeaders, job_id: str, **params: str) -> list[EventOut]:
    response = client.get(f"/v1/jobs/{job_id}/events", headers=tenant, params={"limit": "500", **params})
    assert response.status_code == 200, response.text
    return [EventOut.model_validate(e) for e in response.json()["data"]]


def _metric_steps(events: list[EventOut]) -> list[tuple[int, int]]:
    return [(e.data["step"], e.attempt) for e in events if e.type == "metrics"]


def test_event_log_lists_each_step_once(settings: Settings, tenant_a: TenantHeaders, client: TestClient) -> None:
    job_id = _crashed_and_resumed_job(tenant_a.tenant_id)
    assert _metric_steps(_events(client, tenant_a, job_id)) == [(1, 1), (2, 1), (3, 2), (4, 2)]
    everything = _events(client, tenant_a, job_id, include_superseded="true")
    assert _metric_steps(everything) == [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2)]
    assert [(e.step, e.attempt) for e in everything if e.superseded] == [(3, 1), (4, 1)]
    checkpoints = [e for e in everything if e.type == "checkpoint"]
    assert [(e.step, e.superseded) for e in checkpoints] == [(2, False)]


def test_stream_replays_each_step_once(settings: Settings, tenant_a: TenantHeaders, client: TestClient) -> None:
    job_id = _crashed_and_resumed_job(tenant_a.tenant_id)
    with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=tenant_a) as response:
        payloads = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    events = [EventOut.model_validate_json(payload) for payload in payloads]
    assert _metric_steps(events) == [(1, 1), (2, 1), (3, 2), (4, 2)]


def test_sdk_watch_counts_each_step_once(settings: Settings, tenant_a: TenantHeaders, app: FastAPI) -> None:
    job_id = _crashed_and_resumed_job(tenant_a.tenant_id)
    with serving(app) as base_url, GRPOClient(base_url, tenant_a.api_key) as sdk:
        watched = [(event.type, list(progress.steps)) for event, progress in sdk.watch_job(job_id)]
        progress = JobProgress()
        for event in sdk.list_job_events(job_id, limit=500).data:
            progress.apply(event)
        live = sdk.list_job_events(job_id, limit=500, include_superseded=True).data
    assert watched[-1] == ("status", [1, 2, 3, 4])
    assert [steps for kind, steps in watched if kind == "metrics"] == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]
    assert progress.steps == [1, 2, 3, 4] and progress.status == "succeeded"
    assert progress.metrics[3] == {"loss": 30.0}

    # A consumer that was connected during the crash received the dead attempt's events before they were
    # marked: JobProgress drops steps 3-4 at the new attempt's claim (resume_step 2) and takes its values.
    live = [e.model_copy(update={"superseded": False}) for e in live]
    assert sum(e.type == "metrics" for e in live) == 6
    seen = JobProgress()
    steps_after_claim: list[int] = []
    for event in live:
        seen.apply(event)
        if "resume_step" in event.data and event.attempt == 2:  # the claim: status or lease_taken_over
            steps_after_claim = seen.steps
    assert steps_after_claim == [1, 2]
    assert seen.steps == [1, 2, 3, 4] and seen.metrics[4] == {"loss": 40.0}
