"""Usage metering through real processes: API (`grpo serve --no-worker`) -> Redis -> `grpo worker` (a prefork child
per job) -> PostgreSQL. After two jobs, `/v1/usage` is the exact sum of their per-step records, and each step's
tokens generated are the completion lengths the engine reported for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import Stack, fresh_redis_database, private_tmp

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]
FIELDS = ("steps", "tokens_generated", "tokens_trained", "tokens", "reward_calls", "device_seconds")


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(database_url=_postgres_database, broker_url=broker, data_dir=private_tmp("grpo-usage-"))
    try:
        stack.start_api()
        stack.start_worker(preload_engine=False)  # the default: each job's child imports the engine itself
        yield stack
    finally:
        stack.stop_all()


def test_usage_of_two_jobs_is_the_sum_of_their_step_records(stack: Stack) -> None:
    api = stack.make_client()
    dataset = api.upload_dataset(PROMPTS)
    specs = [tiny_spec(dataset, max_steps=3, checkpoint_every=3), tiny_spec(dataset, max_steps=2, seed=1)]
    jobs = [api.submit(spec) for spec in specs]
    for job_id in jobs:
        try:
            api.wait_status(job_id, {"succeeded"}, timeout=240)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {api.job(job_id)}\n{stack.logs()[-6000:]}") from exc

    records = {}
    for job_id, spec in zip(jobs, specs, strict=True):
        usage = api.http.get(f"/v1/jobs/{job_id}/usage").json()
        records[job_id] = usage["steps"]
        hyper = spec["hyperparameters"]
        assert [s["step"] for s in usage["steps"]] == list(range(1, hyper["max_steps"] + 1)), stack.logs()
        lengths = api.http.get(f"/v1/jobs/{job_id}/metrics", params={"names": "completion_length/mean"}).json()
        completions = hyper["num_generations"] * hyper["prompts_per_step"]
        reported = [round(v * completions) for v in lengths["series"]["completion_length/mean"]["values"]]
        assert [s["tokens_generated"] for s in usage["steps"]] == reported
        assert all(s["device_seconds"] > 0 and s["attempt"] == 1 for s in usage["steps"])

    report = api.http.get("/v1/usage", params={"group_by": "job"}).json()
    every_step = [s for steps in records.values() for s in steps]
    assert {name: report["totals"][name] for name in FIELDS if name != "steps"} == pytest.approx(
        {name: sum(s[name] for s in every_step) for name in FIELDS if name != "steps"}, rel=0, abs=1e-9
    )
    assert report["totals"]["steps"] == len(every_step) == 5
    assert {g["key"]: g["tokens"] for g in report["data"]} == {
        job_id: sum(s["tokens"] for s in steps) for job_id, steps in records.items()
    }
