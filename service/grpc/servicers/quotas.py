"""QuotaService: the same domain functions as /v1/admin/tenants/{tenant_id}/quotas (service.admin.quotas)."""

from __future__ import annotations

from typing import Any

import grpc
from pydantic import ValidationError

from contract.api.quotas import QUOTA_NAMES, QuotaLimits, QuotasOut
from contract.gen.grpo.v1 import quotas_pb2, quotas_pb2_grpc
from service.admin import quotas as admin
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.errors import from_validation_error
from service.kit.queue import get_job_queue

Context = grpc.aio.ServicerContext[Any, Any]


def limits_from_proto(message: quotas_pb2.QuotaLimits) -> QuotaLimits:
    """Unset fields are None; ValidationFailed naming `overrides.<quota>` for a value out of range."""
    values = {name: getattr(message, name) if message.HasField(name) else None for name in QUOTA_NAMES}
    try:
        return QuotaLimits.model_validate(values)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix="overrides") from exc


def _limits_to_proto(limits: QuotaLimits) -> quotas_pb2.QuotaLimits:
    return quotas_pb2.QuotaLimits(**limits.model_dump(exclude_none=True))


def quotas_to_proto(quotas: QuotasOut) -> quotas_pb2.TenantQuotas:
    return quotas_pb2.TenantQuotas(
        tenant_id=quotas.tenant_id,
        limits=_limits_to_proto(quotas.limits),
        overrides=_limits_to_proto(quotas.overrides),
        usage=quotas_pb2.QuotaUsage(**quotas.usage.model_dump()),
    )


class QuotaServicer(quotas_pb2_grpc.QuotaServiceServicer):
    async def GetTenantQuotas(
        self, request: quotas_pb2.GetTenantQuotasRequest, context: Context
    ) -> quotas_pb2.GetTenantQuotasResponse:
        caller = current_tenant()
        quotas = await in_session(lambda s: admin.read_quotas(s, caller, request.tenant_id))
        return quotas_pb2.GetTenantQuotasResponse(quotas=quotas_to_proto(quotas))

    async def SetTenantQuotas(
        self, request: quotas_pb2.SetTenantQuotasRequest, context: Context
    ) -> quotas_pb2.SetTenantQuotasResponse:
        caller = current_tenant()
        overrides = limits_from_proto(request.overrides)
        quotas = await in_session(
            lambda s: admin.write_quotas(s, caller, request.tenant_id, overrides, get_job_queue())
        )
        return quotas_pb2.SetTenantQuotasResponse(quotas=quotas_to_proto(quotas))
