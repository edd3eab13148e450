"""use_vllm jobs through real processes: API -> Redis -> `grpo worker` (the vLLM CPU engine in the job's
process) -> PostgreSQL. The examples/ vowel task trains end to end; a worker SIGKILLed mid-job is
replaced and the job resumes from its last checkpoint, the new attempt's engine built from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.worker.procs import ApiClient, Stack, fresh_redis_database, private_tmp, wait_for
from tests.worker.spare_workers import SpareWorkers
from tests.worker.test_faults import _assert_resumed_cleanly

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOWEL_ROWS = [json.loads(line) for line in (EXAMPLES / "data" / "vowel_train.jsonl").read_text().splitlines()]
IS_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/importance_sampling_masked_fraction",
)


def _vowel_spec(dataset_id: str, **hyper: Any) -> dict[str, Any]:
    """examples/tiny.yaml's job with vLLM rollouts."""
    hyperparameters: dict[str, Any] = {
        "use_vllm": True,
        "num_generations": 8,
        "prompts_per_step": 4,
        "max_steps": 24,
        "learning_rate": 0.003,
        "lr_scheduler": "constant",
        "beta": 0.04,
        "max_completion_length": 4,
        "checkpoint_every": 12,
        "seed": 0,
    }
    hyperparameters.update(hyper)
    return {
        "base_model": "builtin:tiny",
        "train_dataset": dataset_id,
        "rewards": [{"type": "builtin", "name": "regex_match", "weight": 1.0, "params": {"pattern": "^[aeiou]"}}],
        "hyperparameters": hyperparameters,
    }


def _series(api: ApiClient, job_id: str) -> dict[str, Any]:
    response = api.http.get(f"/v1/jobs/{job_id}/metrics")
    assert response.status_code == 200, response.text
    return dict(response.json()["series"])


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(database_url=_postgres_database, broker_url=broker, data_dir=private_tmp("grpo-vllm-"))
    try:
        stack.start_api()
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def workers(stack: Stack) -> SpareWorkers:
    """The worker left idle by a test is the next test's first worker (the stack stops it at the end)."""
    return SpareWorkers(stack)


def test_vllm_job_trains_the_vowel_example_end_to_end(stack: Stack, workers: SpareWorkers, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    api = stack.make_client()
    with workers.lent(workers.take()):
        job_id = api.submit(_vowel_spec(api.upload_dataset(VOWEL_ROWS)))
        job = api.wait_status(job_id, {"succeeded", "failed"}, timeout=400)
        assert job["status"] == "succeeded", (job.get("error"), stack.logs())
    assert api.metric_steps(job_id) == list(range(1, 25))
    series = _series(api, job_id)
    for name in IS_METRICS:
        assert series[name]["steps"] == list(range(1, 25)), name
    assert max(series["sampling/sampling_logp_difference/max"]["values"]) < 1e-3
    rewards = series["reward/mean"]["values"]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(f"service job, vLLM rollouts: reward first 4 steps {first:.3f}, last 4 {last:.3f}")
    assert last > first + 0.4, rewards
    local = api.download_checkpoint(api.checkpoints(job_id)[-1], tmp_path / "ckpt")
    assert AutoModelForCausalLM.from_pretrained(local).num_parameters() > 0


def test_vllm_job_resumes_after_sigkill_from_its_checkpoint(stack: Stack, workers: SpareWorkers) -> None:
    api = stack.make_client()
    first = workers.take()
    job_id = api.submit(_vowel_spec(api.upload_dataset(VOWEL_ROWS), max_steps=8, checkpoint_every=2))
    api.wait_step(job_id, 3, timeout=300)
    wait_for(lambda: api.checkpoints(job_id), timeout=120, what="a registered checkpoint")
    first.kill()  # SIGKILL the Celery parent and the child running the job with its engine
    with workers.lent(stack.start_worker()):
        api.wait_status(job_id, {"succeeded"}, timeout=400)
        _assert_resumed_cleanly(stack, api, job_id, 8)
    # The second attempt's engine was built from the checkpoint: it samples as the resumed policy does.
    diffs = _series(api, job_id)["sampling/sampling_logp_difference/max"]
    assert diffs["steps"] == list(range(1, 9))
    assert max(diffs["values"]) < 1e-3, diffs
