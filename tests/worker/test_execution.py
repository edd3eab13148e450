"""End to end through real processes: API (`grpo serve --no-worker`) -> Redis (127.0.0.1:6379) -> `grpo worker`
-> engine on `builtin:tiny` -> PostgreSQL; checkpoints downloaded through the API and loaded with
from_pretrained. Also cancel (queued and running), pause/resume, and duplicate delivery.

One stack per module (API + worker) keeps the suite fast; every test uses its own tenant and jobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.kit.queue import CeleryJobQueue
from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import ApiClient, Stack, fresh_redis_database, private_tmp, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    # A Redis database number of our own: stale messages from other runs name jobs this database does
    # not have, and the claim turns them into no-ops.
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(database_url=_postgres_database, broker_url=broker, data_dir=private_tmp("grpo-e2e-"))
    try:
        stack.start_api()
        stack.start_worker()
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture
def api(stack: Stack) -> ApiClient:
    return stack.make_client()


def _status_changes(api: ApiClient, job_id: str) -> list[str]:
    return [e["data"]["to"] for e in api.events(job_id) if e["type"] == "status"]


class TestEndToEnd:
    def test_job_trains_to_success_with_downloadable_checkpoint(
        self, api: ApiClient, stack: Stack, tmp_path: Path
    ) -> None:
        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(tiny_spec(dataset, max_steps=4, checkpoint_every=2))
        job = api.wait_status(job_id, {"succeeded"}, timeout=240)

        assert job["attempt"] == 1 and job["progress"]["step"] == 4, stack.logs()
        assert api.metric_steps(job_id) == [1, 2, 3, 4]
        assert _status_changes(api, job_id) == ["queued", "running", "succeeded"]
        checkpoints = api.checkpoints(job_id)
        assert [c["step"] for c in checkpoints] == [2, 4]

        from transformers import AutoModelForCausalLM, AutoTokenizer

        local = api.download_checkpoint(checkpoints[-1], tmp_path / "ckpt")
        model = AutoModelForCausalLM.from_pretrained(local)
        tokenizer = AutoTokenizer.from_pretrained(local)
        assert model.num_parameters() > 0 and tokenizer("hi")["input_ids"]

    def test_lora_job_checkpoint_loads_as_adapter_and_as_merged_model(
        self, api: ApiClient, stack: Stack, tmp_path: Path
    ) -> None:
        """The adapter on the base model (PeftModel.from_pretrained) and the merged weights
        (AutoModelForCausalLM.from_pretrained) decode the same tokens greedily."""
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from worker.grpo.model_paths import resolve_model_path

        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(tiny_spec(dataset, max_steps=2, checkpoint_every=2, lora={"r": 4, "alpha": 8}))
        job = api.wait_status(job_id, {"succeeded"}, timeout=240)
        assert job["progress"]["step"] == 2, stack.logs()
        local = api.download_checkpoint(api.checkpoints(job_id)[-1], tmp_path / "ckpt")
        # builtin:tiny is deterministic: the worker trained on these very base weights.
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny", tmp_path / "models"))
        adapter = PeftModel.from_pretrained(base, local).eval()
        merged = AutoModelForCausalLM.from_pretrained(local / "merged").eval()
        prompt = AutoTokenizer.from_pretrained(local / "merged")(PROMPTS[0]["prompt"], return_tensors="pt")
        with torch.no_grad():
            tokens = [
                lm.generate(**prompt, do_sample=False, max_new_tokens=8, pad_token_id=0)
                for lm in (adapter, merged)
            ]
        assert tokens[0].shape[1] > prompt["input_ids"].shape[1]
        assert torch.equal(tokens[0], tokens[1])


class TestRetentionAndDelete:
    def test_save_total_limit_keeps_three_and_delete_removes_the_files(self, api: ApiClient, stack: Stack) -> None:
        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(tiny_spec(dataset, max_steps=6, checkpoint_every=1, save_total_limit=3))
        api.wait_status(job_id, {"succeeded"}, timeout=240)

        listed = api.checkpoints(job_id)
        assert [c["step"] for c in listed] == [4, 5, 6], stack.logs()
        job_dir = stack.data_dir / "storage" / "checkpoints" / job_id
        stored = sorted(p.name for p in job_dir.iterdir() if p.name.startswith("ckpt_"))
        assert stored == sorted(c["id"] for c in listed)
        pruned = [e for e in api.events(job_id) if e["type"] == "checkpoints_pruned"]
        assert sorted(step for e in pruned for step in e["data"]["steps"]) == [1, 2, 3]

        deleted = api.http.delete(f"/v1/jobs/{job_id}")
        assert deleted.status_code == 204, deleted.text
        assert not job_dir.exists()
        assert api.http.get(f"/v1/jobs/{job_id}").status_code == 404
        assert api.http.get(f"/v1/checkpoints/{listed[0]['id']}").status_code == 404


PAUSED_JOB_STEPS = 40


class TestCancelAndPause:
    def test_cancel_running_within_one_step_and_queued_never_starts(
        self, api: ApiClient, stack: Stack
    ) -> None:
        dataset = api.upload_dataset(PROMPTS)
        running = api.submit(tiny_spec(dataset, max_steps=200, checkpoint_every=50))
        api.wait_step(running, 1)
        # The only worker is busy (prefetch 1, acks_late): this one stays queued.
        queued = api.submit(tiny_spec(dataset, max_steps=2))
        assert api.job(queued)["status"] == "queued"
        assert api.post(f"/v1/jobs/{queued}/cancel")["status"] == "cancelled"

        at_cancel = api.post(f"/v1/jobs/{running}/cancel")
        assert at_cancel["status"] == "cancelling"
        done = api.wait_status(running, {"cancelled"}, timeout=120)
        assert done["progress"]["step"] <= at_cancel["progress"]["step"] + 1

        # The cancelled job's message is delivered once the worker is free, and refused by the claim.
        wait_for(
            lambda: queued in stack.logs() and "not claimable" in stack.logs(),
            timeout=60,
            what="the cancelled job's message to be consumed",
        )
        never = api.job(queued)
        assert never["status"] == "cancelled" and never["attempt"] == 0 and never["started_at"] is None

    def test_pause_within_one_step_then_resume_finishes(self, api: ApiClient, stack: Stack) -> None:
        dataset = api.upload_dataset(PROMPTS)
        # Enough steps that the job cannot finish between the poll that sees step 1 and the pause request
        # (with 6, a loaded machine let it succeed first: a step of this spec takes tens of milliseconds).
        job_id = api.submit(tiny_spec(dataset, max_steps=PAUSED_JOB_STEPS, checkpoint_every=50))
        api.wait_step(job_id, 1)
        at_pause = api.post(f"/v1/jobs/{job_id}/pause")
        assert at_pause["pause_requested"] is True
        paused = api.wait_status(job_id, {"paused"}, timeout=120)
        paused_step = paused["progress"]["step"]
        assert paused_step <= at_pause["progress"]["step"] + 1
        # Pausing saved a checkpoint at the step it stopped after.
        assert api.checkpoints(job_id)[-1]["step"] == paused_step

        api.post(f"/v1/jobs/{job_id}/resume")
        done = api.wait_status(job_id, {"succeeded"}, timeout=240)
        assert done["attempt"] == 2
        assert api.metric_steps(job_id) == list(range(1, PAUSED_JOB_STEPS + 1))


class TestHealthGuard:
    def test_on_unhealthy_pause_pauses_with_the_finding_and_resumes(self, api: ApiClient, stack: Stack) -> None:
        """Exact match on the random tiny model earns nothing: every group is flat at reward 0 ("stuck"),
        which fires after `patience` (3) steps; with on_unhealthy=pause the job pauses there, resumable."""
        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(tiny_spec(dataset, max_steps=PAUSED_JOB_STEPS, checkpoint_every=50, on_unhealthy="pause"))
        paused = api.wait_status(job_id, {"paused"}, timeout=180)
        assert paused["progress"]["step"] == 3, stack.logs()
        health = [e for e in api.events(job_id) if e["type"] == "health"]
        assert [e["data"]["kind"] for e in health] == ["zero_variance_stuck"]
        assert health[0]["data"]["evidence"]["reward/mean"] == 0.0
        pause_event = [e for e in api.events(job_id) if e["type"] == "status" and e["data"]["to"] == "paused"][-1]
        assert "zero_variance_stuck" in pause_event["data"]["reason"]
        assert api.checkpoints(job_id)[-1]["step"] == 3  # resumable from where it stopped

        api.post(f"/v1/jobs/{job_id}/resume")
        # The condition persists, so the resumed attempt trains `patience` more steps and pauses again.
        again = api.wait_status(job_id, {"paused"}, timeout=180)
        assert again["attempt"] == 2 and again["progress"]["step"] == 6
        assert api.metric_steps(job_id) == list(range(1, 7))


class TestDuplicateDelivery:
    def test_same_message_delivered_to_two_workers_trains_once(self, api: ApiClient, stack: Stack) -> None:
        second = stack.start_worker()
        try:
            dataset = api.upload_dataset(PROMPTS)
            job_id = api.submit(tiny_spec(dataset, max_steps=3))
            sender = CeleryJobQueue(stack.broker_url)
            for _ in range(3):
                sender.send_job(job_id, queue="cpu")
            job = api.wait_status(job_id, {"succeeded"}, timeout=240)
            assert job["attempt"] == 1
            assert _status_changes(api, job_id) == ["queued", "running", "succeeded"]
            assert api.metric_steps(job_id) == [1, 2, 3]
            wait_for(
                lambda: stack.logs().count("not claimable") >= 3,
                timeout=60,
                what="the three extra copies to be refused",
            )
        finally:
            second.stop()


class TestEmbeddedDefault:
    def test_grpo_serve_alone_runs_a_job_on_sqlite_and_the_sql_broker(self) -> None:
        data_dir = private_tmp("grpo-embedded-")
        stack = Stack(database_url=f"sqlite:///{data_dir}/grpo.db", broker_url=f"sqla+sqlite:///{data_dir}/broker.db",
                      data_dir=data_dir)
        try:
            api_proc = stack.start_api(worker=True)
            wait_for(lambda: " ready." in api_proc.log(), timeout=90, what="the embedded worker")
            api = stack.make_client()
            dataset = api.upload_dataset(PROMPTS)
            job_id = api.submit(tiny_spec(dataset, max_steps=3, checkpoint_every=3))
            job = api.wait_status(job_id, {"succeeded"}, timeout=240)
            assert job["attempt"] == 1 and api.metric_steps(job_id) == [1, 2, 3], stack.logs()
            assert [c["step"] for c in api.checkpoints(job_id)] == [3]
        finally:
            stack.stop_all()
