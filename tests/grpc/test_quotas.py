"""Quotas over a real gRPC channel: the same refusals as REST (status, message, error code and details in the
trailers) from the same domain check, and QuotaService."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import grpc
import pytest

from contract.api.quotas import QuotaLimits
from contract.gen.grpo.v1 import datasets_pb2_grpc, jobs_pb2, jobs_pb2_grpc, quotas_pb2, quotas_pb2_grpc
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.kit.queue import set_job_queue
from service.quotas import service as quotas
from tests.grpc.helpers import bearer, error_code, error_details, error_field, upload_requests
from tests.grpc.test_jobs import spec_message
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, make_dataset


@pytest.fixture
def queue(settings: Settings) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


@pytest.fixture
def jobs(channel: grpc.aio.Channel) -> jobs_pb2_grpc.JobServiceAsyncStub:
    return jobs_pb2_grpc.JobServiceStub(channel)


@pytest.fixture
def admin(channel: grpc.aio.Channel) -> quotas_pb2_grpc.QuotaServiceAsyncStub:
    return quotas_pb2_grpc.QuotaServiceStub(channel)


@pytest.fixture
def operator(monkeypatch: pytest.MonkeyPatch, settings: Settings, tenant_a: TenantHeaders) -> TenantHeaders:
    monkeypatch.setenv("GRPO_OPERATOR_TENANTS", '["tenant-a"]')
    get_settings.cache_clear()
    return tenant_a


def _override(tenant_id: str, **limits: int) -> None:
    with session_scope() as session:
        quotas.set_overrides(session, tenant_id, QuotaLimits(**limits))


async def _failure(call: Callable[..., object], *args: object, **kwargs: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(*args, **kwargs)  # type: ignore[misc]
    return err.value


def _create(jobs: jobs_pb2_grpc.JobServiceAsyncStub, tenant: TenantHeaders) -> object:
    request = jobs_pb2.CreateJobRequest(spec=spec_message(make_dataset(tenant.tenant_id)))
    return jobs.CreateJob(request, metadata=bearer(tenant.api_key))


class TestRefusals:
    async def test_queued_jobs_quota_is_resource_exhausted(
        self, jobs: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_queued_jobs=1)
        await _create(jobs, tenant_a)  # type: ignore[misc]
        error = await _failure(_create, jobs, tenant_a)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == "quota max_queued_jobs exceeded: limit 1, in use 1, requested 1"
        assert error_code(error) == "quota_exceeded"
        assert error_details(error) == {"quota": "max_queued_jobs", "limit": 1, "current": 1, "requested": 1}

    async def test_devices_quota_is_failed_precondition(
        self, jobs: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        _override(tenant_a.tenant_id, max_devices=0)
        error = await _failure(_create, jobs, tenant_a)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == "quota max_devices exceeded: limit 0, in use 0, requested 1"
        assert error_code(error) == "quota_exceeded"
        assert error_details(error) == {"quota": "max_devices", "limit": 0, "current": 0, "requested": 1}
        assert queue.sent == []

    async def test_dataset_storage_quota_is_failed_precondition(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders
    ) -> None:
        _override(tenant_a.tenant_id, max_dataset_storage_bytes=10)
        data = (json.dumps({"prompt": "hello"}) + "\n").encode()
        stub = datasets_pb2_grpc.DatasetServiceStub(channel)
        error = await _failure(stub.UploadDataset, upload_requests(data), metadata=bearer(tenant_a.api_key))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == f"quota max_dataset_storage_bytes exceeded: limit 10, in use 0, requested {len(data)}"
        assert error_details(error) == {
            "quota": "max_dataset_storage_bytes", "limit": 10, "current": 0, "requested": len(data)
        }


class TestQuotaService:
    async def test_operator_sets_and_reads_another_tenants_quotas(
        self, admin: quotas_pb2_grpc.QuotaServiceAsyncStub, operator: TenantHeaders, tenant_b: TenantHeaders,
        queue: RecordingQueue,
    ) -> None:
        request = quotas_pb2.SetTenantQuotasRequest(
            tenant_id=tenant_b.tenant_id, overrides=quotas_pb2.QuotaLimits(max_running_jobs=2, max_devices=0)
        )
        reply = await admin.SetTenantQuotas(request, metadata=bearer(operator.api_key))
        assert reply.quotas.overrides == quotas_pb2.QuotaLimits(max_running_jobs=2, max_devices=0)
        assert reply.quotas.limits.max_running_jobs == 2
        assert reply.quotas.limits.max_queued_jobs == get_settings().quota_max_queued_jobs
        assert reply.quotas.limits.HasField("max_devices") and reply.quotas.limits.max_devices == 0
        got = await admin.GetTenantQuotas(
            quotas_pb2.GetTenantQuotasRequest(tenant_id=tenant_b.tenant_id), metadata=bearer(operator.api_key)
        )
        assert got.quotas == reply.quotas
        assert got.quotas.usage == quotas_pb2.QuotaUsage()

    async def test_a_tenant_admin_reads_its_own_but_cannot_change_them(
        self, admin: quotas_pb2_grpc.QuotaServiceAsyncStub, tenant_b: TenantHeaders, settings: Settings
    ) -> None:
        auth = bearer(tenant_b.api_key)
        got = await admin.GetTenantQuotas(quotas_pb2.GetTenantQuotasRequest(tenant_id=tenant_b.tenant_id), metadata=auth)
        assert got.quotas.tenant_id == tenant_b.tenant_id and not got.quotas.overrides.HasField("max_running_jobs")
        error = await _failure(
            admin.SetTenantQuotas, quotas_pb2.SetTenantQuotasRequest(tenant_id=tenant_b.tenant_id), metadata=auth
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and error_code(error) == "operator_required"

    async def test_another_tenant_is_not_found(
        self, admin: quotas_pb2_grpc.QuotaServiceAsyncStub, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        error = await _failure(
            admin.GetTenantQuotas, quotas_pb2.GetTenantQuotasRequest(tenant_id=tenant_a.tenant_id),
            metadata=bearer(tenant_b.api_key),
        )
        assert error.code() == grpc.StatusCode.NOT_FOUND

    async def test_a_negative_limit_is_invalid_argument_naming_the_field(
        self, admin: quotas_pb2_grpc.QuotaServiceAsyncStub, operator: TenantHeaders
    ) -> None:
        request = quotas_pb2.SetTenantQuotasRequest(
            tenant_id=operator.tenant_id, overrides=quotas_pb2.QuotaLimits(max_queued_jobs=-1)
        )
        error = await _failure(admin.SetTenantQuotas, request, metadata=bearer(operator.api_key))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(error) == "overrides.max_queued_jobs"
