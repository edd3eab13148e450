"""The official `tinker` SDK (0.38.0, in .venv-tinker, nothing of ours imported) drives a live `grpo serve` and
`grpo primitives-worker`: a GRPO-style loop whose reward rises, save_state / load_state restoring the exact
weights, a client created from the saved state; tenants see only their own models, futures and weights; bad
input gets the SDK's error shape."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.ship.conftest import (
    GRPO,
    REPO,
    Live,
    Processes,
    clean_env,
    describe,
    free_port,
    run_cli,
    wait_http_ok,
)

pytestmark = pytest.mark.slow

TINKER_PYTHON = REPO / ".venv-tinker" / "bin" / "python"
SCRIPTS = Path(__file__).parent / "tinker_scripts"
BASE_MODEL = "builtin:tiny-instruct"


@dataclass
class Stack:
    base_url: str  # what TINKER_BASE_URL is set to
    keys: list[str]  # three tenants' keys, as the SDK takes them (tml-...)
    processes: Processes
    env: dict[str, str]
    worker: Live

    def sdk(self, script: str, key: str, **env: str) -> dict[str, object]:
        """Run a script of tinker_scripts/ in the SDK's venv; its last stdout line is JSON."""
        return self.wait(self.start_sdk(script, key, **env))

    def start_sdk(self, script: str, key: str, **env: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(TINKER_PYTHON), str(SCRIPTS / script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=SCRIPTS,
            env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "TINKER_BASE_URL": self.base_url,
                 "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0", "BASE_MODEL": BASE_MODEL, "HF_HUB_OFFLINE": "1",
                 "OMP_NUM_THREADS": "1", **env},
        )

    def wait(self, script: subprocess.Popen[str]) -> dict[str, object]:
        stdout, stderr = script.communicate(timeout=900)
        done = subprocess.CompletedProcess(script.args, script.returncode, stdout, stderr)
        assert done.returncode == 0, describe(done) + self.processes.logs()
        return json.loads(stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, instruct_model: Path) -> Iterator[Stack]:
    if not TINKER_PYTHON.exists():
        pytest.fail(f"{TINKER_PYTHON} is missing: run `make tinker-sdk` (make test does)")
    root = tmp_path_factory.mktemp("tinker")
    (root / "data" / "models").mkdir(parents=True)
    os.symlink(instruct_model, root / "data" / "models" / instruct_model.name)  # the worker finds it built
    port = free_port()
    env = clean_env(GRPO_ENV="development", GRPO_DATA_DIR=str(root / "data"), GRPO_API_PORT=str(port),
                    GRPO_GRPC_PORT="0", GRPO_PRIMITIVES_BASE_MODELS=json.dumps([BASE_MODEL]),
                    GRPO_PRIMITIVES_WORKER_STALE_SECONDS="3",
                    # `vllm` runs the module's SDK loops on the vLLM sampler (GRPO_PRIMITIVES_SAMPLER).
                    GRPO_PRIMITIVES_SAMPLER=os.environ.get("GRPO_TEST_TINKER_SAMPLER", "native"))
    processes = Processes(root)
    try:
        serve = processes.start("serve", [*GRPO, "serve", "--migrate"], env)
        wait_http_ok(f"http://127.0.0.1:{port}/readyz", serve, timeout=60)
        worker = processes.start("primitives-worker", [*GRPO, "primitives-worker", "--device", "cpu"], env)
        keys = []
        for name in ("tinker-a", "tinker-b", "tinker-c"):
            created = run_cli(env, "admin", "create-tenant", name)
            assert created.returncode == 0, describe(created)
            keys.append("tml-" + created.stdout.strip().splitlines()[-1])
        yield Stack(f"http://127.0.0.1:{port}/tinker", keys, processes, env, worker)
    finally:
        processes.stop_all()


@pytest.fixture(scope="module")
def trained(stack: Stack) -> dict[str, object]:
    """The GRPO loop of tinker_scripts/rl_loop.py, run once by the first tenant."""
    return stack.sdk("rl_loop.py", stack.keys[0], STEPS="20")


