"""Owned model sources and user patterns through real processes: API (`grpo serve --no-worker`) -> Redis ->
one `grpo worker` -> PostgreSQL.

- A tenant's own `checkpoint:<id>` trains end to end, as base model and as reward model, and really starts
  from that checkpoint's weights.
- A model the worker cannot load fails the job as `model_load_failed` without the loader's text.
- The catastrophic pattern `(.|.)*ZQ` scores in bounded time on long completions, the lease is never lost,
  and a second tenant's job submitted right after it completes on the same (only) worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import ApiClient, Stack, fresh_redis_database, private_tmp

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(database_url=_postgres_database, broker_url=broker, data_dir=private_tmp("grpo-owned-"))
    try:
        stack.start_api()
        stack.start_worker()
        yield stack
    finally:
        stack.stop_all()


def _weights(api: ApiClient, checkpoint: dict[str, object], target: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(api.download_checkpoint(checkpoint, target) / "model.safetensors"))


class TestOwnCheckpoint:
    def test_job_from_own_checkpoint_trains_from_its_weights(self, stack: Stack, tmp_path: Path) -> None:
        import torch

        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        spec = tiny_spec(dataset, max_steps=3, checkpoint_every=3, learning_rate=1e-2)
        # A reward that differs within every group, so the advantages (and the updates) are not zero.
        spec["rewards"] = [{"type": "builtin", "name": "length_penalty", "params": {"target_length": 1}}]
        first = api.submit(spec)
        api.wait_status(first, {"succeeded"}, timeout=240)
        (source,) = api.checkpoints(first)

        # Base model and reward model both from the tenant's own checkpoint; a learning rate so small that
        # the new checkpoint must equal the one it started from.
        spec = tiny_spec(dataset, max_steps=1, checkpoint_every=1, learning_rate=1e-12)
        spec["base_model"] = f"checkpoint:{source['id']}"
        spec["rewards"].append({"type": "model", "model": f"checkpoint:{source['id']}", "batch_size": 4})
        second = api.submit(spec)
        job = api.wait_status(second, {"succeeded"}, timeout=240)
        assert job["attempt"] == 1 and api.metric_steps(second) == [1], stack.logs()
        assert f"reward/model:checkpoint:{source['id']}/mean" in job["metrics"]

        (derived,) = api.checkpoints(second)
        before = _weights(api, source, tmp_path / "source")
        after = _weights(api, derived, tmp_path / "derived")
        assert before.keys() == after.keys()
        for name, tensor in before.items():
            assert torch.allclose(tensor, after[name], atol=1e-6), name  # type: ignore[arg-type]
        # ...and that is not simply builtin:tiny's initialisation: the first job moved the weights.
        fresh = api.submit(tiny_spec(dataset, max_steps=1, checkpoint_every=1, learning_rate=1e-12))
        api.wait_status(fresh, {"succeeded"}, timeout=240)
        initial = _weights(api, api.checkpoints(fresh)[0], tmp_path / "fresh")
        assert any(not torch.allclose(initial[n], before[n], atol=1e-4) for n in before)  # type: ignore[arg-type]

    def test_unloadable_model_fails_without_the_loaders_text(self, stack: Stack) -> None:
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        spec = tiny_spec(dataset)
        spec["base_model"] = "/etc"  # a local path (development mode accepts any outside the service's data)
        job = api.wait_status(api.submit(spec), {"failed"}, timeout=120)
        assert job["error"] == {
            "code": "model_load_failed",
            "message": "base_model: '/etc' could not be loaded",
        }

        spec = tiny_spec(dataset)
        spec["rewards"].append({"type": "model", "model": "/etc/passwd"})
        job = api.wait_status(api.submit(spec), {"failed"}, timeout=120)
        assert job["error"] == {
            "code": "model_load_failed",
            "message": "reward source 'model:/etc/passwd': the reward model could not be loaded",
        }


class TestWorkerChecksAgain:
    def test_a_stored_spec_pointing_into_storage_fails_before_loading(self, stack: Stack) -> None:
        """A spec stored under other rules (an older release, other settings) is checked by the worker too."""
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        owner = api.submit(tiny_spec(dataset, max_steps=2, checkpoint_every=2))
        api.wait_status(owner, {"succeeded"}, timeout=240)
        (checkpoint,) = api.checkpoints(owner)
        target = stack.data_dir / "storage" / "checkpoints" / owner / checkpoint["id"]
        assert (target / "model.safetensors").exists()

        busy = api.submit(tiny_spec(dataset, max_steps=200, checkpoint_every=100))
        api.wait_step(busy, 1)  # the only worker is busy: the next job stays queued meanwhile
        queued = api.submit(tiny_spec(dataset, max_steps=2))
        _set_base_model(stack, queued, str(target))
        api.post(f"/v1/jobs/{busy}/cancel")

        job = api.wait_status(queued, {"failed"}, timeout=120)
        assert job["error"]["code"] == "model_source_refused", job["error"]
        assert job["error"]["message"].startswith(f"base_model: '{target}' is not accepted: ")
        assert not api.checkpoints(queued)


def _set_base_model(stack: Stack, job_id: str, base_model: str) -> None:
    from sqlalchemy import select

    from service.jobs.models import Job
    from service.kit import db as kit_db

    engine = kit_db.make_engine(stack.database_url)
    try:
        with kit_db.session_scope(engine) as session:
            job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
            assert job.status == "queued"
            job.spec = {**job.spec, "base_model": base_model}
            job.base_model = base_model
    finally:
        engine.dispose()


class TestCatastrophicPattern:
    def test_scores_in_bounded_time_and_the_next_tenant_runs(self, stack: Stack) -> None:
        attacker, neighbour = stack.make_client(), stack.make_client()
        # Long completions (one character per token): Python's re would need ~2^48 steps on each.
        spec = tiny_spec(
            attacker.upload_dataset(PROMPTS), max_steps=3, max_completion_length=48, num_generations=4
        )
        spec["rewards"] = [{"type": "builtin", "name": "regex_match", "params": {"pattern": "(.|.)*ZQ"}}]
        slow = attacker.submit(spec)
        after = neighbour.submit(tiny_spec(neighbour.upload_dataset(PROMPTS), max_steps=2))

        done = attacker.wait_status(slow, {"succeeded"}, timeout=180)
        assert done["attempt"] == 1, stack.logs()  # the lease was never lost
        assert not [e for e in attacker.events(slow) if e["type"] == "lease_taken_over"]
        lengths = [len(s["completion"]) for s in attacker.http.get(f"/v1/jobs/{slow}/samples").json()["data"]]
        assert max(lengths) >= 30, lengths  # the pattern did meet completions long enough to hang `re`
        assert neighbour.wait_status(after, {"succeeded"}, timeout=180)["attempt"] == 1
