"""The task-queue boundary: how the API hands a job to the workers.

The service only *sends* tasks, by name (`grpo.run_job`, args `[job_id]`), so it never imports
the worker (and so never torch). Sends happen after the job row is committed (service.kit.db.on_commit).

One queue per kind and device count: `gpu` and `cpu` for one device, `gpu-N` / `cpu-N` for jobs needing N
devices. A worker with D devices (settings.worker_devices) consumes the queues for 1 to D devices
(`queues_for_devices`), so a job only reaches a worker that has enough.

`JobQueue` is the seam tests substitute (a recording stub), either through FastAPI's
`app.dependency_overrides[get_job_queue]` or, for non-HTTP callers, `set_job_queue()`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from celery import Celery

from service.kit.config import get_settings

RUN_JOB_TASK = "grpo.run_job"
QUEUES = ("gpu", "cpu")  # the kinds of device; one queue per kind and device count
MAX_QUEUE_DEVICES = 1024

log = logging.getLogger(__name__)


def queue_name(kind: str, devices: int) -> str:
    """The queue of jobs of `kind` (gpu, cpu) needing `devices` devices."""
    if kind not in QUEUES or not 1 <= devices <= MAX_QUEUE_DEVICES:
        raise ValueError(f"no queue for {devices} {kind} devices")
    return kind if devices == 1 else f"{kind}-{devices}"


def parse_queue(name: str) -> tuple[str, int]:
    """"gpu" -> ("gpu", 1), "cpu-4" -> ("cpu", 4); ValueError for any other name."""
    kind, _, count = name.partition("-")
    devices = int(count) if count.isdigit() else (1 if not count else 0)
    if queue_name(kind, devices) != name:
        raise ValueError(f"unknown queue {name!r}")
    return kind, devices


def queues_for_devices(kinds: list[str], devices: int) -> list[str]:
    """Every queue a worker with `devices` devices of `kinds` serves: 1 to `devices` devices each."""
    return [queue_name(kind, n) for kind in kinds for n in range(1, devices + 1)]


class JobQueue(Protocol):
    def send_job(self, job_id: str, *, queue: str) -> None:
        """Send `grpo.run_job(job_id)` to `queue`. May raise if the broker is unreachable."""
        ...


class CeleryJobQueue:
    """A send-only Celery client: no result backend, no task imports."""

    def __init__(self, broker_url: str) -> None:
        self._app = Celery("grpo-api", broker=broker_url, set_as_current=False)
        self._app.conf.update(
            task_ignore_result=True,
            task_serializer="json",
            accept_content=["json"],
            broker_connection_retry_on_startup=False,
            broker_transport_options={"max_retries": 3, "interval_start": 0, "interval_step": 0.5},
        )

    def send_job(self, job_id: str, *, queue: str) -> None:
        parse_queue(queue)  # ValueError for an unknown name
        self._app.send_task(RUN_JOB_TASK, args=[job_id], queue=queue)

    @property
    def celery(self) -> Any:
        return self._app


_clients: dict[str, CeleryJobQueue] = {}
_clients_lock = threading.Lock()  # requests run in a thread pool: build one client per broker URL


def _celery_queue(broker_url: str) -> CeleryJobQueue:
    with _clients_lock:
        if broker_url not in _clients:
            _clients[broker_url] = CeleryJobQueue(broker_url)
        return _clients[broker_url]


_override: JobQueue | None = None


def set_job_queue(queue: JobQueue | None) -> None:
    """Replace the process-wide queue (tests, embedded runs); None restores the Celery client."""
    global _override
    _override = queue


def get_job_queue() -> JobQueue:
    """The queue to send jobs to (also a FastAPI dependency)."""
    if _override is not None:
        return _override
    return _celery_queue(get_settings().broker_url)


def send_job_logged(queue: JobQueue, job_id: str, queue_name: str) -> None:
    """Send, and log instead of raising when the broker is down.

    Runs after commit, when the job already exists: failing the request would tell the client the
    job was not created when it was. A job whose message is lost stays `queued` and is re-sent by
    the worker's sweeper (settings.queued_resend_seconds).
    """
    try:
        queue.send_job(job_id, queue=queue_name)
    except Exception:
        log.exception("could not enqueue job %s on %s; it stays queued until re-sent", job_id, queue_name)