def test_the_sdk_runs_a_grpo_loop_and_round_trips_its_state(trained: dict[str, object]) -> None:
    result = trained
    assert result["capabilities"] == [BASE_MODEL]
    rewards = result["rewards"]
    assert isinstance(rewards, list) and len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"the training reward did not rise: {rewards}"
    before, after = result["accuracy"]  # type: ignore[misc]
    assert after >= before + 0.2, f"greedy accuracy on 40 fixed questions: {before} -> {after}"
    assert result["moved"] != result["before"]  # the extra step changed the weights...
    assert result["restored"] == result["before"]  # ...and load_state put back exactly the saved ones
    assert result["cloned"] == result["before"]  # as does a new client created from the saved state
    assert str(result["saved"]).startswith(f"tinker://{result['model_id']}/weights/final")


def test_three_tenants_on_one_base_each_get_a_solo_runs_results(stack: Stack) -> None:
    """The same loop (same seeds) run alone, then by three tenants at once on the one worker and base model:
    every run's rewards and final log-probs are the solo run's, bit for bit."""
    # Small groups: what is compared is each tenant's run against the solo one, not how much it learns.
    loop = {"STEPS": "3", "ONLY_TRAIN": "1", "PROMPTS": "2", "GROUP": "4"}
    solo = stack.sdk("rl_loop.py", stack.keys[0], **loop)
    scripts = [stack.start_sdk("rl_loop.py", key, **loop) for key in stack.keys]
    together = [stack.wait(script) for script in scripts]
    assert all(run == solo for run in together), (solo, together)


