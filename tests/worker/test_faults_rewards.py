"""Reward endpoint faults as the job sees them, through real processes: `grpo serve`
with its embedded worker, a real signed reward server on loopback with injected faults.

- 500s and timeouts are retried: the job succeeds and the retries are job events; a flaky endpoint (30 % 5xx,
  10 % timeouts, at random) never pauses a 40-step job, even when requests exhaust their attempts;
- a permanent 400 fails the job with a clear code; an invalid response fails it with
  `reward_endpoint_invalid_response`; metrics and events recorded before stay;
- an endpoint that stays down pauses the job (`reward_endpoint_unavailable`); after it recovers,
  `POST /resume` finishes the job from its last checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import ApiClient, Stack, private_tmp, wait_for
from tests.worker.reward_servers import Fault, RewardServer, new_secret, running
from worker.reward_server import RewardRequest

pytestmark = [pytest.mark.slow]


class Switchboard:
    """The reward server's fault plan, switchable by the test while jobs run."""

    def __init__(self) -> None:
        self.mode = "ok"

    def __call__(self, number: int, request: RewardRequest) -> Fault | None:
        if self.mode == "flaky":  # about 30% 500s, some timeouts (the function's timeout is 1 s)
            if number % 3 == 1:
                return Fault(status=500)
            if number % 7 == 3:
                return Fault(delay_s=1.5)
        if self.mode == "bad_request":
            return Fault(status=400, body=b'{"error": "unknown field"}')
        if self.mode == "wrong_length":
            return Fault(body=b'{"rewards": [1.0]}')
        if self.mode == "down":
            return Fault(status=503)
        if self.mode == "down_from_step_2" and request.step >= 2:
            # Goes down at a fixed step, whatever the speed of the job (switching by hand after step 1 raced a
            # fast job to its end).
            return Fault(status=503)
        return None


@pytest.fixture(scope="module")
def plan() -> Switchboard:
    return Switchboard()


@pytest.fixture(scope="module")
def reward_server(plan: Switchboard) -> Iterator[RewardServer]:
    with running(RewardServer(new_secret(), faults=plan)) as server:
        yield server


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    data_dir = private_tmp("grpo-reward-faults-")
    # CPU only: the embedded worker imports the engine once, not each job's (and resumed attempt's) child again.
    stack = Stack(database_url=f"sqlite:///{data_dir}/grpo.db", broker_url=f"sqla+sqlite:///{data_dir}/broker.db",
                  data_dir=data_dir, extra_env={"GRPO_WORKER_PRELOAD_ENGINE": "true"})
    try:
        api_proc = stack.start_api(worker=True)
        wait_for(lambda: " ready." in api_proc.log(), timeout=90, what="the embedded worker")
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def api(stack: Stack) -> ApiClient:
    return stack.make_client()


@pytest.fixture(scope="module")
def judge(api: ApiClient, reward_server: RewardServer) -> str:
    """The reward server registered as a reward function (1 s timeout); its id."""
    registered = api.http.post("/v1/reward-functions", json={
        "name": "judge", "url": reward_server.url, "timeout_s": 1.0, "max_batch_size": 4, "max_concurrency": 2,
    })
    assert registered.status_code == 201, registered.text
    reward_server.secret = registered.json()["signing_secret"]
    return str(registered.json()["id"])


def _spec(api: ApiClient, judge: str, **hyper: Any) -> dict[str, Any]:
    spec = tiny_spec(api.upload_dataset(PROMPTS), **hyper)
    spec["rewards"] = [{"type": "remote", "reward_function_id": judge}]
    return spec


def test_flaky_endpoint_is_retried_and_the_job_succeeds(api: ApiClient, judge: str, plan: Switchboard,
                                                        reward_server: RewardServer) -> None:
    plan.mode = "flaky"
    try:
        job_id = api.submit(_spec(api, judge, max_steps=3))
        job = api.wait_status(job_id, {"succeeded", "failed", "paused"}, timeout=300)
    finally:
        plan.mode = "ok"
    assert job["status"] == "succeeded", job
    retries = [e for e in api.events(job_id) if e["type"] == "reward_retry"]
    assert retries and any("500" in e["message"] for e in retries)
    assert reward_server.rejected == []  # every request carried a valid signature


