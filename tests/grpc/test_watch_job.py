"""WatchJob while a stand-in worker records progress: ordered metrics, checkpoints, terminal state, resuming.

(The end-to-end run with the real Celery worker and engine is a separate test; here the worker side is
the same domain functions the worker's reporting uses, driven from a thread.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from sqlalchemy import update

from contract.gen.grpo.v1 import job_spec_pb2, jobs_pb2, jobs_pb2_grpc
from service.grpc import watch
from service.jobs.progress import record_event, record_metrics, worker_transition
from service.jobs.states import JobStatus
from service.kit.config import get_settings
from service.kit.db import session_scope, utcnow
from service.kit.queue import set_job_queue
from service.storage import get_storage
from service.tenants.keys import lookup_prefix
from service.tenants.models import ApiKey
from tests.grpc.helpers import bearer
from tests.service.factories import TenantHeaders, create_key
from tests.service.jobs_support import RecordingQueue, make_dataset, put_checkpoint, start_job

STEPS = 6


@pytest.fixture(autouse=True)
def fast_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "POLL_INTERVAL_S", 0.02)


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


async def _job(channel: grpc.aio.Channel, tenant: TenantHeaders) -> str:
    spec = job_spec_pb2.JobSpec(
        base_model="builtin:tiny",
        train_dataset=make_dataset(tenant.tenant_id),
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
        hyperparameters=job_spec_pb2.Hyperparameters(max_steps=STEPS, num_generations=2),
    )
    stub = jobs_pb2_grpc.JobServiceStub(channel)
    return (await stub.CreateJob(jobs_pb2.CreateJobRequest(spec=spec), metadata=bearer(tenant.api_key))).job.id


def _work(job_id: str, attempt: int, pause_s: float) -> None:
    """The worker's reports: one metrics row set per step, a checkpoint at step 3, then success."""
    import time

    for step in range(1, STEPS + 1):
        with session_scope() as session:
            record_metrics(session, job_id, attempt, step, {"reward": step / 10, "loss": 1.0 / step})
        if step == 3:
            put_checkpoint(get_storage(), job_id, attempt, step, {"weights.bin": b"w" * 10})
        if step == 4:
            with session_scope() as session:
                record_event(session, job_id, attempt, "health", "kl_blowup: KL 3.1 > 2.0",
                             {"kind": "kl_blowup", "severity": "warning", "step": step, "evidence": {"kl": 3.1}})
        time.sleep(pause_s)
    with session_scope() as session:
        worker_transition(session, job_id, attempt, JobStatus.succeeded, reason="done")


async def _collect(
    stub: jobs_pb2_grpc.JobServiceAsyncStub, api_key: str, job_id: str, from_step: int, stop_after_step: int | None = None
) -> list[jobs_pb2.WatchJobResponse]:
    received = []
    call = stub.WatchJob(jobs_pb2.WatchJobRequest(job_id=job_id, from_step=from_step), metadata=bearer(api_key))
    async for message in call:
        received.append(message)
        if stop_after_step is not None and message.WhichOneof("event") == "metrics" and message.metrics.step == stop_after_step:
            call.cancel()  # the client goes away mid-stream
            break
    return received


def _steps(messages: list[jobs_pb2.WatchJobResponse]) -> list[int]:
    return [m.metrics.step for m in messages if m.WhichOneof("event") == "metrics"]


