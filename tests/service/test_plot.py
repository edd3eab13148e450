"""`GET /v1/jobs/{id}/plot.png`: a PNG of the job's curves, tenant-isolated."""

from __future__ import annotations

import io

from fastapi.testclient import TestClient

from service.execution import reporting
from service.execution.lease import claim_job
from service.jobs.schemas import SampleIn
from service.kit.db import session_scope
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def create_job(client: TestClient, headers: TenantHeaders) -> str:
    response = client.post("/v1/jobs", json=job_spec(make_dataset(headers.tenant_id)), headers=headers)
    assert response.status_code == 201, response.text
    job_id: str = response.json()["id"]
    return job_id


def png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size


class TestPlot:
    def test_png_of_recorded_steps(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create_job(client, tenant_a)
        with session_scope() as session:
            held = claim_job(session, job_id, "test-worker", lease_seconds=60)
        assert held is not None
        for step in range(1, 6):
            metrics = {"reward/mean": 0.1 * step, "reward/std": 0.05, "kl": 0.01 * step,
                       "completion_length/mean": 10.0 + step}
            reporting.record_step(held, step, metrics, [SampleIn(prompt="p", completion="c")])

        response = client.get(f"/v1/jobs/{job_id}/plot.png", headers=tenant_a)
        assert response.status_code == 200
        assert response.headers["content-type"] == "image/png"
        assert response.content.startswith(PNG_MAGIC)
        assert png_size(response.content) == (700, 1000)  # 7 x 10 inches at 100 dpi: four panels

    def test_job_without_metrics_still_renders(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create_job(client, tenant_a)
        response = client.get(f"/v1/jobs/{job_id}/plot.png", headers=tenant_a)
        assert response.status_code == 200 and response.content.startswith(PNG_MAGIC)

    def test_other_tenant_gets_the_same_404_as_a_missing_job(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        job_id = create_job(client, tenant_a)
        other = client.get(f"/v1/jobs/{job_id}/plot.png", headers=tenant_b)
        missing = client.get("/v1/jobs/job_missing/plot.png", headers=tenant_b)
        assert other.status_code == missing.status_code == 404
        assert other.json()["error"]["code"] == "not_found"
        assert client.get(f"/v1/jobs/{job_id}/plot.png").status_code == 401
