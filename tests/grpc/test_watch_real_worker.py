"""WatchJob on a job trained by a real worker: `grpo serve` (REST + gRPC + embedded Celery worker, SQLite,
embedded broker) trains `builtin:tiny`; the stream delivers every step's metrics in order, ends with the terminal
state, and a client that drops mid-stream and reconnects with `from_step` sees no gap and no duplicate."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from contract.gen.grpo.v1 import jobs_pb2, jobs_pb2_grpc
from tests.grpc.helpers import bearer
from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import ApiClient, Stack, free_port, private_tmp

pytestmark = [pytest.mark.slow]
STEPS = 5


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    data_dir = private_tmp("grpo-watch-")
    stack = Stack(database_url=f"sqlite:///{data_dir}/grpo.db", broker_url="", data_dir=data_dir)
    stack.grpc_port = free_port()
    try:
        stack.start_api(worker=True)
        yield stack
    finally:
        stack.stop_all()


def _watch(
    stub: jobs_pb2_grpc.JobServiceStub, key: str, job_id: str, from_step: int, stop_after_step: int | None = None
) -> list[jobs_pb2.WatchJobResponse]:
    received: list[jobs_pb2.WatchJobResponse] = []
    call = stub.WatchJob(
        jobs_pb2.WatchJobRequest(job_id=job_id, from_step=from_step), metadata=bearer(key), timeout=300
    )
    for message in call:
        received.append(message)
        if stop_after_step is not None and message.WhichOneof("event") == "metrics":
            if message.metrics.step == stop_after_step:
                call.cancel()  # the client goes away mid-stream
                break
    return received


def _steps(messages: list[jobs_pb2.WatchJobResponse]) -> list[int]:
    return [m.metrics.step for m in messages if m.WhichOneof("event") == "metrics"]


def test_watch_streams_a_real_job_and_resumes_from_step(stack: Stack) -> None:
    api: ApiClient = stack.make_client()
    key = api.http.headers["Authorization"].removeprefix("Bearer ")
    job_id = api.submit(tiny_spec(api.upload_dataset(PROMPTS), max_steps=STEPS, checkpoint_every=2))

    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        first = _watch(stub, key, job_id, from_step=0, stop_after_step=2)
        rest = _watch(stub, key, job_id, from_step=3)

    assert _steps(first) == [1, 2], stack.logs()
    assert _steps(rest) == [3, 4, 5], stack.logs()  # no gap, no duplicate
    assert all("loss" in m.metrics.values for m in rest if m.WhichOneof("event") == "metrics")
    assert rest[-1].WhichOneof("event") == "job"
    assert rest[-1].job.state == jobs_pb2.JOB_STATE_SUCCEEDED
    # The first client left right after step 2's metrics, before that step's checkpoint event; resuming from
    # step 3 rightly skips it.
    assert [m.checkpoint.step for m in rest if m.WhichOneof("event") == "checkpoint"] == [4, 5]
    # The stream agrees with what the REST API recorded.
    assert api.metric_steps(job_id) == [1, 2, 3, 4, 5]
