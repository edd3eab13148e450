"""Fair scheduling end to end: one real worker process, tenant A queues 10 jobs, then tenant B queues 1; B's job
starts no later than A's second job finishes. On SQLite with the embedded broker (`grpo serve` with its worker)
and on PostgreSQL with Redis (`grpo serve --no-worker` + `grpo worker`).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import pytest

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import Stack, fresh_redis_database, private_tmp, wait_for

pytestmark = [pytest.mark.slow]


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    data_dir = private_tmp("grpo-fair-")
    if request.param == "sqlite":
        stack = Stack(
            database_url=f"sqlite:///{data_dir}/grpo.db", broker_url=f"sqla+sqlite:///{data_dir}/broker.db",
            # CPU only: the embedded worker imports the engine once, as Stack.start_worker's workers do, not in
            # each job's child.
            data_dir=data_dir, extra_env={"GRPO_WORKER_PRELOAD_ENGINE": "true"},
        )
    else:
        database = request.getfixturevalue("_postgres_database")
        redis = request.getfixturevalue("redis_base_url")
        # A Redis database of our own: messages of other runs name jobs this database does not have.
        stack = Stack(database_url=database, broker_url=fresh_redis_database(redis), data_dir=data_dir)
    try:
        if request.param == "sqlite":
            api = stack.start_api(worker=True)
            wait_for(lambda: " ready." in api.log(), timeout=90, what="the embedded worker")
        else:
            stack.start_api()
            stack.start_worker()
        yield stack
    finally:
        stack.stop_all()


def _time(job: dict[str, object], field: str) -> datetime:
    value = job[field]
    assert isinstance(value, str), job
    return datetime.fromisoformat(value)


def test_second_tenant_starts_before_the_first_tenants_second_job_finishes(stack: Stack) -> None:
    tenant_a, tenant_b = stack.make_client(), stack.make_client()
    spec = tiny_spec(tenant_a.upload_dataset(PROMPTS), max_steps=2, checkpoint_every=2)
    a_jobs = [tenant_a.submit(spec) for _ in range(10)]
    b_job = tenant_b.submit(tiny_spec(tenant_b.upload_dataset(PROMPTS), max_steps=2, checkpoint_every=2))

    def two_of_a_finished() -> list[dict[str, object]] | None:
        done = [job for job in map(tenant_a.job, a_jobs) if job["status"] == "succeeded"]
        return done if len(done) >= 2 else None

    finished = wait_for(two_of_a_finished, timeout=300, interval=0.5, what=f"two of A's jobs\n{stack.logs()}")
    second_finish = sorted(_time(job, "finished_at") for job in finished)[1]
    b = tenant_b.job(b_job)  # it must have started by now
    assert b["started_at"] is not None, f"B's job is {b['status']}\n{stack.logs()}"
    assert _time(b, "started_at") <= second_finish, stack.logs()
    for job_id in a_jobs:  # leave nothing running behind
        tenant_a.http.post(f"/v1/jobs/{job_id}/cancel")
