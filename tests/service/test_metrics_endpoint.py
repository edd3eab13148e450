"""`GET /metrics` on the API: request latency by route template, jobs by state, queue depth.

Jobs progress through the same functions the worker uses (service.execution.lease.claim_job, service.execution.reporting).
"""

from __future__ import annotations

import json
import logging

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.execution import reporting
from service.execution.lease import Claim, claim_job
from service.jobs.schemas import SampleIn
from service.jobs.states import JobStatus
from service.kit.db import session_scope
from service.observability.logs import JobContextFilter, JsonFormatter, job_context
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: TestClient) -> Samples:
    response = client.get("/metrics")  # no Authorization header: scrapers carry no API key
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def create_job(client: TestClient, headers: TenantHeaders, dataset_id: str) -> str:
    response = client.post("/v1/jobs", json=job_spec(dataset_id), headers=headers)
    assert response.status_code == 201, response.text
    job_id: str = response.json()["id"]
    return job_id


def claim(job_id: str) -> Claim:
    with session_scope() as session:
        result = claim_job(session, job_id, "test-worker", lease_seconds=60)
    assert result is not None
    return result


class TestMetricsEndpoint:
    def test_exposes_latency_jobs_by_state_and_queue_depth(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        before = scrape(client)
        dataset_id = make_dataset(tenant_a.tenant_id)
        running = create_job(client, tenant_a, dataset_id)
        create_job(client, tenant_a, dataset_id)  # stays queued
        succeeded = create_job(client, tenant_a, dataset_id)

        # Run two jobs as the worker does: claim, report steps (metrics + samples), finish one.
        claims = {job_id: claim(job_id) for job_id in (running, succeeded)}
        for held in claims.values():
            for step in range(1, 4):
                reporting.record_step(
                    held, step, {"reward/mean": 0.1 * step, "kl": 0.01},
                    [SampleIn(prompt="p", completion="c", reward=0.5)],
                )
        reporting.finish(claims[succeeded], JobStatus.succeeded, reason="trained 3 steps")
        assert client.get(f"/v1/jobs/{running}", headers=tenant_a).json()["progress"]["step"] == 3

        after = scrape(client)
        # jobs by state (every state present, counted in the database at scrape time)
        assert value(after, "grpo_jobs", state="queued") == 1
        assert value(after, "grpo_jobs", state="running") == 1
        assert value(after, "grpo_jobs", state="succeeded") == 1
        assert value(after, "grpo_jobs", state="failed") == 0
        assert ("grpo_jobs", (("state", "cancelling"),)) in after
        # queue depth: the builtin:tiny jobs go to the cpu queue
        assert value(after, "grpo_queue_depth", queue="cpu") == 1
        assert value(after, "grpo_queue_depth", queue="gpu") == 0
        # request latency, labelled by route template (not the concrete path), method and status
        created = {"method": "POST", "route": "/v1/jobs", "status": "201"}
        assert value(after, "grpo_http_request_duration_seconds_count", **created) - value(
            before, "grpo_http_request_duration_seconds_count", **created
        ) == 3
        got = {"method": "GET", "route": "/v1/jobs/{job_id}", "status": "200"}
        assert value(after, "grpo_http_request_duration_seconds_count", **got) >= 1
        assert value(after, "grpo_http_request_duration_seconds_bucket", le="+Inf", **got) >= 1
        assert not any(running in str(labels) for _name, labels in after)
        assert value(after, "grpo_webhook_outbox_pending") == 0

    def test_unmatched_paths_share_one_label(self, client: TestClient) -> None:
        client.get("/no/such/path/123")
        client.get("/no/such/path/456")
        samples = scrape(client)
        labels = {"method": "GET", "route": "<unmatched>", "status": "404"}
        assert value(samples, "grpo_http_request_duration_seconds_count", **labels) >= 2
        assert not any("/no/such" in str(labels) for _name, labels in samples)


class TestJsonLogs:
    def test_records_carry_job_id_and_attempt(self) -> None:
        formatter = JsonFormatter()
        records: list[logging.LogRecord] = []
        logger = logging.getLogger("grpo.test.logs")
        capture = _ListHandler(records)
        logger.addHandler(capture)
        try:
            with job_context("job_123", 2):
                logger.warning("step %d done", 7, extra={"step": 7})
            logger.warning("outside")
        finally:
            logger.removeHandler(capture)
        inside, outside = (json.loads(formatter.format(r)) for r in records)
        assert inside["job_id"] == "job_123" and inside["attempt"] == 2
        assert inside["message"] == "step 7 done" and inside["step"] == 7 and inside["level"] == "WARNING"
        assert outside["job_id"] is None and outside["attempt"] is None


class _ListHandler(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__()
        self.records = records
        self.addFilter(JobContextFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
