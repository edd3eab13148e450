"""Worker-side Prometheus series, served by `grpo worker` on GRPO_WORKER_METRICS_PORT (0 = off).

Series (all prefixed `grpo_worker_`):

- `step_seconds` (histogram): wall time of one optimiser step (the engine's `time/step_s`);
- `tokens_per_second` (gauge): generated tokens per second of the latest step (`tokens_per_s`);
- `steps_total` (counter): steps trained;
- `reward_seconds` (histogram): time spent scoring one step, all reward sources (`time/reward_s`);
- `reward_endpoint_retries_total{source, reason}` (counter): failed remote reward calls that were
  retried (from the reward client's `on_retry` callback);
- `reward_endpoint_errors_total{source, code}` (counter): reward failures that stopped a job
  (`reward_endpoint_unavailable` pauses it, other codes fail it);
- `gpu_memory_bytes{device, kind}` (gauge, CUDA only): allocated / reserved / peak allocated;
- `usage_tokens_generated_total{tenant}`, `usage_tokens_trained_total{tenant}`, `usage_reward_calls_total{tenant}`,
  `usage_device_seconds_total{tenant}` (counters): each recorded step's usage (service.usage). They count work
  done, a step re-run after a crash included; `GET /v1/usage` counts each step once.

Celery's prefork pool runs every job in a fresh child process, so a child's metrics must reach the parent
that serves /metrics: `prepare_multiprocess()` (called by `grpo worker` before the pool forks) points
prometheus_client at a per-worker directory (its multiprocess mode), and the server aggregates the files
of every child. With `--pool solo`, or without the server, the same calls record in-process.

Recording never raises into training: a metrics problem is logged, not fatal. torch is only looked at if
the job's process already imported it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.execution.reporting import StepUsageIn

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
USAGE_SERIES = {
    "tokens_generated": "Completion tokens generated, by tenant.",
    "tokens_trained": "Tokens through the policy's forward and backward, by tenant.",
    "reward_calls": "Completions scored (once per reward source), by tenant.",
    "device_seconds": "Device-seconds used by training steps, by tenant.",
}
REWARD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class _Series:
    step_seconds: Any
    tokens_per_second: Any
    steps: Any
    reward_seconds: Any
    reward_retries: Any
    reward_errors: Any
    gpu_memory: Any
    usage: dict[str, Any]


@lru_cache
def _series() -> _Series:
    """Created on first use (in the job's process), after prepare_multiprocess chose the storage."""
    # prometheus_client picks its value storage when first imported: after prepare_multiprocess has set
    # PROMETHEUS_MULTIPROC_DIR in a worker with a metrics port.
    from prometheus_client import Counter, Gauge, Histogram

    return _Series(
        step_seconds=Histogram("grpo_worker_step_seconds", "Wall time of one optimiser step.",
                               buckets=STEP_BUCKETS),
        tokens_per_second=Gauge("grpo_worker_tokens_per_second", "Generated tokens per second (latest step).",
                                multiprocess_mode="mostrecent"),
        steps=Counter("grpo_worker_steps", "Optimiser steps trained."),
        reward_seconds=Histogram("grpo_worker_reward_seconds",
                                 "Time spent scoring one step's completions (all reward sources).",
                                 buckets=REWARD_BUCKETS),
        reward_retries=Counter("grpo_worker_reward_endpoint_retries",
                               "Failed remote reward calls that were retried.", ["source", "reason"]),
        reward_errors=Counter("grpo_worker_reward_endpoint_errors",
                              "Reward failures that paused or failed a job.", ["source", "code"]),
        gpu_memory=Gauge("grpo_worker_gpu_memory_bytes", "CUDA memory of the job's process.",
                         ["device", "kind"], multiprocess_mode="livemostrecent"),
        usage={
            name: Counter(f"grpo_worker_usage_{name}", help_text, ["tenant"])
            for name, help_text in USAGE_SERIES.items()
        },
    )


# --- set-up (grpo worker) ---------------------------------------------------------------------------


def prepare_multiprocess(data_dir: str) -> Path:
    """Use prometheus_client's multiprocess mode with a fresh directory for this worker (call before forking)."""
    root = Path(data_dir).resolve() / "worker-metrics"
    path = root / str(os.getpid())
    shutil.rmtree(path, ignore_errors=True)  # files of a previous process with this pid would be summed in
    _remove_dead_workers(root)
    path.mkdir(parents=True)
    os.environ[MULTIPROC_ENV] = str(path)
    if "prometheus_client" in sys.modules:
        # The value class is chosen when prometheus_client is imported; choose again now that the
        # directory is set (metrics are created after this, see _series()).
        from prometheus_client import values

        values.ValueClass = values.get_value_class()
    return path


def _remove_dead_workers(root: Path) -> None:
    """Directories left by workers that exited without cleaning up (SIGKILL, os._exit)."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            os.kill(int(entry.name), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics (every child's series when in multiprocess mode) from a daemon thread.

    Returns the bound port (`port=0` picks a free one).
    """
    # prometheus_client picks its value storage when first imported: after prepare_multiprocess has set
    # PROMETHEUS_MULTIPROC_DIR in a worker with a metrics port.
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    registry = REGISTRY
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client.multiprocess import (
            MultiProcessCollector,  # as above: after the storage is chosen
        )

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    server, _thread = start_http_server(port, addr, registry=registry)
    bound = int(server.server_address[1])
    log.info("worker metrics on http://%s:%d/metrics", addr, bound)
    return bound


def mark_process_dead(pid: int) -> None:
    """Drop a finished child's live gauges (GPU memory) from the aggregate."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess  # as in _series: after the storage is chosen

        multiprocess.mark_process_dead(pid)


# --- hooks (worker.runner) --------------------------------------------------------------------------


def observe_step(metrics: Mapping[str, float]) -> None:
    """Record one training step from the engine's metrics dict."""
    try:
        series = _series()
        series.steps.inc()
        if (step_s := metrics.get("time/step_s")) is not None:
            series.step_seconds.observe(float(step_s))
        if (tokens := metrics.get("tokens_per_s")) is not None:
            series.tokens_per_second.set(float(tokens))
        if (reward_s := metrics.get("time/reward_s")) is not None:
            series.reward_seconds.observe(float(reward_s))
        _observe_gpu_memory(series)
    except Exception:
        log.warning("worker metrics: could not record a step", exc_info=True)


def observe_usage(tenant_id: str, usage: StepUsageIn) -> None:
    """Count one recorded step's usage for its tenant."""
    try:
        series = _series().usage
        series["tokens_generated"].labels(tenant_id).inc(usage.tokens_generated)
        series["tokens_trained"].labels(tenant_id).inc(usage.tokens_trained)
        series["reward_calls"].labels(tenant_id).inc(usage.reward_calls)
        series["device_seconds"].labels(tenant_id).inc(usage.device_seconds)
    except Exception:
        log.warning("worker metrics: could not record usage", exc_info=True)


def reward_retry(source: str, reason: str) -> None:
    """A remote reward call failed and will be retried (`reason` like "HTTP 503", "timed out (...)")."""
    try:
        _series().reward_retries.labels(source, _reason_class(reason)).inc()
    except Exception:
        log.warning("worker metrics: could not record a reward retry", exc_info=True)


def reward_error(source: str, code: str) -> None:
    """A reward failure stopped the job (`code`: reward_endpoint_unavailable, ..._invalid_response...)."""
    try:
        _series().reward_errors.labels(source, code).inc()
    except Exception:
        log.warning("worker metrics: could not record a reward error", exc_info=True)


def _reason_class(reason: str) -> str:
    """Bounded label values: "HTTP 503" stays, free text (timeouts, connection errors) is reduced to a kind."""
    if reason.startswith("HTTP "):
        return reason[:8]
    for kind in ("timed out", "connection failed", "no complete answer"):
        if reason.startswith(kind):
            return kind.replace(" ", "_")
    return "other"


def _observe_gpu_memory(series: _Series) -> None:
    torch = sys.modules.get("torch")  # never import torch here: only a job process that uses it has it
    if torch is None or not torch.cuda.is_available():
        return
    for index in range(torch.cuda.device_count()):
        device = str(index)
        series.gpu_memory.labels(device, "allocated").set(torch.cuda.memory_allocated(index))
        series.gpu_memory.labels(device, "reserved").set(torch.cuda.memory_reserved(index))
        series.gpu_memory.labels(device, "max_allocated").set(torch.cuda.max_memory_allocated(index))


def start_for_celery_worker(port: int, data_dir: str, addr: str = "127.0.0.1") -> int:
    """`grpo worker` with a metrics port: multiprocess storage, the server, and child clean-up.

    Returns the bound port."""
    from celery.signals import worker_process_shutdown  # a Celery worker's only: ranks import this module too

    directory = prepare_multiprocess(data_dir)
    owner = os.getpid()

    @atexit.register
    def _remove_directory() -> None:
        if os.getpid() == owner:  # forked children inherit atexit handlers; only the parent owns it
            shutil.rmtree(directory, ignore_errors=True)

    _series()  # the unlabelled series exist (at 0) before the first job reports
    bound = start_metrics_server(port, addr)

    @worker_process_shutdown.connect(weak=False)
    def _child_exited(pid: int | None = None, **_kwargs: Any) -> None:
        mark_process_dead(pid or os.getpid())

    return bound
