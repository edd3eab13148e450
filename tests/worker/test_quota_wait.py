"""A job over its tenant's running-jobs quota is accepted, waits `queued` although a worker is free, then runs:
real API, two `grpo worker` processes, Redis and PostgreSQL (the quota: the settings default, 1)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import pytest

from tests.service.conftest import new_postgres_database
from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import Stack, fresh_redis_database, private_tmp

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def own_database(postgres_admin_url: str) -> Iterator[str]:
    """A database of this test's own: with the running quota at 1 for every tenant, queued jobs other tests left in
    the session's database would be claimed (fairly) before this test's."""
    yield from new_postgres_database(postgres_admin_url)


@pytest.fixture
def stack(own_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(
        database_url=own_database, broker_url=broker, data_dir=private_tmp("grpo-quota-"),
        # The reaper's re-send must not be what starts the waiting job: the finished job's wake-up is.
        queued_resend_seconds=600, extra_env={"GRPO_QUOTA_MAX_RUNNING_JOBS": "1"},
    )
    try:
        stack.start_api()
        stack.start_worker()
        stack.start_worker()
        yield stack
    finally:
        stack.stop_all()


def _time(value: object) -> datetime:
    assert isinstance(value, str), value
    return datetime.fromisoformat(value)


def test_job_over_the_running_quota_waits_queued_then_runs(stack: Stack) -> None:
    api = stack.make_client()
    dataset = api.upload_dataset(PROMPTS)
    first = api.submit(tiny_spec(dataset, max_steps=3))
    api.wait_status(first, {"running"}, timeout=120)
    second = api.submit(tiny_spec(dataset, max_steps=3))
    assert api.job(second)["status"] == "queued"
    done = [api.wait_status(job_id, {"succeeded"}, timeout=240) for job_id in (first, second)]
    assert _time(done[1]["started_at"]) >= _time(done[0]["finished_at"]), stack.logs()
    assert done[1]["attempt"] == 1
    assert "not claimable" in stack.logs()  # the second job's own delivery found it held back
