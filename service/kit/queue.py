"""The task-queue boundary: how the API hands a job to the workers.

The service only *sends* tasks, by name (`grpo.run_job`, args `[job_id]`), so it never imports
the worker (and so never torch). Sends happen after the job row is committed (service.kit.db.on_commit).

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
QUEUES = ("gpu", "cpu")

log = logging.getLogger(__name__)


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
        if queue not in QUEUES:
            raise ValueError(f"unknown queue {queue!r}")
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
