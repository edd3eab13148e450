"""Webhook routes (thin): parse, call the domain service, render."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from contract.api.webhooks import DeliveryList, WebhookList, WebhookOut, WebhookWithSecret
from contract.fields import INT64_MAX
from service.kit.deps import SessionDep
from service.kit.openapi import error_responses
from service.kit.paging import RESOURCES, Limit
from service.kit.params import Cursor, PathId
from service.tenants.auth import CurrentTenant
from service.webhooks import service
from service.webhooks.schemas import WebhookCreate, delivery_out, webhook_out, webhook_with_secret

router = APIRouter(tags=["webhooks"])


@router.post(
    "/webhooks",
    status_code=201,
    response_model=WebhookWithSecret,
    summary="Register a webhook",
    responses=error_responses(401, 422),
)
def create_webhook(body: WebhookCreate, session: SessionDep, tenant: CurrentTenant) -> WebhookWithSecret:
    """The URL receives every job lifecycle event of this tenant, signed with Standard Webhooks.

    The response carries `secret`, shown only here. Events: job.queued, job.running,
    job.checkpoint_saved, job.eval_completed, job.paused, job.succeeded, job.failed, job.cancelled.
    A URL refused by the SSRF policy is a 422 `url_rejected`.
    """
    return webhook_with_secret(service.create_webhook(session, tenant.tenant_id, body))


@router.get("/webhooks", response_model=WebhookList, summary="List webhooks, newest first",
            responses=error_responses(401, 422))
def list_webhooks(
    session: SessionDep,
    tenant: CurrentTenant,
    limit: Limit = RESOURCES.default,
    after: Cursor = None,
) -> WebhookList:
    rows, has_more = service.list_webhooks(session, tenant.tenant_id, limit=limit, after=after)
    return WebhookList(data=[webhook_out(r) for r in rows], has_more=has_more,
                       next_after=rows[-1].id if has_more and rows else None)


@router.get("/webhooks/{webhook_id}", response_model=WebhookOut, summary="Get a webhook",
            responses=error_responses(401, 404))
def get_webhook(webhook_id: PathId, session: SessionDep, tenant: CurrentTenant) -> WebhookOut:
    return webhook_out(service.get_webhook(session, tenant.tenant_id, webhook_id))


@router.delete("/webhooks/{webhook_id}", status_code=204, response_class=Response, summary="Delete a webhook",
               responses=error_responses(401, 404))
def delete_webhook(webhook_id: PathId, session: SessionDep, tenant: CurrentTenant) -> Response:
    """Stops all deliveries to it, including pending retries."""
    service.delete_webhook(session, tenant.tenant_id, webhook_id)
    return Response(status_code=204)


@router.post("/webhooks/{webhook_id}/rotate-secret", response_model=WebhookWithSecret,
             summary="Rotate a webhook's signing secret", responses=error_responses(401, 403, 404))
def rotate_webhook_secret(webhook_id: PathId, session: SessionDep, tenant: CurrentTenant) -> WebhookWithSecret:
    """Issue a new signing secret (returned once). Until `previous_secret_expires_at`
    (GRPO_SECRET_ROTATION_OVERLAP_SECONDS, default 24 h) every delivery carries signatures with both the new and
    the replaced secret (`webhook-signature: v1,<new> v1,<old>`), so the receiver can switch at any time."""
    return webhook_with_secret(service.rotate_webhook_secret(session, tenant.tenant_id, webhook_id))


@router.get("/webhooks/{webhook_id}/deliveries", response_model=DeliveryList,
            summary="A webhook's deliveries, newest first", responses=error_responses(401, 404, 422))
def list_deliveries(
    webhook_id: PathId,
    session: SessionDep,
    tenant: CurrentTenant,
    limit: Limit = RESOURCES.default,
    after: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="`next_after` of the previous page.")] = None,
) -> DeliveryList:
    rows, has_more = service.list_deliveries(session, tenant.tenant_id, webhook_id, limit=limit, after=after)
    return DeliveryList(data=[delivery_out(r) for r in rows], has_more=has_more,
                        next_after=rows[-1].id if has_more and rows else None)