@pytest.mark.parametrize("policy", [
    # The defaults (5 attempts, circuit after 3 exhausted requests in a row).
    {},
    # Two attempts per request: about one request in six exhausts them (the old policy paused the job on the
    # first), so resends certainly happen; five such requests in a row would open the circuit.
    {"max_attempts": 2, "breaker_threshold": 5},
], ids=["default-policy", "two-attempts"])
def test_flaky_endpoint_does_not_pause_a_40_step_job(api: ApiClient, policy: dict[str, int]) -> None:
    rng = random.Random(16)

    def flaky(number: int, request: RewardRequest) -> Fault | None:
        draw = rng.random()
        if draw < 0.3:
            return Fault(status=503)
        return Fault(delay_s=1.0) if draw < 0.4 else None  # beyond the 0.5 s timeout

    with running(RewardServer(new_secret(), faults=flaky)) as server:
        registered = api.http.post("/v1/reward-functions", json={
            "name": "flaky", "url": server.url, "timeout_s": 0.5, "max_batch_size": 4, "backoff_s": 0.05, **policy,
        })
        assert registered.status_code == 201, registered.text
        server.secret = registered.json()["signing_secret"]
        spec = tiny_spec(api.upload_dataset(PROMPTS), max_steps=40, checkpoint_every=10, log_completions_every=10)
        spec["rewards"] = [{"type": "remote", "reward_function_id": registered.json()["id"]}]
        job_id = api.submit(spec)
        job = api.wait_status(job_id, {"succeeded", "failed", "paused"}, timeout=600)
    assert job["status"] == "succeeded", job
    assert job["attempt"] == 1  # never paused and resumed
    events = api.events(job_id)
    assert not [e for e in events if e["type"] == "reward_endpoint_unavailable"]
    retries = [e for e in events if e["type"] == "reward_retry"]
    assert retries
    if policy:
        assert any("sending again" in e["message"] for e in retries)  # some request did exhaust its attempts
    assert api.metric_steps(job_id) == list(range(1, 41))
    assert server.rejected == []


def test_unanswered_completions_abstain_at_the_step_deadline(api: ApiClient) -> None:
    # The first prompt's request of every step fails, the second's succeeds: the circuit keeps closing, and at
    # the 1 s deadline the first prompt's completions abstain (half the step, within max_abstain_fraction).
    failing = lambda number, request: Fault(status=500) if request.items[0].group_id == 0 else None  # noqa: E731
    with running(RewardServer(new_secret(), faults=failing)) as server:
        registered = api.http.post("/v1/reward-functions", json={
            "name": "half", "url": server.url, "timeout_s": 0.5, "max_batch_size": 2, "max_attempts": 1,
            "backoff_s": 0.3, "breaker_threshold": 20, "step_deadline_s": 1, "max_abstain_fraction": 0.5,
        })
        assert registered.status_code == 201, registered.text
        server.secret = registered.json()["signing_secret"]
        spec = tiny_spec(api.upload_dataset(PROMPTS), max_steps=3)
        spec["rewards"] = [{"type": "remote", "reward_function_id": registered.json()["id"]}]
        job_id = api.submit(spec)
        job = api.wait_status(job_id, {"succeeded", "failed", "paused"}, timeout=300)
    assert job["status"] == "succeeded", job
    degraded = [e for e in api.events(job_id) if e["type"] == "reward_degraded"]
    assert [e["data"]["step"] for e in degraded] == [1, 2, 3]
    assert all((e["data"]["abstained"], e["data"]["items"]) == (2, 4) for e in degraded)
    assert "HTTP 500" in degraded[0]["message"]


@pytest.mark.parametrize(("mode", "code"), [("bad_request", "reward_endpoint_http_error"),
                                            ("wrong_length", "reward_endpoint_invalid_response")])
