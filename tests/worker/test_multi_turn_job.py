"""Multi-turn jobs end to end: a registered OpenEnv server drives a job through the queue.

Real processes: the API and a worker on PostgreSQL with a Redis broker, the engine on `builtin:tiny-tools` (built
once per test session into a shared cache and linked into the stack's model folder), and the example calculator
(OpenEnv's `create_app`) as its own process on loopback. A second calculator that is stopped after registration
stands for an environment that is down for a whole step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.trainer_helpers import shared_model_cache
from tests.openenv_servers import calculator
from tests.worker.procs import ApiClient, Stack, fresh_redis_database, private_tmp
from worker.grpo.tool_tasks import split
from worker.grpo.warm_tools import build_tools_model

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    built = build_tools_model(shared_model_cache())  # trained once, then cached
    data_dir = private_tmp("grpo-multi-turn-")
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "models" / built.name).symlink_to(built)
    stack = Stack(database_url=_postgres_database, broker_url=fresh_redis_database(redis_base_url), data_dir=data_dir)
    try:
        stack.start_api()
        stack.start_worker()
        yield stack
    finally:
        stack.stop_all()


def register(api: ApiClient, url: str, **settings: Any) -> str:
    response = api.http.post("/v1/environments", json={"name": "calculator", "url": url, **settings})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def multi_turn_spec(dataset_id: str, environment_id: str, **hyper: Any) -> dict[str, Any]:
    hyperparameters = {
        "num_generations": 2, "prompts_per_step": 2, "max_steps": 2, "max_completion_length": 160,
        "learning_rate": 1e-3, "checkpoint_every": 2, "log_completions_every": 1, "log_completions_count": 4,
        "seed": 0, **hyper,
    }
    return {
        "base_model": "builtin:tiny-tools",
        "train_dataset": dataset_id,
        "rewards": [{"type": "environment", "weight": 1.0}],
        "environment": {"environment_id": environment_id, "max_turns": 3},
        "hyperparameters": hyperparameters,
    }


ROWS = [item.row() for item in split()[0][:4]]


def test_a_job_on_the_calculator_trains_on_multi_turn_episodes(stack: Stack, calculator_url: str) -> None:
    api = stack.make_client()
    environment_id = register(api, calculator_url)
    job_id = api.submit(multi_turn_spec(api.upload_dataset(ROWS), environment_id))
    job = api.wait_status(job_id, {"succeeded", "failed", "paused"}, timeout=300)
    assert job["status"] == "succeeded", (job, stack.logs()[-6000:])

    samples = api.http.get(f"/v1/jobs/{job_id}/samples").json()["data"]
    assert len(samples) == 8 and all(s["episode"] is not None for s in samples)
    turns = [s["episode"]["turns"] for s in samples]
    # The policy called the calculator and was sampled again after reading its result.
    assert any([t["role"] for t in episode][:3] == ["assistant", "tool", "assistant"] for episode in turns), turns
    called = [t for episode in turns for t in episode if t["role"] == "tool" and t["name"] != "unparsed"]
    assert called and all(t["masked"] for episode in turns for t in episode if t["role"] == "tool")
    assert all(s["rewards"]["environment"] in (0.0, 1.0) for s in samples)  # the calculator's submit reward
    # The job's SSE stream carries each step's samples with their episodes (a finished job's stream ends).
    streamed = sse_events(api, job_id, "samples")
    assert [e["step"] for e in streamed] == [1, 2]
    assert [s["episode"] for e in streamed for s in e["samples"]] == [s["episode"] for s in
                                                                       sorted(samples, key=lambda s: s["id"])]
    metrics = api.http.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    assert metrics["env/episodes"]["values"] == [4.0, 4.0]
    assert metrics["env/errors"]["values"] == [0.0, 0.0]
    assert metrics["env/tool_calls"]["values"][0] >= 1


def sse_events(api: ApiClient, job_id: str, kind: str) -> list[dict[str, Any]]:
    """The data of every `kind` message of the job's SSE stream."""
    found: list[dict[str, Any]] = []
    with api.http.stream("GET", f"/v1/jobs/{job_id}/stream", timeout=60) as response:
        assert response.status_code == 200
        event = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == kind:
                found.append(json.loads(line.removeprefix("data: "))["data"])
    return found


def test_an_environment_down_for_the_whole_step_pauses_the_job(stack: Stack, tmp_path: Path) -> None:
    api = stack.make_client()
    with calculator(tmp_path) as url:  # up while it is registered (registration checks it), then gone
        environment_id = register(api, url, max_attempts=2, backoff_s=0.05)
    job_id = api.submit(multi_turn_spec(api.upload_dataset(ROWS), environment_id))
    job = api.wait_status(job_id, {"succeeded", "failed", "paused"}, timeout=300)
    assert job["status"] == "paused", (job, stack.logs()[-6000:])
    events = [e for e in api.events(job_id) if e["type"] == "environment_unavailable"]
    assert len(events) == 1 and environment_id in events[0]["message"], api.events(job_id)


def test_a_job_naming_another_tenants_environment_is_refused_as_not_found(stack: Stack, calculator_url: str) -> None:
    owner, other = stack.make_client(), stack.make_client()
    environment_id = register(owner, calculator_url)
    spec = multi_turn_spec(other.upload_dataset(ROWS), environment_id)
    refused = other.http.post("/v1/jobs", json=spec)
    missing = other.http.post("/v1/jobs", json={**spec, "environment": {"environment_id": "env_nope"}})
    assert refused.status_code == missing.status_code == 422
    details = [refused.json()["error"]["details"][0], missing.json()["error"]["details"][0]]
    assert [d["field"] for d in details] == ["environment.environment_id"] * 2
    assert details[0]["message"].replace(environment_id, "X") == details[1]["message"].replace("env_nope", "X")
