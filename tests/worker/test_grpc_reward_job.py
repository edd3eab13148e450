"""A job whose reward is a gRPC endpoint trains to completion.

Real processes: `grpo serve` with its embedded worker on SQLite, the engine on `builtin:tiny`, and a real
gRPC reward server on loopback that verifies the Standard Webhooks signature of every call (metadata over
the serialised request). The first call is refused with UNAVAILABLE so the retry shows up as a job event.
"""

from __future__ import annotations

import grpc
import pytest

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.grpc_reward_servers import GrpcFault, GrpcRewardServer, running_grpc
from tests.worker.procs import Stack, private_tmp, wait_for
from tests.worker.reward_servers import new_secret

pytestmark = [pytest.mark.slow]


def test_job_with_a_grpc_reward_endpoint_succeeds_with_verified_signatures() -> None:
    data_dir = private_tmp("grpo-grpc-reward-")
    stack = Stack(
        database_url=f"sqlite:///{data_dir}/grpo.db", broker_url=f"sqla+sqlite:///{data_dir}/broker.db", data_dir=data_dir
    )
    first_fails = lambda n, r: GrpcFault(status=grpc.StatusCode.UNAVAILABLE) if n == 1 else None  # noqa: E731
    with running_grpc(GrpcRewardServer(new_secret(), faults=first_fails)) as server:
        try:
            api_proc = stack.start_api(worker=True)
            wait_for(lambda: " ready." in api_proc.log(), timeout=90, what="the embedded worker")
            api = stack.make_client()
            registered = api.http.post("/v1/reward-functions", json={"name": "grpc-judge", "url": server.url})
            assert registered.status_code == 201, registered.text
            rf = registered.json()
            server.secret = rf["signing_secret"]

            spec = tiny_spec(api.upload_dataset(PROMPTS), max_steps=3, checkpoint_every=3)
            spec["rewards"] = [{"type": "remote", "reward_function_id": rf["id"], "weight": 1.0}]
            job_id = api.submit(spec)
            job = api.wait_status(job_id, {"succeeded", "failed", "paused"}, timeout=240)
            assert job["status"] == "succeeded", (job, stack.logs())
            assert api.metric_steps(job_id) == [1, 2, 3]
            retries = [e for e in api.events(job_id) if e["type"] == "reward_retry"]
        finally:
            stack.stop_all()
    assert server.rejected == []  # every call carried a valid signature
    assert {call.request.job_id for call in server.seen} == {job_id}
    assert {call.request.reward_function_id for call in server.seen} == {rf["id"]}
    steps = {call.request.step for call in server.seen}
    assert steps and steps <= {0, 1, 2, 3}  # a step whose completions were all cached sends nothing
    assert len(retries) == 1 and "gRPC UNAVAILABLE" in retries[0]["message"]