def test_permanent_errors_fail_the_job_and_keep_its_history(api: ApiClient, judge: str, plan: Switchboard, mode: str,
                                                            code: str) -> None:
    job_id = api.submit(_spec(api, judge, max_steps=50, checkpoint_every=1))
    api.wait_step(job_id, 1)
    plan.mode = mode
    try:
        job = api.wait_status(job_id, {"failed"}, timeout=180)
    finally:
        plan.mode = "ok"
    assert job["error"]["code"] == code
    assert "remote:" in job["error"]["message"]  # names the endpoint
    assert api.metric_steps(job_id)[0] == 1 and api.checkpoints(job_id)


def test_endpoint_down_pauses_then_resume_finishes(api: ApiClient, judge: str, plan: Switchboard) -> None:
    plan.mode = "down_from_step_2"
    try:
        job_id = api.submit(_spec(api, judge, max_steps=4, checkpoint_every=1))
        paused = api.wait_status(job_id, {"paused"}, timeout=240)
    finally:
        plan.mode = "ok"
    unavailable = [e for e in api.events(job_id) if e["type"] == "reward_endpoint_unavailable"]
    assert len(unavailable) == 1 and "circuit open" in unavailable[0]["message"]
    stopped_at = paused["progress"]["step"]
    api.post(f"/v1/jobs/{job_id}/resume")
    done = api.wait_status(job_id, {"succeeded"}, timeout=240)
    assert done["attempt"] == 2
    assert api.metric_steps(job_id) == [1, 2, 3, 4]
    assert stopped_at >= 1


def _evaluation(api: ApiClient, judge: str, rows: int) -> str:
    spec = {"model": "builtin:tiny", "dataset": api.upload_dataset((PROMPTS * rows)[:rows]), "samples_per_item": 2,
            "max_tokens": 4, "rewards": [{"type": "remote", "reward_function_id": judge}]}
    response = api.http.post("/v1/evaluations", json=spec)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_endpoint_down_pauses_an_evaluation_then_resume_finishes_it(
    api: ApiClient, judge: str, plan: Switchboard
) -> None:
    """An evaluation scores 16 items a batch (2 samples each); the endpoint fails from the second batch on
    (reward requests carry the batch's first item index as their step)."""
    plan.mode = "down_from_step_2"
    try:
        evaluation = _evaluation(api, judge, 48)
        api.wait_status(evaluation, {"paused"}, timeout=240)
    finally:
        plan.mode = "ok"
    paused = api.http.get(f"/v1/evaluations/{evaluation}").json()
    assert paused["progress"]["items_done"] == 16 and paused["results"] is None, paused
    assert [e["type"] for e in api.events(evaluation)].count("reward_endpoint_unavailable") == 1
    resumed = api.http.post(f"/v1/evaluations/{evaluation}/resume")
    assert resumed.status_code == 200, resumed.text
    api.wait_status(evaluation, {"succeeded"}, timeout=240)
    done = api.http.get(f"/v1/evaluations/{evaluation}").json()
    assert done["attempt"] == 2 and done["results"]["items"] == 48
    assert api.resume_step(evaluation, attempt=2) == 16  # continued after the recorded batch, not from scratch
    indices = [i["index"] for i in api.http.get(f"/v1/evaluations/{evaluation}/items", params={"limit": 100}).json()["data"]]
    assert indices == list(range(48))


def test_an_invalid_answer_fails_an_evaluation_with_its_code(api: ApiClient, judge: str, plan: Switchboard) -> None:
    plan.mode = "wrong_length"
    try:
        evaluation = _evaluation(api, judge, 6)
        api.wait_status(evaluation, {"failed"}, timeout=240)
    finally:
        plan.mode = "ok"
    failed = api.http.get(f"/v1/evaluations/{evaluation}").json()
    assert failed["error"]["code"] == "reward_endpoint_invalid_response" and "remote:" in failed["error"]["message"]
