"""What a worker process uses of the service's infrastructure, named in one place: the settings, the queue names,
storage and the keys of a job's files, the log context of a job, and the set-up of a worker process.

These are the service's own objects (one Settings, one Storage), not copies: a worker reads the same
configuration and writes the same storage layout as the API.
"""

from __future__ import annotations

# Every table, so that foreign keys to tables of domains the worker never reads (tenants) resolve when the
# claim and the progress reports flush.
from service import models as _all_models  # noqa: F401
from service.kit.config import Settings, get_settings
from service.kit.db import end_idle_transactions_after
from service.kit.queue import queues_for_devices
from service.observability.logs import job_context
from service.storage import (
    Storage,
    checkpoint_key,
    checkpoint_prefix,
    get_storage,
    primitive_weights_prefix,
    tensorboard_key,
)
from service.webhooks import outbox

__all__ = [
    "Settings",
    "Storage",
    "checkpoint_key",
    "checkpoint_prefix",
    "end_idle_transactions_after",
    "get_settings",
    "get_storage",
    "job_context",
    "prepare_worker_process",
    "primitive_weights_prefix",
    "queues_for_devices",
    "tensorboard_key",
]


def prepare_worker_process() -> None:
    """Set up a process that reports job progress: the job events it inserts get their webhook deliveries in
    the same transaction (service.webhooks.outbox). Idempotent; every worker entry point calls it."""
    outbox.register()
