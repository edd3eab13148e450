"""use_vllm on a worker without vLLM fails the job at once with a code and a message naming the field."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from contract.spec import JobSpec
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.kit.config import Settings
from service.kit.db import session_scope
from tests.service.factories import TenantHeaders
from tests.worker.conftest import RecordingQueue, insert_dataset, tiny_spec
from worker.runner import JobRunner


def test_use_vllm_without_vllm_fails_naming_the_field(
    settings: Settings, make_tenant: Callable[[str], TenantHeaders], monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = make_tenant("acme")
    with session_scope() as session:
        spec = tiny_spec(insert_dataset(session, tenant.tenant_id), use_vllm=True)
        job_id = jobs_service.create_job(session, tenant.tenant_id, JobSpec.model_validate(spec), RecordingQueue()).id
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an interpreter without the package reports

    assert JobRunner(job_id, worker_id="w1").run() == "failed"

    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        assert job.error_code == "vllm_unavailable"
        assert job.error_message is not None and "hyperparameters.use_vllm" in job.error_message
