"""Against a live `grpo serve` process: the webhook dispatcher it starts delivers signed events (with a retry
after a 500), `/metrics` is served without auth, and GRPO_LOG_JSON turns the logs into JSON lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.test_webhooks import Receiver
from tests.worker.procs import free_port, wait_for

GRPO = [sys.executable, "-c", "from cli import main; main()"]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[str, dict[str, str], Path]]:
    """`grpo serve --no-worker` on SQLite in tmp_path; yields (base URL, auth headers, log file)."""
    port = free_port()
    env = {
        **os.environ,
        "GRPO_ENV": "development",
        "GRPO_DATA_DIR": str(tmp_path / "data"),
        "GRPO_BROKER_URL": "memory://",
        "GRPO_LOG_JSON": "true",
        "GRPO_WEBHOOK_POLL_INTERVAL_S": "0.1",
        "GRPO_WEBHOOK_BACKOFF_S": "0.1",
    }
    for name in ("GRPO_DATABASE_URL", "GRPO_STORAGE_URL"):
        env.pop(name, None)
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*GRPO, "serve", "--no-worker", "--grpc-port", "0", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(base), timeout=60, what="grpo serve to answer /healthz")
        created = subprocess.run([*GRPO, "admin", "create-tenant", "acme"], env=env, capture_output=True,
                                 text=True, timeout=60, check=True)
        yield base, {"Authorization": f"Bearer {created.stdout.strip()}"}, log_path
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_live_server_delivers_signed_events_and_serves_metrics(
    live: tuple[str, dict[str, str], Path], receiver: Receiver
) -> None:
    base, headers, log_path = live
    with httpx.Client(base_url=base, headers=headers, timeout=30) as api:
        hook = api.post("/v1/webhooks", json={"url": receiver.url})
        assert hook.status_code == 201, hook.text
        receiver.secret = hook.json()["secret"]
        receiver.script = [500]
        rows = b'{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", "answer": "6"}\n'
        dataset = api.post("/v1/datasets", files={"file": ("train.jsonl", rows)})
        assert dataset.status_code == 201, dataset.text
        job = api.post("/v1/jobs", json={
            "base_model": "builtin:tiny", "train_dataset": dataset.json()["id"],
            "rewards": [{"type": "builtin", "name": "exact_match", "weight": 1.0}],
            "hyperparameters": {"max_steps": 2, "num_generations": 2, "prompts_per_step": 1},
        })
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200

        requests = receiver.wait_for(3)  # queued (500, then 200), cancelled
        metrics = httpx.get(f"{base}/metrics", timeout=10)  # no API key

    bodies = [json.loads(r["body"]) for r in requests]
    answers: dict[str, list[int]] = {}  # webhook-id -> statuses answered, in order
    for r in requests:
        answers.setdefault(r["headers"]["webhook-id"], []).append(r["answered"])
    # Two events; the one that got the 500 was re-sent with the same webhook-id and then accepted.
    assert sorted(answers.values()) == [[200], [500, 200]]
    assert all(r["verified"] is not None for r in requests)  # standardwebhooks verified each one
    assert {b["type"] for b in bodies} == {"job.queued", "job.cancelled"}
    assert all(b["data"]["job_id"] == job_id for b in bodies)

    assert metrics.status_code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.text) for s in f.samples}
    assert samples[("grpo_jobs", (("state", "cancelled"),))] == 1
    assert samples[("grpo_queue_depth", (("queue", "cpu"),))] == 0
    assert samples[("grpo_http_request_duration_seconds_count",
                    (("method", "POST"), ("route", "/v1/jobs"), ("status", "201")))] == 1
    assert samples[("grpo_webhook_deliveries_total", (("outcome", "retry"),))] >= 1
    assert samples[("grpo_webhook_deliveries_total", (("outcome", "delivered"),))] >= 2

    # GRPO_LOG_JSON: the server's own log records are JSON objects with job_id/attempt fields.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        if any("webhooks" in r["logger"] for r in records):
            break
        time.sleep(0.1)
    assert records and all({"ts", "level", "logger", "message", "job_id", "attempt"} <= set(r) for r in records)
    assert any(r["logger"] == "service.webhooks.delivery" and "HTTP 500" in r["message"] for r in records)
