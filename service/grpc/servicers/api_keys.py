"""ApiKeyService: the same domain functions as /v1/api-keys (service.tenants.service); `admin` scope only
(service.grpc.scopes)."""

from __future__ import annotations

from datetime import UTC
from typing import Any

import grpc
from sqlalchemy.orm import Session

from contract.api.api_keys import ApiKeyOut, ApiKeyWithSecret
from contract.gen.grpo.v1 import api_keys_pb2 as pb
from contract.gen.grpo.v1 import api_keys_pb2_grpc
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.convert import timestamp
from service.kit.paging import RESOURCES, page_size
from service.tenants import service
from service.tenants.schemas import ApiKeyCreate, api_key_out, api_key_with_secret

Context = grpc.aio.ServicerContext[Any, Any]


def api_key_to_proto(key: ApiKeyOut) -> pb.ApiKey:
    return pb.ApiKey(
        id=key.id,
        name=key.name,
        scopes=list(key.scopes),
        prefix=key.prefix,
        created_at=timestamp(key.created_at),
        expires_at=timestamp(key.expires_at),
        last_used_at=timestamp(key.last_used_at),
        revoked_at=timestamp(key.revoked_at),
    )


class ApiKeyServicer(api_keys_pb2_grpc.ApiKeyServiceServicer):
    async def CreateApiKey(self, request: pb.CreateApiKeyRequest, context: Context) -> pb.CreateApiKeyResponse:
        tenant = current_tenant()
        fields: dict[str, Any] = {"name": request.name}
        if request.scopes:
            fields["scopes"] = list(request.scopes)
        if request.HasField("expires_at"):
            fields["expires_at"] = request.expires_at.ToDatetime(tzinfo=UTC)
        body = ApiKeyCreate.model_validate(fields)  # a ValidationError names the field (INVALID_ARGUMENT)

        def work(s: Session) -> ApiKeyWithSecret:
            row, token = service.create_api_key_for(
                s, tenant, name=body.name, scopes=body.scopes, expires_at=body.expires_at
            )
            return api_key_with_secret(row, token)

        created = await in_session(work)
        return pb.CreateApiKeyResponse(api_key=api_key_to_proto(created), key=created.key)

    async def ListApiKeys(self, request: pb.ListApiKeysRequest, context: Context) -> pb.ListApiKeysResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, RESOURCES)

        def work(s: Session) -> tuple[list[ApiKeyOut], bool]:
            rows, has_more = service.list_api_keys(s, tenant.tenant_id, limit=limit, after=request.page_token or None)
            return [api_key_out(r) for r in rows], has_more

        keys, has_more = await in_session(work)
        return pb.ListApiKeysResponse(
            api_keys=[api_key_to_proto(k) for k in keys], next_page_token=keys[-1].id if has_more and keys else ""
        )

    async def RevokeApiKey(self, request: pb.RevokeApiKeyRequest, context: Context) -> pb.RevokeApiKeyResponse:
        tenant = current_tenant()
        key = await in_session(
            lambda s: api_key_out(service.revoke_api_key(s, tenant.tenant_id, request.api_key_id))
        )
        return pb.RevokeApiKeyResponse(api_key=api_key_to_proto(key))