def test_tenants_see_only_their_own(stack: Stack) -> None:
    owner, other = stack.keys[0], stack.keys[1]
    url = stack.base_url + "/api/v1"
    with httpx.Client(timeout=60) as http:
        session = http.post(f"{url}/create_session", json={"sdk_version": "test"},
                            headers={"X-API-Key": owner}).json()["session_id"]
        created = http.post(f"{url}/create_model", headers={"X-API-Key": owner}, json={
            "session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 4}})
        request_id = created.json()["request_id"]
        done = http.post(f"{url}/retrieve_future", headers={"X-API-Key": owner}, json={"request_id": request_id})
        model_id = done.json()["model_id"]

        def as_other(path: str, body: dict[str, object]) -> httpx.Response:
            return http.post(f"{url}/{path}", headers={"X-API-Key": other}, json=body)

        foreign = [
            as_other("retrieve_future", {"request_id": request_id}),
            as_other("get_info", {"model_id": model_id}),
            as_other("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}}),
            as_other("session_heartbeat", {"session_id": session}),
            as_other("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                 "base_model": BASE_MODEL}),
        ]
        unknown = as_other("get_info", {"model_id": model_id.replace(session, "ses_01KNOWNNOTHING0000000000000")})
        assert [r.status_code for r in foreign] == [404] * len(foreign)
        assert all(r.json()["category"] == "user" and "not found" in r.json()["error"] for r in foreign)
        # A foreign id reads exactly as an unknown one: only the id in the message differs.
        assert unknown.status_code == 404 and set(unknown.json()) == set(foreign[1].json())


def test_bad_calls_get_the_sdks_errors_and_lose_nothing(stack: Stack, trained: dict[str, object]) -> None:
    report = stack.sdk("bad_input.py", stack.keys[1], FOREIGN_PATH=str(trained["saved"]))
    assert report["wrong_shape"]["type"] == "UnprocessableEntityError"  # type: ignore[index]
    assert re.search(r"data\[0\]\.loss_fn_inputs\.target_tokens: shape \[\d+\], expected \[\d+\] \(one per input token\)",
                     report["wrong_shape"]["message"])  # type: ignore[index]
    assert report["outside_vocabulary"]["type"] == "RequestFailedError"  # type: ignore[index]
    assert "outside the vocabulary" in report["outside_vocabulary"]["message"]  # type: ignore[index]
    assert report["unknown_base_model"]["type"] == "UnprocessableEntityError"  # type: ignore[index]
    for case in ("unknown_path", "foreign_path", "foreign_sampler"):
        assert report[case]["type"] == "NotFoundError", report[case]  # type: ignore[index]
        assert "not found" in report[case]["message"]  # type: ignore[index]
    assert report["still_trains"]["type"] == "none"  # type: ignore[index]


def test_calls_run_in_seq_id_order_and_a_late_one_is_refused(stack: Stack) -> None:
    key = {"X-API-Key": stack.keys[2]}
    url = stack.base_url + "/api/v1"
    with httpx.Client(timeout=60) as http:
        session = http.post(f"{url}/create_session", json={}, headers=key).json()["session_id"]
        created = http.post(f"{url}/create_model", headers=key, json={
            "session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 4}})
        model_id = http.post(f"{url}/retrieve_future", headers=key,
                             json={"request_id": created.json()["request_id"]}).json()["model_id"]

        def step(seq_id: int) -> httpx.Response:
            return http.post(f"{url}/optim_step", headers=key,
                             json={"model_id": model_id, "seq_id": seq_id, "adam_params": {}})

        second = step(2)  # arrives first: waits for 1
        first = step(1)
        assert step(2).json() == second.json()  # a resent seq_id is the same request
        results = [http.post(f"{url}/retrieve_future", headers=key, json=r.json()).json() for r in (first, second)]
        assert all("metrics" in r for r in results), results
        late = step(1)  # already ran: the same request, not a new one
        assert late.json() == first.json()
        stale = http.post(f"{url}/save_weights", headers=key, json={"model_id": model_id, "seq_id": 3, "path": "x"})
        assert http.post(f"{url}/retrieve_future", headers=key, json=stale.json()).json()["path"].endswith("/x")
        refused = http.post(f"{url}/optim_step", headers=key,
                            json={"model_id": model_id, "seq_id": 0, "adam_params": {}})
        assert refused.status_code == 422 and "seq_id" in refused.json()["error"]


def test_a_killed_worker_fails_its_calls_as_retryable_and_the_client_resumes(stack: Stack) -> None:
    """Last in this module: it replaces the stack's worker."""
    key = {"X-API-Key": stack.keys[1]}
    url = stack.base_url + "/api/v1"
    with httpx.Client(timeout=60) as http:

        def result(response: httpx.Response) -> dict[str, object]:
            assert response.status_code == 200, response.text
            return http.post(f"{url}/retrieve_future", headers=key, json=response.json()).json()  # type: ignore[no-any-return]

        session = http.post(f"{url}/create_session", json={}, headers=key).json()["session_id"]
        model_id = result(http.post(f"{url}/create_model", headers=key, json={
            "session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 4}}))["model_id"]
        saved = result(http.post(f"{url}/save_weights", headers=key,
                                 json={"model_id": model_id, "seq_id": 1, "path": "before-crash"}))["path"]

        stack.worker.popen.kill()  # SIGKILL: no goodbye, its heartbeats just stop
        stack.worker.popen.wait()
        stranded = http.post(f"{url}/optim_step", headers=key,
                             json={"model_id": model_id, "seq_id": 2, "adam_params": {}})
        stack.worker = stack.processes.start("primitives-worker-2", [*GRPO, "primitives-worker"], stack.env)
        outcome = result(stranded)
        while outcome.get("type") == "try_again":
            outcome = result(stranded)
        assert outcome["category"] == "server" and "load_weights" in str(outcome["error"]), outcome

        loaded = result(http.post(f"{url}/load_weights", headers=key, json={
            "model_id": model_id, "seq_id": 3, "path": saved, "optimizer": True}))
        assert loaded["path"] == saved
        stepped = result(http.post(f"{url}/optim_step", headers=key,
                                   json={"model_id": model_id, "seq_id": 4, "adam_params": {}}))
        assert "metrics" in stepped, stepped
