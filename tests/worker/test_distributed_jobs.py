"""Jobs on two devices through the service, with a real API, worker (`--devices 2`), Redis and PostgreSQL:
the ranks run on CPU with gloo, one thread each. A job trains end to end; a rank killed (SIGKILL) or
stopped (SIGSTOP) mid-job ends the attempt (within the collective timeout for the stopped one) and the
job resumes from its last checkpoint, recording every step once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.job_network import ListenerWatch, job_processes, not_on, plant_rendezvous_pickles
from tests.worker.procs import ApiClient, Stack, fresh_redis_database, private_tmp, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def two_device_spec(dataset: str, **hyper: object) -> dict[str, object]:
    spec = tiny_spec(dataset, **hyper)
    spec["resources"] = {"devices": 2}
    return spec


def rank_pid(stack: Stack, rank: int) -> int | None:
    """The process of `rank` of this stack's running job. A rank forked from its launcher (worker.grpo.rank_fork)
    keeps the launcher's command line and environment and names itself `grpo-rank-N`; a fresh one's environment
    has its RANK."""
    for proc in job_processes(stack):
        try:
            if proc.name() == f"grpo-rank-{rank}":
                return proc.pid
            if "worker.rank_job" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == str(rank):
                return proc.pid
        except psutil.Error:
            continue
    return None


@pytest.fixture(scope="module")
def stack(_postgres_database: str, redis_base_url: str) -> Iterator[Stack]:
    broker = fresh_redis_database(redis_base_url)
    stack = Stack(database_url=_postgres_database, broker_url=broker, data_dir=private_tmp("grpo-dist-"))
    try:
        stack.start_api()
        stack.start_worker(devices=2)
        yield stack
    finally:
        stack.stop_all()


def assert_each_step_once(api: ApiClient, job_id: str, steps: int) -> None:
    assert api.metric_steps(job_id) == list(range(1, steps + 1))
    logged = [e["data"]["step"] for e in api.events(job_id) if e["type"] == "metrics"]
    assert logged == list(range(1, steps + 1))


class TestTwoDeviceJob:
    def test_trains_end_to_end_like_a_one_device_job(self, stack: Stack, tmp_path: Path) -> None:
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        two = api.submit(two_device_spec(dataset, max_steps=3))
        one = api.submit(tiny_spec(dataset, max_steps=3))
        assert api.job(two)["queue"] == "cpu-2" and api.job(one)["queue"] == "cpu"
        for job_id in (two, one):
            # Long bound: a broker database shared with earlier runs may hold stale messages the worker must
            # first find to be duplicates (a fresh pool process each, seconds apiece).
            assert api.wait_status(job_id, {"succeeded", "failed"}, timeout=600)["status"] == "succeeded", stack.logs()
            assert_each_step_once(api, job_id, 3)
        # The same metrics, step by step, as a one-device job reports.
        series = {job_id: api.http.get(f"/v1/jobs/{job_id}/metrics").json()["series"] for job_id in (two, one)}
        assert series[two].keys() == series[one].keys()
        checkpoint = api.checkpoints(two)[-1]
        # Consolidated weights only: the shards stay inside the service (for resuming).
        assert not any(f["path"].startswith("distributed/") for f in checkpoint["files"])
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(api.download_checkpoint(checkpoint, tmp_path / "ckpt"))
        assert sum(p.numel() for p in model.parameters()) > 0

    def test_a_two_device_job_waits_for_a_worker_with_two_devices(self, stack: Stack) -> None:
        """Routing: a job needing 3 devices goes to the cpu-3 queue, which this worker does not consume."""
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        spec = tiny_spec(dataset, max_steps=1, prompts_per_step=3)
        spec["resources"] = {"devices": 3}
        job_id = api.submit(spec)
        time.sleep(3)
        job = api.job(job_id)
        assert job["queue"] == "cpu-3" and job["status"] == "queued"
        api.post(f"/v1/jobs/{job_id}/cancel")


class TestNetworkExposure:
    """docs/security.md: a job on one node listens on loopback only, and nothing a stranger writes into its
    store is unpickled."""

    def test_listens_on_loopback_only_and_unpickles_nothing_from_its_store(self, stack: Stack) -> None:
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        marker = stack.data_dir / "pwned"
        planted: list[str] = []

        def attack(address: str, port: int) -> None:
            # What a stranger can guess: the job id (it is in the API's answers) and the attempt.
            guesses = [f"torch.rendezvous.{job_id}-{a}" for a in (1, 2)] + ["torch.rendezvous.grpo"]
            planted.extend(plant_rendezvous_pickles(address, port, marker, guesses))

        job_id = ""
        with ListenerWatch(stack, on_listener=attack) as watch:
            job_id = api.submit(two_device_spec(dataset, max_steps=3))
            job = api.wait_status(job_id, {"succeeded", "failed"}, timeout=600)
        assert job["status"] == "succeeded", stack.logs()
        print(f"listeners of the job: {sorted(watch.seen)}; keys planted: {planted}")
        assert watch.seen, "the job's store and collectives were never seen listening"
        assert not_on(watch.seen, "127.0.0.1") == []
        assert planted, "no store accepted the planted keys"
        time.sleep(1.5)  # past torchrun's monitor interval, had it been the launcher
        assert not marker.exists()


class TestRankFailure:
    @pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
    def test_rank_failure_ends_the_attempt_and_the_job_resumes(self, stack: Stack, sig: signal.Signals) -> None:
        api = stack.make_client()
        dataset = api.upload_dataset(PROMPTS)
        job_id = api.submit(two_device_spec(dataset, max_steps=8, checkpoint_every=2))
        api.wait_step(job_id, 3)
        wait_for(lambda: api.checkpoints(job_id), timeout=120, what="a registered checkpoint")
        pid = rank_pid(stack, 1)
        assert pid is not None, stack.logs()
        # The worker preloads the engine: its task's child forked the launcher (worker.spare_launcher).
        assert psutil.Process(pid).parent().name() == "grpo-launcher"
        os.kill(pid, sig)
        signalled = time.monotonic()
        failed = wait_for(
            lambda: [e for e in api.events(job_id) if e["type"] == "rank_failed"], timeout=120,
            what="the attempt to end",
        )
        ended_after = time.monotonic() - signalled
        print(f"{sig.name}: attempt ended {ended_after:.1f} s after the signal")
        if sig == signal.SIGSTOP:
            # The collective timeout (15 s here), the rest of the step and the worker's poll interval.
            assert ended_after < stack.collective_timeout_seconds + 20
        assert failed[0]["attempt"] == 1
        job = api.wait_status(job_id, {"succeeded", "failed"}, timeout=300)
        assert job["status"] == "succeeded" and job["attempt"] == 2, stack.logs()
        assert_each_step_once(api, job_id, 8)
        assert api.resume_step(job_id, attempt=2) >= 2  # from a checkpoint, not from scratch
        # No rank left behind (the stopped one was killed too; the last attempt's exit after the job ended).
        wait_for(lambda: rank_pid(stack, 1) is None, timeout=60, what="the ranks to exit")
        assert pid != rank_pid(stack, 1)
