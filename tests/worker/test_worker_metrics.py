"""Worker /metrics: series recorded in forked job processes are served by the parent (prefork pool)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from worker import metrics as worker_metrics

# What `grpo worker` does before the pool forks (start_for_celery_worker), then one "job" in a forked
# child recording what worker.runner records. The parent serves the aggregate until stdin closes.
SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys
    from worker import metrics as wm

    port = wm.start_for_celery_worker(0, sys.argv[1], "127.0.0.1")

    def job() -> None:
        for step_s in (0.5, 1.5):
            wm.observe_step({"time/step_s": step_s, "tokens_per_s": 123.0, "time/reward_s": 0.02, "loss": 1.0})
        wm.reward_retry("rf_1", "HTTP 503")
        wm.reward_retry("rf_1", "timed out (ReadTimeout)")
        wm.reward_error("rf_1", "reward_endpoint_unavailable")

    child = multiprocessing.get_context("fork").Process(target=job)
    child.start()
    child.join()
    print(port, flush=True)
    sys.stdin.read()
    """
)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_forked_job_process_series_are_served_by_the_parent(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        samples = parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)
    assert samples[("grpo_worker_steps_total", ())] == 2
    assert samples[("grpo_worker_step_seconds_count", ())] == 2
    assert samples[("grpo_worker_step_seconds_sum", ())] == 2.0
    assert samples[("grpo_worker_step_seconds_bucket", (("le", "1.0"),))] == 1
    assert samples[("grpo_worker_tokens_per_second", ())] == 123.0
    assert samples[("grpo_worker_reward_seconds_count", ())] == 2
    assert samples[("grpo_worker_reward_endpoint_retries_total", (("reason", "HTTP 503"), ("source", "rf_1")))] == 1
    assert samples[("grpo_worker_reward_endpoint_retries_total", (("reason", "timed_out"), ("source", "rf_1")))] == 1
    assert samples[
        ("grpo_worker_reward_endpoint_errors_total", (("code", "reward_endpoint_unavailable"), ("source", "rf_1")))
    ] == 1


def test_in_process_recording_without_the_server() -> None:
    before = REGISTRY.get_sample_value("grpo_worker_steps_total") or 0.0
    worker_metrics.observe_step({"time/step_s": 0.25, "tokens_per_s": 50.0})
    worker_metrics.observe_step({"loss": float("nan")})  # a step without timings still counts
    assert REGISTRY.get_sample_value("grpo_worker_steps_total") == before + 2
    assert REGISTRY.get_sample_value("grpo_worker_tokens_per_second") == 50.0


def test_usage_counters_by_tenant() -> None:
    from service.usage.service import StepUsageIn

    def value(name: str, tenant: str) -> float:
        return REGISTRY.get_sample_value(f"grpo_worker_usage_{name}_total", {"tenant": tenant}) or 0.0

    before = {name: value(name, "ten_a") for name in worker_metrics.USAGE_SERIES}
    usage = StepUsageIn(tokens_generated=30, tokens_trained=90, reward_calls=8, device_seconds=1.25, completions=8,
                        completion_capacity=64, num_iterations=1, parameters=10)
    worker_metrics.observe_usage("ten_a", usage)
    worker_metrics.observe_usage("ten_a", usage)
    worker_metrics.observe_usage("ten_b", usage)
    assert {name: value(name, "ten_a") - before[name] for name in worker_metrics.USAGE_SERIES} == {
        "tokens_generated": 60, "tokens_trained": 180, "reward_calls": 16, "device_seconds": 2.5
    }
    assert value("tokens_generated", "ten_b") >= 30


def test_reason_labels_stay_bounded() -> None:
    assert worker_metrics._reason_class("HTTP 503") == "HTTP 503"
    assert worker_metrics._reason_class("connection failed (ConnectError: [Errno 111] refused)") == "connection_failed"
    assert worker_metrics._reason_class("something unexpected: 0x1234") == "other"


class _FakeCuda:
    """Stands in for torch.cuda on this CPU-only machine (pure logic: which values go where)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 2

    @staticmethod
    def memory_allocated(index: int) -> int:
        return 1000 + index

    @staticmethod
    def memory_reserved(index: int) -> int:
        return 2000 + index

    @staticmethod
    def max_memory_allocated(index: int) -> int:
        return 3000 + index


def test_gpu_memory_per_device_when_cuda_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=_FakeCuda()))
    worker_metrics.observe_step({"time/step_s": 0.1})
    for device in ("0", "1"):
        offset = int(device)
        for kind, base in (("allocated", 1000), ("reserved", 2000), ("max_allocated", 3000)):
            value = REGISTRY.get_sample_value("grpo_worker_gpu_memory_bytes", {"device": device, "kind": kind})
            assert value == base + offset


def test_the_metrics_server_listens_on_loopback_unless_configured() -> None:
    """A worker's listener never binds every interface by default (GRPO_WORKER_METRICS_HOST opens it)."""
    port = worker_metrics.start_metrics_server(0)
    listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.laddr and c.laddr.port == port]
    assert listening and all(address.ip == "127.0.0.1" for address in listening)
