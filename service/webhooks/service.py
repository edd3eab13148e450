"""Webhook registry for API callers (REST; transport-free): register, list, get, delete, deliveries.

Secrets are Standard Webhooks keys ("whsec_" + base64 of 24 random bytes), generated like the reward
functions' and returned only by create. URLs pass the same SSRF policy as reward endpoints at registration
(`check_registration_url`: in production the host is resolved and every address checked), and again,
resolving DNS, at every delivery.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session

from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import NotFound
from service.kit.ids import new_id
from service.kit.paging import page
from service.rewards.service import check_registration_url, new_signing_secret, rotation_overlap_end
from service.webhooks import repository
from service.webhooks.models import WebhookDelivery, WebhookEndpoint
from service.webhooks.schemas import WebhookCreate


def create_webhook(session: Session, tenant_id: str, spec: WebhookCreate) -> WebhookEndpoint:
    """Register a URL under the reward endpoints' policy; raises UrlNotAllowed naming the problem.

    The check (a DNS lookup in production) runs before any SQL, so no transaction waits on it.
    """
    url = check_registration_url(spec.url, allow_private=bool(get_settings().allow_private_reward_urls))
    row = WebhookEndpoint(
        id=new_id("wh"),
        tenant_id=tenant_id,
        url=url,
        description=spec.description,
        secret=new_signing_secret(),
        created_at=utcnow(),
    )
    repository.add_endpoint(session, row)
    return row


def get_webhook(session: Session, tenant_id: str, webhook_id: str) -> WebhookEndpoint:
    row = repository.get_endpoint(session, tenant_id, webhook_id)
    if row is None:
        raise NotFound("webhook", webhook_id)
    return row


def rotate_webhook_secret(session: Session, tenant_id: str, webhook_id: str) -> WebhookEndpoint:
    """Issue a new signing secret. Deliveries carry signatures with the new and the replaced secret until the
    overlap ends (GRPO_SECRET_ROTATION_OVERLAP_SECONDS); rotating again within it drops the older secret."""
    row = repository.get_endpoint(session, tenant_id, webhook_id)
    if row is None:
        raise NotFound("webhook", webhook_id)
    until = rotation_overlap_end(utcnow())
    row.previous_secret = row.secret if until is not None else None
    row.previous_secret_expires_at = until
    row.secret = new_signing_secret()
    session.flush()
    return row


def list_webhooks(
    session: Session, tenant_id: str, *, limit: int, after: str | None
) -> tuple[Sequence[WebhookEndpoint], bool]:
    rows = repository.list_endpoints(session, tenant_id, limit=limit + 1, after=after)
    return page(rows, limit)


def delete_webhook(session: Session, tenant_id: str, webhook_id: str) -> None:
    """Removes the endpoint and its pending deliveries: nothing more is sent to it."""
    repository.delete_endpoint(session, get_webhook(session, tenant_id, webhook_id))


def list_deliveries(
    session: Session, tenant_id: str, webhook_id: str, *, limit: int, after: int | None
) -> tuple[Sequence[WebhookDelivery], bool]:
    """The endpoint's deliveries, newest first: what was sent, how often, and the last error."""
    get_webhook(session, tenant_id, webhook_id)
    rows = repository.list_deliveries(session, webhook_id, limit=limit + 1, after=after)
    return page(rows, limit)
