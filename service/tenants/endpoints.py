"""API-key routes (thin): only a key with the `admin` scope manages the tenant's keys."""

from __future__ import annotations

from fastapi import APIRouter, Response

from contract.api.api_keys import ApiKeyList, ApiKeyWithSecret
from service.kit.deps import SessionDep
from service.kit.openapi import error_responses
from service.kit.paging import RESOURCES, Limit
from service.kit.params import Cursor, PathId
from service.tenants import service
from service.tenants.auth import AdminTenant
from service.tenants.schemas import ApiKeyCreate, api_key_out, api_key_with_secret

router = APIRouter(tags=["api keys"])


@router.post(
    "/api-keys",
    status_code=201,
    response_model=ApiKeyWithSecret,
    summary="Create an API key",
    responses=error_responses(401, 403, 409, 422),
)
def create_api_key(body: ApiKeyCreate, session: SessionDep, tenant: AdminTenant) -> ApiKeyWithSecret:
    """A new key for your tenant with the scopes named (default `read`, `write`). The response carries `key`,
    shown only here.

    A key never outgrows the key that creates it: scopes the creating key lacks are refused (403
    `insufficient_scope`), and a creating key that expires must give the new key an `expires_at` no later than
    its own (422). A tenant holds at most `GRPO_MAX_API_KEYS_PER_TENANT` active keys (409 `too_many_api_keys`)."""
    row, token = service.create_api_key_for(
        session, tenant, name=body.name, scopes=body.scopes, expires_at=body.expires_at
    )
    return api_key_with_secret(row, token)


@router.get(
    "/api-keys",
    response_model=ApiKeyList,
    summary="List API keys, newest first",
    responses=error_responses(401, 403, 422),
)
def list_api_keys(
    session: SessionDep, tenant: AdminTenant, limit: Limit = RESOURCES.default, after: Cursor = None
) -> ApiKeyList:
    """Every key of your tenant, revoked and expired ones included (see `revoked_at`, `expires_at`)."""
    rows, has_more = service.list_api_keys(session, tenant.tenant_id, limit=limit, after=after)
    return ApiKeyList(
        data=[api_key_out(r) for r in rows], has_more=has_more, next_after=rows[-1].id if has_more else None
    )


@router.delete(
    "/api-keys/{api_key_id}",
    status_code=204,
    response_class=Response,
    summary="Revoke an API key",
    responses=error_responses(401, 403, 404),
)
def revoke_api_key(api_key_id: PathId, session: SessionDep, tenant: AdminTenant) -> Response:
    """Idempotent. This server refuses the key at once; other API processes within `GRPO_AUTH_CACHE_SECONDS`.
    Revoking the key making the request is allowed."""
    service.revoke_api_key(session, tenant.tenant_id, api_key_id)
    return Response(status_code=204)
