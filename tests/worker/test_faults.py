"""Faults with real processes: a worker SIGKILLed or frozen (SIGSTOP) mid-job, Redis and PostgreSQL restarted
mid-job. Each time the job must still succeed, resumed from its last checkpoint, with every step recorded
exactly once, and a zombie attempt's late writes refused.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import (
    ApiClient,
    PostgresCluster,
    RedisServer,
    Stack,
    free_port,
    fresh_redis_database,
    private_tmp,
    stop_together,
    wait_for,
)
from tests.worker.spare_workers import SpareWorkers

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def _rows(database_url: str, sql: str, **params: object) -> list[tuple[object, ...]]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def _metric_attempts(database_url: str, job_id: str) -> dict[int, set[int]]:
    """step -> the attempts that recorded metrics at that step."""
    found: dict[int, set[int]] = {}
    for step, attempt in _rows(database_url, "SELECT step, attempt FROM job_metrics WHERE job_id = :j", j=job_id):
        found.setdefault(int(step), set()).add(int(attempt))  # type: ignore[call-overload]
    return found


def _assert_resumed_cleanly(stack: Stack, api: ApiClient, job_id: str, steps: int) -> None:
    """attempt 2 finished the job; every step once; attempt 1 only up to the checkpoint attempt 2 resumed from."""
    job = api.job(job_id)
    assert job["status"] == "succeeded" and job["attempt"] == 2, stack.logs()
    assert api.metric_steps(job_id) == list(range(1, steps + 1))
    resume_step = api.resume_step(job_id, attempt=2)
    assert resume_step >= 2, "the second attempt must resume from a checkpoint, not from scratch"
    by_step = _metric_attempts(stack.database_url, job_id)
    assert all(len(attempts) == 1 for attempts in by_step.values())
    assert {s: a.pop() for s, a in by_step.items()} == {
        s: 1 if s <= resume_step else 2 for s in range(1, steps + 1)
    }
    late = _rows(stack.database_url, "SELECT step FROM checkpoints WHERE job_id = :j AND attempt = 1 AND step > :s",
                 j=job_id, s=resume_step)
    assert late == []
    # The event log lists each step's metrics once, from the attempt whose values count.
    logged = [(e["data"]["step"], e["attempt"]) for e in api.events(job_id) if e["type"] == "metrics"]
    assert logged == [(s, 1 if s <= resume_step else 2) for s in range(1, steps + 1)]


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(database_url=_postgres_database, broker_url=broker, data_dir=private_tmp("grpo-faults-"))
    try:
        stack.start_api()
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def workers(stack: Stack) -> SpareWorkers:
    """The worker that took over a test's job is the next test's first worker (the stack stops it at the end)."""
    return SpareWorkers(stack)


class TestWorkerDeath:
    # Asynchronous generation too: the batches in flight die with the worker; the resumed attempt samples them
    # again from the checkpoint's weights and prompt cursor.
    @pytest.mark.parametrize("hyper", [{}, {"async_generation": True, "max_staleness": 2}], ids=["sync", "async"])
    def test_sigkill_after_checkpoint_resumes_on_new_worker(
        self, stack: Stack, workers: SpareWorkers, hyper: dict[str, object]
    ) -> None:
        api = stack.make_client()
        first = workers.take()
        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(tiny_spec(dataset, max_steps=8, checkpoint_every=2, **hyper))
        api.wait_step(job_id, 3)
        # Checkpoints register after their upload, which a fast step can outrun: kill once one is registered.
        wait_for(lambda: api.checkpoints(job_id), timeout=120, what="a registered checkpoint")
        first.kill()  # SIGKILL the Celery parent and the child running the job
        with workers.lent(stack.start_worker()):
            api.wait_status(job_id, {"succeeded"}, timeout=300)
            _assert_resumed_cleanly(stack, api, job_id, 8)
            assert any(e["type"] == "lease_expired" for e in api.events(job_id))

    def test_frozen_worker_loses_lease_and_its_late_writes_are_refused(
        self, stack: Stack, workers: SpareWorkers
    ) -> None:
        api = stack.make_client()
        first = workers.take()
        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(tiny_spec(dataset, max_steps=12, checkpoint_every=2))
        api.wait_step(job_id, 3)
        first.signal_group(signal.SIGSTOP)
        second = stack.start_worker()
        try:
            wait_for(lambda: api.job(job_id)["attempt"] == 2, timeout=120, what="attempt 2 to claim the job")
            taken_at = api.job(job_id)["progress"]["step"]
            api.wait_step(job_id, taken_at + 1)  # the new attempt is writing
            earlier = len(first.log())  # what a worker handed on from an earlier test logged is not this test's
            first.signal_group(signal.SIGCONT)  # the zombie wakes up mid-step and tries to report
            wait_for(lambda: "lost the job to a newer attempt" in first.log()[earlier:], timeout=120,
                     what="the frozen worker to find its writes refused")
            api.wait_status(job_id, {"succeeded"}, timeout=300)
            _assert_resumed_cleanly(stack, api, job_id, 12)
        finally:
            stop_together([first, second])


class TestBrokerRestart:
    def test_redis_restart_mid_job(self, _postgres_database: str) -> None:
        redis = RedisServer(free_port(), private_tmp("grpo-redis-"))
        redis.start()
        stack = Stack(database_url=_postgres_database, broker_url=redis.url, data_dir=private_tmp("grpo-rr-"))
        try:
            stack.start_api()
            stack.start_worker()
            api = stack.make_client()
            dataset = api.upload_dataset(PROMPTS)
            job_id = api.submit(tiny_spec(dataset, max_steps=6))
            api.wait_step(job_id, 2)
            redis.stop()
            time.sleep(2)
            redis.start()  # empty: the restart lost every message (no persistence)
            job = api.wait_status(job_id, {"succeeded"}, timeout=300)
            assert job["attempt"] == 1 and api.metric_steps(job_id) == list(range(1, 7)), stack.logs()
            # The worker and the API reconnected: a job submitted after the restart runs too.
            after = api.submit(tiny_spec(dataset, max_steps=2))
            assert api.wait_status(after, {"succeeded"}, timeout=180)["attempt"] == 1, stack.logs()
        finally:
            stack.stop_all()
            redis.stop()


class TestDatabaseRestart:
    def test_postgres_restart_mid_job(self, redis_base_url: str) -> None:
        cluster = PostgresCluster(free_port(), private_tmp("grpo-pg-"))
        cluster.init()
        broker = fresh_redis_database(redis_base_url)
        # A lease longer than the outage: the job must survive the restart on its own worker.
        stack = Stack(database_url=cluster.url, broker_url=broker, data_dir=private_tmp("grpo-pr-"),
                      lease_seconds=60)
        try:
            stack.start_api()
            stack.start_worker()
            api = stack.make_client()
            dataset = api.upload_dataset(PROMPTS)
            job_id = api.submit(tiny_spec(dataset, max_steps=6))
            api.wait_step(job_id, 2)
            cluster.stop("fast")  # terminates every connection
            time.sleep(3)
            cluster.start()
            job = api.wait_status(job_id, {"succeeded"}, timeout=300)
            assert job["attempt"] == 1 and api.metric_steps(job_id) == list(range(1, 7)), stack.logs()
        finally:
            stack.stop_all()
            try:
                cluster.stop("immediate")
            except Exception:  # already stopped
                pass
