"""The worker's Celery application, configured for long GPU jobs whose state lives in the database.

The message only wakes a worker; the job row is the truth (service/execution/lease.py). That decides the settings:

- `task_acks_late` + `task_reject_on_worker_lost`: a message is acknowledged when the task returns, so a
  worker that dies mid-job leaves its message to be redelivered rather than dropped. Redelivery (and
  Redis's visibility-timeout redelivery of a task that simply runs long) is harmless: the claim refuses a
  job another attempt holds, and the task returns quietly.
- `worker_prefetch_multiplier=1`, concurrency 1: one job per GPU, and no job waits in a busy worker's
  prefetch buffer while another worker idles.
- `worker_max_tasks_per_child=1` with the prefork pool: every job runs in a fresh child forked from a
  parent that never imports torch, so CUDA is never initialised in a process that forks, and a job's GPU
  memory is returned to the driver when its child exits. (`--pool solo` runs jobs in the main process:
  no fork at all; useful for debugging.) On CPU-only workers `worker_preload_engine` imports the engine in
  the parent instead, before any child is forked, so that jobs start without importing it each.
- Task arguments are `[job_id]` only; results are ignored (progress is written to the database).
- Queues `gpu` and `cpu`, and `gpu-N` / `cpu-N` for jobs needing N devices; a worker consumes the ones it
  is started with (`grpo worker --queues --devices`).
- The broker connection is retried forever: a Redis restart must not stop a worker (the running job does
  not need the broker; only the next pickup does).
- Redis `visibility_timeout` (settings.broker_visibility_timeout): how long a delivered, unacknowledged
  message stays hidden. Jobs may run longer than it; the redelivered copy then finds the job claimed.
- The embedded default (`sqla+sqlite:///<data_dir>/broker.db`) uses worker.embedded_broker (see there).

Soft/hard time limits bound a runaway job (prefork pool only); the lease, not the time limit, is what
detects a dead worker.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_init
from kombu import Queue

from service.execution.runtime import Settings, get_settings, prepare_worker_process, queues_for_devices
from worker.embedded_broker import TRANSPORT_PATH, split_sqla_url

RUN_JOB_TASK = "grpo.run_job"
QUEUES = ("gpu", "cpu")
SOFT_TIME_LIMIT_S = 7 * 24 * 3600
HARD_TIME_LIMIT_S = SOFT_TIME_LIMIT_S + 600


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings for `settings.broker_url` (Redis, or the embedded SQL broker)."""
    config: dict[str, Any] = {
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        # gpu, cpu, and gpu-N / cpu-N for the jobs needing N <= settings.worker_devices devices.
        "task_queues": [Queue(name) for name in queues_for_devices(list(QUEUES), settings.worker_devices)],
        "task_default_queue": "gpu",
        "task_soft_time_limit": SOFT_TIME_LIMIT_S,
        "task_time_limit": HARD_TIME_LIMIT_S,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": 1,
        "worker_max_tasks_per_child": 1,
        "worker_send_task_events": False,
        # Keep the running task when the broker connection drops (Redis restart); the lease covers it.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_connection_retry": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "broker_heartbeat": 0,
    }
    sql_url = split_sqla_url(settings.broker_url)
    if sql_url is not None:
        config["broker_url"] = sql_url
        config["broker_transport"] = TRANSPORT_PATH
    else:
        config["broker_url"] = settings.broker_url
        config["broker_transport_options"] = {"visibility_timeout": settings.broker_visibility_timeout}
    return config


@worker_init.connect
def preload_engine(**_: Any) -> None:
    """In the worker's parent, before its pool forks: the engine imported once (settings.worker_preload_engine)."""
    if get_settings().worker_preload_engine:
        # Opt-in, for CPU-only workers (see the setting): every other parent must stay free of torch.
        import worker.grpo.trainer  # noqa: F401


def create_celery_app(settings: Settings | None = None) -> Celery:
    # Job events the worker writes are announced (service.webhooks.outbox); its forked children inherit it.
    prepare_worker_process()
    app = Celery("grpo-worker", include=["worker.tasks"])
    app.conf.update(celery_config(settings or get_settings()))
    return app


# `celery -A worker.celery_app worker` and `grpo worker` both use this instance.
app = create_celery_app()
