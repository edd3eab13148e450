"""A job on two nodes through the service: two real workers of one device each (`grpo worker --devices 1`)
stand in for two machines, with a real API, Redis and PostgreSQL, the ranks on CPU with gloo. The worker
that claims the job invites the other (worker.nodes); their ranks meet in the store the claiming worker's
launcher serves on GRPO_WORKER_ADDRESS (loopback here).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.job_network import ListenerWatch, not_on
from tests.worker.procs import ApiClient, Stack, fresh_redis_database, private_tmp, wait_for
from tests.worker.test_distributed_jobs import assert_each_step_once, rank_pid

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def two_node_spec(dataset: str, **hyper: object) -> dict[str, object]:
    spec = tiny_spec(dataset, **hyper)
    spec["resources"] = {"devices": 2, "nodes": 2}
    return spec


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(
        database_url=_postgres_database, broker_url=broker, data_dir=private_tmp("grpo-nodes-"),
        extra_env={"GRPO_WORKER_ADDRESS": "127.0.0.1", "GRPO_NODE_JOIN_TIMEOUT_SECONDS": "120"},
    )
    try:
        stack.start_api()
        # The engine preloaded (the default), as on CPU workers: each node's launcher is forked from the task's
        # child (worker.spare_launcher).
        stack.start_worker(devices=1)
        stack.start_worker(devices=1)
        yield stack
    finally:
        stack.stop_all()


def joined(stack: Stack) -> int:
    """How many invitations a worker ran to the end."""
    return sum(p.log().count("grpo.join_job") - p.log().count("-> stale") for p in stack.procs if "worker" in p.name)


def assert_resumed_from_a_checkpoint(api: ApiClient, job_id: str) -> None:
    assert api.resume_step(job_id, attempt=2) >= 2


class TestTwoNodeJob:
    def test_trains_end_to_end_on_two_workers(self, stack: Stack, tmp_path: Path) -> None:
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(two_node_spec(dataset, max_steps=3))
        assert api.job(job_id)["queue"] == "cpu"  # one device per node
        job = api.wait_status(job_id, {"succeeded", "failed"}, timeout=600)
        assert job["status"] == "succeeded", stack.logs()
        assert_each_step_once(api, job_id, 3)
        wait_for(lambda: joined(stack) >= 1, timeout=60, what="the second worker to finish its node")
        checkpoint = api.checkpoints(job_id)[-1]
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(api.download_checkpoint(checkpoint, tmp_path / "ckpt"))
        assert sum(p.numel() for p in model.parameters()) > 0

    def test_every_socket_of_the_job_is_on_the_worker_address(self, stack: Stack) -> None:
        """GRPO_WORKER_ADDRESS is 127.0.0.1 here: the store and the collectives of both nodes bind there only."""
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        with ListenerWatch(stack) as watch:
            job_id = api.submit(two_node_spec(dataset, max_steps=2))
            job = api.wait_status(job_id, {"succeeded", "failed"}, timeout=600)
        assert job["status"] == "succeeded", stack.logs()
        print(f"listeners of the job: {sorted(watch.seen)}")
        assert len(watch.seen) >= 2, "the store and each node's collectives should have been seen"
        assert not_on(watch.seen, "127.0.0.1") == []

    def test_a_killed_rank_ends_the_attempt_and_the_job_resumes_on_both_nodes(self, stack: Stack) -> None:
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        # fsdp: the checkpoint gathers the optimiser state (no shards on two filesystems) and both nodes resume it.
        job_id = api.submit(two_node_spec(dataset, max_steps=6, checkpoint_every=2, parallelism="fsdp"))
        api.wait_step(job_id, 3, timeout=600)
        wait_for(lambda: api.checkpoints(job_id), timeout=120, what="a registered checkpoint")
        pid = rank_pid(stack, 1)
        assert pid is not None, stack.logs()
        # The worker preloads the engine: its task's child forked the launcher (worker.spare_launcher).
        assert psutil.Process(pid).parent().name() == "grpo-launcher"
        os.kill(pid, signal.SIGKILL)
        failed = wait_for(
            lambda: [e for e in api.events(job_id) if e["type"] == "rank_failed"], timeout=180,
            what="the attempt to end",
        )
        assert failed[0]["attempt"] == 1 and failed[0]["data"]["nodes"] == 2
        job = api.wait_status(job_id, {"succeeded", "failed"}, timeout=600)
        assert job["status"] == "succeeded" and job["attempt"] == 2, stack.logs()
        assert_each_step_once(api, job_id, 6)
        assert_resumed_from_a_checkpoint(api, job_id)
        # The node without rank 0 resumed from its own copy of the checkpoint rank 0 downloaded.
        assert any("built its inputs and downloaded 1 checkpoint(s)" in p.log() for p in stack.procs), stack.logs()