class TestWatchJob:
    async def test_live_stream_then_reconnect(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        job_id = await _job(channel, tenant_a)
        attempt = start_job(job_id)
        worker = asyncio.create_task(asyncio.to_thread(_work, job_id, attempt, 0.05))

        first = await _collect(stub, tenant_a.api_key, job_id, from_step=0, stop_after_step=2)
        assert first[0].WhichOneof("event") == "job" and first[0].job.state == jobs_pb2.JOB_STATE_RUNNING
        assert _steps(first) == [1, 2]

        rest = await _collect(stub, tenant_a.api_key, job_id, from_step=3)
        await worker
        assert _steps(rest) == [3, 4, 5, 6]  # no gap, no duplicate
        values = {m.metrics.step: dict(m.metrics.values) for m in rest if m.WhichOneof("event") == "metrics"}
        assert values[4] == {"reward": pytest.approx(0.4), "loss": pytest.approx(0.25)}
        checkpoints = [m.checkpoint.step for m in rest if m.WhichOneof("event") == "checkpoint"]
        assert checkpoints == [3]
        kinds = [(m.WhichOneof("event"), m.metrics.step or m.checkpoint.step) for m in rest]
        assert kinds[kinds.index(("metrics", 3)) + 1] == ("checkpoint", 3)  # right after its step's metrics
        assert rest[-1].WhichOneof("event") == "job" and rest[-1].job.state == jobs_pb2.JOB_STATE_SUCCEEDED
        health = [m.health for m in rest if m.WhichOneof("event") == "health"]
        assert [(h.type, h.data["kind"], h.data["evidence"]["kl"]) for h in health] == [("health", "kl_blowup", 3.1)]
        order = [m.WhichOneof("event") + str(m.metrics.step or "") for m in rest]
        assert order.index("health") > order.index("metrics4")  # after the metrics of its step

    async def test_watching_a_finished_job_replays_and_ends(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        job_id = await _job(channel, tenant_a)
        await asyncio.to_thread(_work, job_id, start_job(job_id), 0)
        everything = await asyncio.wait_for(_collect(stub, tenant_a.api_key, job_id, from_step=0), timeout=10)
        assert _steps(everything) == list(range(1, STEPS + 1))
        assert everything[-1].job.state == jobs_pb2.JOB_STATE_SUCCEEDED
        tail = await asyncio.wait_for(_collect(stub, tenant_a.api_key, job_id, from_step=5), timeout=10)
        assert _steps(tail) == [5, 6]
        assert [m.checkpoint.step for m in tail if m.WhichOneof("event") == "checkpoint"] == []  # step 3 < 5
        assert [m for m in tail if m.WhichOneof("event") == "health"] == []  # step 4 < 5
        assert len([m for m in everything if m.WhichOneof("event") == "health"]) == 1


class TestWatchOutlivingItsKey:
    """WatchJob re-checks its key before every poll: revoked (in the database, as another process would) or
    expired, the call ends UNAUTHENTICATED within GRPO_AUTH_CACHE_SECONDS (+ one poll)."""

    @pytest.mark.parametrize("how", ["revoked", "expired"])
    async def test_the_call_ends_within_the_auth_cache_time(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue,
        monkeypatch: pytest.MonkeyPatch, how: str,
    ) -> None:
        cache_s = 1.0
        monkeypatch.setenv("GRPO_AUTH_CACHE_SECONDS", str(cache_s))
        get_settings.cache_clear()
        job_id = await _job(channel, tenant_a)
        attempt = start_job(job_id)  # running: the call would go on until the job ends
        expires_at = datetime.now(UTC) + timedelta(seconds=2) if how == "expired" else None
        with session_scope() as session:
            key = create_key(session, tenant_a.tenant_id, ["read"], expires_at=expires_at)
        call = jobs_pb2_grpc.JobServiceStub(channel).WatchJob(
            jobs_pb2.WatchJobRequest(job_id=job_id), metadata=bearer(key)
        )
        first = await asyncio.wait_for(call.read(), timeout=10)  # the call is open and authenticated
        assert first.job.state == jobs_pb2.JOB_STATE_RUNNING
        if how == "revoked":
            with session_scope() as session:
                session.execute(update(ApiKey).where(ApiKey.prefix == lookup_prefix(key)).values(revoked_at=utcnow()))
            refused_at = time.monotonic()
        else:
            assert expires_at is not None
            refused_at = time.monotonic() + (expires_at - datetime.now(UTC)).total_seconds()

        async def drain() -> None:
            while await call.read() is not grpc.aio.EOF:
                pass

        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(drain(), timeout=max(0.0, refused_at - time.monotonic()) + cache_s + 5)
        finally:
            call.cancel()
            await asyncio.to_thread(_finish, job_id, attempt)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
        ended_after = time.monotonic() - refused_at
        assert ended_after < cache_s + watch.POLL_INTERVAL_S + 1.0, ended_after


def _finish(job_id: str, attempt: int) -> None:
    with session_scope() as session:
        worker_transition(session, job_id, attempt, JobStatus.succeeded, reason="done")


def test_a_checkpoint_recorded_after_its_steps_metrics_went_out_still_comes_before_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker records step 3's metrics, then its checkpoint, then step 4's: a poll between the first two sees
    step 3 without its checkpoint, and the next poll sees the checkpoint beside step 4's metrics."""
    from types import SimpleNamespace

    running, done = SimpleNamespace(status=JobStatus.running), SimpleNamespace(status=JobStatus.succeeded)
    polls = iter([
        watch._Poll(running, [jobs_pb2.StepMetrics(step=3)], False, []),  # type: ignore[arg-type]
        watch._Poll(running, [jobs_pb2.StepMetrics(step=4)], False, [("ckpt_3", 3)]),  # type: ignore[arg-type]
        watch._Poll(done, [], False, [("ckpt_3", 3)]),  # type: ignore[arg-type]
    ])

    async def scripted_poll(*_: object) -> watch._Poll:
        return next(polls)

    async def authorized() -> None:
        return None

    monkeypatch.setattr(watch, "_poll", scripted_poll)
    monkeypatch.setattr(watch, "job_to_proto", lambda job: jobs_pb2.Job(id="job_x"))

    async def collect() -> list[tuple[str | None, int]]:
        stream = watch.watch_job(None, "tenant", "job_x", 3, authorized, poll_interval_s=0)  # type: ignore[arg-type]
        return [(m.WhichOneof("event"), m.metrics.step or m.checkpoint.step) async for m in stream
                if m.WhichOneof("event") != "job"]

    assert asyncio.run(collect()) == [("metrics", 3), ("checkpoint", 3), ("metrics", 4)]
