"""Every builtin model is a base model the API accepts (`builtin:smollm2-135m-instruct`, the real pretrained one,
included), routed to a CPU queue; an unknown builtin name is a 422 naming base_model and listing the choices."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from contract.spec import BUILTIN_MODELS
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, job_spec, make_dataset, recording_queue

__all__ = ["recording_queue"]  # the fixture, re-exported for pytest


@pytest.mark.parametrize("preset", BUILTIN_MODELS)
def test_each_builtin_model_is_accepted(
    client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue, preset: str
) -> None:
    spec = job_spec(make_dataset(tenant_a.tenant_id), base_model=f"builtin:{preset}")
    response = client.post("/v1/jobs", json=spec, headers=tenant_a)
    assert response.status_code == 201, response.text
    assert response.json()["base_model"] == f"builtin:{preset}"
    assert recording_queue.sent == [(response.json()["id"], "cpu")]


def test_the_real_pretrained_model_is_listed() -> None:
    assert "smollm2-135m-instruct" in BUILTIN_MODELS


def test_an_unknown_builtin_is_422_listing_the_choices(client: TestClient, tenant_a: TenantHeaders) -> None:
    spec = job_spec(make_dataset(tenant_a.tenant_id), base_model="builtin:smollm2")
    response = client.post("/v1/jobs", json=spec, headers=tenant_a)
    assert response.status_code == 422
    (detail,) = response.json()["error"]["details"]
    assert detail["field"] == "body.base_model"
    assert "smollm2-135m-instruct" in detail["message"] and "tiny-instruct" in detail["message"]
