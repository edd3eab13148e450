"""Prometheus series of the API process, on a registry of its own (served at `GET /metrics`).

- `grpo_http_request_duration_seconds{method, route, status}`: latency histogram per route *template*
  (`/v1/jobs/{job_id}`, never the concrete path, so the number of series stays bounded).
- `grpo_jobs{state}`: jobs per state, and `grpo_queue_depth{queue}`: jobs waiting in `queued` per worker
  queue. Both are read from the database at scrape time by `JobsCollector` (one GROUP BY over the jobs
  table), so every API replica reports the same truth and nothing has to be kept in sync.
- `grpo_webhook_deliveries_total{outcome}` and `grpo_webhook_outbox_pending`: webhook delivery.

A dedicated registry (not prometheus_client's global one) because `create_app()` runs many times in one
test process; the module-level objects here are created exactly once per process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from service.jobs.models import Job
from service.jobs.states import JobStatus
from service.kit.db import session_scope
from service.webhooks.delivery import WEBHOOK_DELIVERIES
from service.webhooks.repository import count_pending_deliveries

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
QUEUES = ("gpu", "cpu")

HTTP_LATENCY = Histogram(
    "grpo_http_request_duration_seconds",
    "REST request latency by route template, method and status code.",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
REGISTRY.register(WEBHOOK_DELIVERIES)  # counted by the webhook dispatcher
ProcessCollector(registry=REGISTRY)


class JobsCollector(Collector):
    """Jobs by state and queue depth, counted in the database when Prometheus scrapes."""

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("grpo_jobs", "Jobs by state.", labels=["state"])
        depth = GaugeMetricFamily("grpo_queue_depth", "Jobs waiting in state queued, per worker queue.",
                                  labels=["queue"])
        pending = GaugeMetricFamily("grpo_webhook_outbox_pending", "Webhook deliveries not yet delivered.")
        try:
            by_state, by_queue, outbox = _counts()
        except Exception:
            # A scrape must not fail (and hide the latency series) because the database is briefly away.
            log.warning("metrics: could not count jobs", exc_info=True)
            return
        for state in JobStatus:
            jobs.add_metric([state.value], by_state.get(state.value, 0))
        for queue in sorted(set(QUEUES) | set(by_queue)):
            depth.add_metric([queue], by_queue.get(queue, 0))
        pending.add_metric([], outbox)
        yield jobs
        yield depth
        yield pending

    def describe(self) -> Iterable[Metric]:
        # Describing without collecting: registration must not touch the database.
        return []


def _counts() -> tuple[dict[str, int], dict[str, int], int]:
    with session_scope() as session:
        rows = session.execute(select(Job.status, Job.queue, func.count()).group_by(Job.status, Job.queue)).all()
        outbox = count_pending_deliveries(session)
    by_state: dict[str, int] = {}
    by_queue: dict[str, int] = {}
    for status, queue, count in rows:
        by_state[status] = by_state.get(status, 0) + int(count)
        if status == JobStatus.queued.value:
            by_queue[queue] = by_queue.get(queue, 0) + int(count)
    return by_state, by_queue, outbox


REGISTRY.register(JobsCollector())


def exposition() -> bytes:
    """The registry in the Prometheus text format."""
    return generate_latest(REGISTRY)
