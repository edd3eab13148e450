"""The reward-function registry: register, read, delete, rotate the signing secret.

Secrets are Standard Webhooks keys ("whsec_" + base64 of 24 random bytes), stored as issued because
the worker needs them to sign each request; they are returned only by create and rotate-secret.
Deletion is soft: jobs already submitted with a function keep calling it (`get_for_job`).
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import Coroutine, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from sqlalchemy.orm import Session

from outbound.urlpolicy import Resolver, UrlRejected, check_url, check_url_syntax
from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import NotFound, UrlNotAllowed
from service.kit.ids import new_id
from service.kit.paging import page
from service.rewards import repository
from service.rewards.models import RewardFunction
from service.rewards.schemas import RewardFunctionCreate

T = TypeVar("T")


def run_blocking(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` to completion from sync domain code (REST threadpool, gRPC `in_session` thread).

    Those threads have no event loop, so a private one is made and closed; from a thread that is running a
    loop this would deadlock it, hence the explicit refusal.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    coroutine.close()
    raise RuntimeError("sync domain functions must not be called on an event loop thread (use a worker thread)")


def check_registration_url(url: str, *, allow_private: bool, resolver: Resolver | None = None) -> str:
    """The SSRF policy at registration; returns the normalised URL or raises UrlNotAllowed.

    Production (`allow_private=False`): the static rules, then the host is resolved and every A/AAAA answer
    must be globally routable (`check_url`), so a name pointing at a private address is refused now rather
    than at the first training step. Development: static rules only; the name of a local reward server need
    not resolve yet. Every call resolves and checks again in both modes (`outbound.rewards`).
    """
    try:
        if allow_private:
            return check_url_syntax(url, allow_private=True)
        return run_blocking(check_url(url, allow_private=False, resolver=resolver))
    except UrlRejected as exc:
        raise UrlNotAllowed(exc.message, details=exc.details) from exc


def new_signing_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def create_reward_function(session: Session, tenant_id: str, spec: RewardFunctionCreate) -> RewardFunction:
    """Register an endpoint (URL checked against the SSRF policy, see `check_registration_url`).

    Raises UrlNotAllowed. The check runs before any SQL, so no transaction is open during the DNS lookup.
    """
    url = check_registration_url(spec.url, allow_private=bool(get_settings().allow_private_reward_urls))
    now = utcnow()
    row = RewardFunction(
        id=new_id("rf"),
        tenant_id=tenant_id,
        name=spec.name,
        url=url,
        timeout_s=spec.timeout_s,
        max_batch_size=spec.max_batch_size,
        max_concurrency=spec.max_concurrency,
        headers=dict(spec.headers),
        max_attempts=spec.max_attempts,
        backoff_s=spec.backoff_s,
        breaker_threshold=spec.breaker_threshold,
        step_deadline_s=spec.step_deadline_s,
        max_abstain_fraction=spec.max_abstain_fraction,
        signing_secret=new_signing_secret(),
        created_at=now,
        updated_at=now,
    )
    repository.add(session, row)
    return row


def get_reward_function(session: Session, tenant_id: str, rf_id: str) -> RewardFunction:
    row = repository.get(session, tenant_id, rf_id)
    if row is None:
        raise NotFound("reward function", rf_id)
    return row


def live_reward_function_ids(session: Session, tenant_id: str, ids: Sequence[str]) -> set[str]:
    """Those of `ids` that are the tenant's and not deleted (what a job may call)."""
    return set(repository.live(session, tenant_id, ids))


def list_reward_functions(
    session: Session, tenant_id: str, *, limit: int, after: str | None
) -> tuple[Sequence[RewardFunction], bool]:
    """A page, newest first, and whether more follow."""
    rows = repository.list_page(session, tenant_id, limit=limit + 1, after=after)
    return page(rows, limit)


def delete_reward_function(session: Session, tenant_id: str, rf_id: str) -> None:
    row = repository.get(session, tenant_id, rf_id, for_update=True)
    if row is None:
        raise NotFound("reward function", rf_id)
    row.deleted_at = utcnow()
    session.flush()


def rotation_overlap_end(now: datetime) -> datetime | None:
    """Until when a secret replaced at `now` still signs (GRPO_SECRET_ROTATION_OVERLAP_SECONDS); None: no overlap."""
    overlap = get_settings().secret_rotation_overlap_seconds
    return now + timedelta(seconds=overlap) if overlap > 0 else None


def previous_secret_in_overlap(previous: str | None, until: datetime | None, now: datetime) -> str | None:
    """The replaced secret while its overlap lasts, else None."""
    return previous if previous is not None and until is not None and now < until else None


def rotate_secret(session: Session, tenant_id: str, rf_id: str) -> RewardFunction:
    """Issue a new signing secret. Requests are signed with the new and the replaced secret until the overlap
    ends (both in webhook-signature); rotating again within it drops the older secret at once."""
    row = repository.get(session, tenant_id, rf_id, for_update=True)
    if row is None:
        raise NotFound("reward function", rf_id)
    replace_secret(row)
    session.flush()
    return row


class SignedEndpoint(Protocol):
    """A registered endpoint the worker signs its requests to (reward functions, environments)."""

    signing_secret: str
    previous_signing_secret: str | None
    previous_secret_expires_at: datetime | None
    updated_at: datetime


def replace_secret(row: SignedEndpoint) -> None:
    """A new signing secret; the replaced one keeps signing until the overlap ends, and a rotation within the
    overlap drops the older secret at once."""
    now = utcnow()
    until = rotation_overlap_end(now)
    row.previous_signing_secret = row.signing_secret if until is not None else None
    row.previous_secret_expires_at = until
    row.signing_secret = new_signing_secret()
    row.updated_at = now


def get_for_job(session: Session, rf_id: str) -> RewardFunction:
    """The row a job's remote reward refers to, even if deleted since (worker side, no tenant filter)."""
    row = repository.get_for_job(session, rf_id)
    if row is None:
        raise NotFound("reward function", rf_id)
    return row
