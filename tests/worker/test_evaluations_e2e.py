"""Evaluations end to end through real processes: API (`grpo serve --no-worker`) -> Redis -> `grpo worker` ->
the engine's evaluator -> PostgreSQL. The results are checked against a direct computation from the items'
completions and the dataset's answers; a comparison of `builtin:tiny-instruct` with a checkpoint GRPO trained from
it on the demo's task excludes 0, and of one checkpoint with itself includes it; a worker SIGKILLed mid-evaluation
leaves a next attempt that continues after the last recorded batch, every item once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cli.demo import DEMO_TASK, demo_hyperparameters
from service.evaluations.stats import pass_at_k
from tests.engine.trainer_helpers import shared_model_cache
from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import ApiClient, Stack, fresh_redis_database, private_tmp, wait_for
from tests.worker.spare_workers import SpareWorkers
from worker.grpo.synthetic import held_out_items, split
from worker.grpo.warm import build_instruct_model

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

HELD_OUT = [item.row() for item in held_out_items(DEMO_TASK)]
TRAIN = [item.row() for item in split(DEMO_TASK)[0]]
TRAIN_STEPS = 60  # the demo trains 120; half already moves held-out accuracy far beyond noise


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    built = build_instruct_model(shared_model_cache())  # trained once per machine, then cached
    data_dir = private_tmp("grpo-evals-")
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "models" / built.name).symlink_to(built)  # the worker finds it built
    stack = Stack(database_url=_postgres_database, broker_url=broker, data_dir=data_dir)
    try:
        stack.start_api()
        yield stack
    finally:
        stack.stop_all()
    # The workers took the shared model: none trained a copy of its own beside the link.
    assert [p.name for p in (data_dir / "models").iterdir() if p.name.startswith("tiny-instruct")] == [built.name]


@pytest.fixture(scope="module")
def workers(stack: Stack) -> SpareWorkers:
    """One worker serves the tests in turn (the stack stops the last one)."""
    return SpareWorkers(stack)


def evaluate(api: ApiClient, dataset: str, model: str, **fields: Any) -> str:
    spec = {"model": model, "dataset": dataset, "rewards": [{"type": "builtin", "name": "exact_match"}],
            "max_tokens": 4, **fields}
    response = api.http.post("/v1/evaluations", json=spec)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def finished(api: ApiClient, evaluation_id: str, stack: Stack, timeout: float = 300) -> dict[str, Any]:
    api.wait_status(evaluation_id, {"succeeded", "failed", "cancelled", "paused"}, timeout=timeout)
    body = api.http.get(f"/v1/evaluations/{evaluation_id}").json()
    assert body["status"] == "succeeded", (body, stack.logs())
    return dict(body)


def items(api: ApiClient, evaluation_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after: int | None = None
    while True:
        params = {"limit": 50} if after is None else {"limit": 50, "after": after}
        page = api.http.get(f"/v1/evaluations/{evaluation_id}/items", params=params).json()
        found += page["data"]
        if not page["has_more"]:
            return found
        after = page["next_after"]


def compare(api: ApiClient, a: str, b: str) -> dict[str, Any]:
    response = api.http.post("/v1/evaluations/compare", json={"evaluation_a": a, "evaluation_b": b})
    assert response.status_code == 200, response.text
    return dict(response.json())


class TestEvaluations:
    def test_results_match_a_direct_computation_and_a_trained_checkpoint_beats_its_base(
        self, stack: Stack, workers: SpareWorkers
    ) -> None:
        api = stack.make_client()
        with workers.lent(workers.take()):
            hyper = {k: v for k, v in demo_hyperparameters(TRAIN_STEPS).items() if not k.startswith(("eval", "log"))}
            job = api.submit({
                "base_model": "builtin:tiny-instruct", "train_dataset": api.upload_dataset(TRAIN),
                "rewards": [{"type": "builtin", "name": "exact_match"}], "hyperparameters": hyper,
            })
            api.wait_status(job, {"succeeded"}, timeout=600)
            dataset = api.upload_dataset(HELD_OUT)
            trained = evaluate(api, dataset, f"checkpoint:{api.checkpoints(job)[-1]['id']}", samples_per_item=4, seed=3)
            base = evaluate(api, dataset, "builtin:tiny-instruct", samples_per_item=4, seed=3)
            trained_body, base_body = finished(api, trained, stack), finished(api, base, stack)
        results = trained_body["results"]
        scored = items(api, trained)
        assert [i["index"] for i in scored] == list(range(len(HELD_OUT)))
        # Exact match recomputed here from the stored completions and the dataset's answers.
        correct = [sum(c.strip() == row["answer"] for c in item["completions"]) for item, row in
                   zip(scored, HELD_OUT, strict=True)]
        assert all(len(item["completions"]) == 4 for item in scored)
        assert results["binary"] and results["samples"] == 4 * len(HELD_OUT)
        assert results["accuracy"] == pytest.approx(sum(correct) / (4 * len(HELD_OUT)))
        assert results["pass_at_k"] == pytest.approx(sum(pass_at_k(4, c, 4) for c in correct) / len(HELD_OUT))
        assert 0 < results["accuracy"] < 1 and results["tokens_generated"] > 0
        comparison = compare(api, base, trained)
        print(f"base {base_body['results']['accuracy']:.2f} -> checkpoint {results['accuracy']:.2f}: {comparison}")
        assert comparison["interval"]["low"] > 0, comparison
        assert comparison["test"] == "paired_permutation" and comparison["p_value"] < 0.01
        assert base_body["results"]["accuracy"] < results["accuracy"]

    def test_one_checkpoint_against_itself_includes_zero(self, stack: Stack, workers: SpareWorkers) -> None:
        api = stack.make_client()
        with workers.lent(workers.take()):
            train = api.upload_dataset(PROMPTS)
            job = api.submit(tiny_spec(train, max_steps=2, checkpoint_every=2))
            api.wait_status(job, {"succeeded"}, timeout=240)
            model = f"checkpoint:{api.checkpoints(job)[-1]['id']}"
            dataset = api.upload_dataset(HELD_OUT)
            first = evaluate(api, dataset, model, seed=1)
            again = evaluate(api, dataset, model, seed=1)
            other_seed = evaluate(api, dataset, model, seed=2)
            for evaluation_id in (first, again, other_seed):
                finished(api, evaluation_id, stack)
        # The same spec samples the same completions: the comparison is exactly 0.
        assert [i["completions"] for i in items(api, first)] == [i["completions"] for i in items(api, again)]
        same = compare(api, first, again)
        assert same["difference"] == 0 and same["interval"]["low"] <= 0 <= same["interval"]["high"], same
        # Other draws of the same model: no difference beyond noise. A 95 % interval misses 0 in 1 case of 20 by
        # construction, and which case that is depends on the CPU's float rounding: the test asks only for a p-value
        # that a real difference would not give.
        resampled = compare(api, first, other_seed)
        assert resampled["p_value"] > 0.001, resampled

    def test_a_worker_killed_mid_evaluation_leaves_each_item_once(self, stack: Stack, workers: SpareWorkers) -> None:
        api = stack.make_client()
        first = workers.take()
        dataset = api.upload_dataset(HELD_OUT * 4)
        evaluation = evaluate(api, dataset, "builtin:tiny", samples_per_item=2, max_tokens=8)
        try:
            wait_for(lambda: api.job(evaluation)["progress"]["step"] >= 16, timeout=240, what="a recorded batch")
        finally:
            first.kill()  # SIGKILL the Celery parent and the child running the evaluation
        recorded = api.job(evaluation)["progress"]["step"]
        with workers.lent(stack.start_worker()):
            body = finished(api, evaluation, stack, timeout=400)
        assert body["attempt"] == 2 and body["progress"]["items_done"] == 4 * len(HELD_OUT)
        assert api.resume_step(evaluation, attempt=2) >= recorded > 0
        assert [i["index"] for i in items(api, evaluation)] == list(range(4 * len(HELD_OUT)))
        assert body["results"]["items"] == 4 * len(HELD_OUT)
