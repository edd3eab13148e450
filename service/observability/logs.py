"""Structured logs: every record carries the job id and attempt it was logged for.

The job context lives in contextvars (`job_context(job_id, attempt)`), so code deep in the engine or the
reward client logs with plain `log.info(...)` and still gets `job_id`/`attempt` attached by
`JobContextFilter`. With `GRPO_LOG_JSON=true` records are rendered one JSON object per line by
`JsonFormatter`; otherwise the text format shows `[job_id#attempt]` when a job is set.

Threads started inside a job context do not inherit it (contextvars are per thread); asyncio tasks do.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

from celery.signals import after_setup_logger, after_setup_task_logger

_job_id: ContextVar[str | None] = ContextVar("grpo_job_id", default=None)
_attempt: ContextVar[int | None] = ContextVar("grpo_attempt", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(job_tag)s: %(message)s"
# LogRecord attributes that are not user `extra=` fields (kept out of the JSON object).
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "job_tag"}


@contextmanager
def job_context(job_id: str, attempt: int) -> Iterator[None]:
    """Attach `job_id` and `attempt` to every record logged inside the block (this thread / task)."""
    job_token = _job_id.set(job_id)
    attempt_token = _attempt.set(attempt)
    try:
        yield
    finally:
        _attempt.reset(attempt_token)
        _job_id.reset(job_token)


def current_job() -> tuple[str | None, int | None]:
    return _job_id.get(), _attempt.get()


class JobContextFilter(logging.Filter):
    """Adds `job_id`, `attempt` (None outside a job) and `job_tag` (for the text format) to records."""

    def filter(self, record: logging.LogRecord) -> bool:
        job_id, attempt = current_job()
        if getattr(record, "job_id", None) is None:
            record.job_id = job_id
        if getattr(record, "attempt", None) is None:
            record.attempt = attempt
        tagged_job = getattr(record, "job_id", None)
        record.job_tag = f" [{tagged_job}#{getattr(record, 'attempt', None)}]" if tagged_job else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, job_id, attempt, extras, exc_info."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "job_id": getattr(record, "job_id", None),
            "attempt": getattr(record, "attempt", None),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and key not in payload:
                payload[key] = value
        if record.exc_info:
            payload["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_handler(handler: logging.Handler, *, json_logs: bool) -> None:
    """Give `handler` the job-context filter and the JSON or text formatter."""
    if not any(isinstance(f, JobContextFilter) for f in handler.filters):
        handler.addFilter(JobContextFilter())
    handler.setFormatter(JsonFormatter() if json_logs else logging.Formatter(TEXT_FORMAT))


def setup_logging(*, json_logs: bool, level: int | str = logging.INFO) -> None:
    """Configure the root logger once for a process (`grpo serve`, `grpo worker`)."""
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    for handler in root.handlers:
        configure_handler(handler, json_logs=json_logs)


def install_celery_logging(*, json_logs: bool) -> None:
    """Give the handlers Celery sets up (worker and task loggers) the job filter and JSON/text format."""
    def configure(logger: logging.Logger, **_kwargs: object) -> None:
        for handler in logger.handlers:
            if json_logs:
                configure_handler(handler, json_logs=True)
            elif not any(isinstance(f, JobContextFilter) for f in handler.filters):
                handler.addFilter(JobContextFilter())  # Celery's own text format stays

    after_setup_logger.connect(configure, weak=False)
    after_setup_task_logger.connect(configure, weak=False)
