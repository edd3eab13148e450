"""The environment registry: register (after reading the server's `/health` and `/schema` and opening a session
over its `WS /ws`), read, check again, delete, rotate the signing secret.

The URL policy, secrets and their rotation are the reward functions' (service.rewards.service): an environment is
one more user endpoint the worker calls, signed the same way. Registration refuses a server that does not answer
as OpenEnv does, so a job never starts against a URL that was wrong from the beginning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import grpc
from sqlalchemy.orm import Session

from outbound.openenv_probe import EnvironmentInvalid, EnvironmentUnavailable, ProbeResult, probe
from outbound.openenv_session import (
    EnvironmentBusy,
    EnvironmentConfig,
    EnvironmentDown,
    EpisodeFailed,
    check_session,
)
from outbound.urlpolicy import UrlRejected
from service.environments import repository
from service.environments.models import Environment
from service.environments.schemas import EnvironmentCreate
from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import DomainError, NotFound, UrlNotAllowed
from service.kit.ids import new_id
from service.kit.paging import page
from service.rewards.service import (
    check_registration_url,
    new_signing_secret,
    previous_secret_in_overlap,
    replace_secret,
    run_blocking,
)

KIND = "environment"
# A check holds an API request open while the server answers: at most this long, whatever step_timeout_s says.
CHECK_TIMEOUT_S = 30.0


class EnvironmentUnreachable(DomainError):
    """No answer from the server (refused, timed out, 5xx, not healthy): start it, or check the URL."""

    code = "environment_unreachable"
    http_status = 424
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class EnvironmentNotOpenEnv(DomainError):
    """The server answered, but not as an OpenEnv server does (4xx, a redirect, not JSON, no schemas)."""

    code = "environment_invalid_response"
    http_status = 422
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class Check:
    """What one check read: `/health` and `/schema`, then a session over `WS /ws`."""

    probe: ProbeResult
    session_status: str


def _session_config(env_id: str, url: str, keys: tuple[str, str | None, datetime | None], headers: dict[str, str],
                    step_timeout_s: float) -> EnvironmentConfig:
    # One attempt and a short episode: a check must not hold the API request for a job's patience.
    secret, previous, until = keys
    return EnvironmentConfig(
        environment_id=env_id, url=url, secret=secret, previous_secret=previous, previous_secret_until=until,
        headers=headers, step_timeout_s=min(step_timeout_s, CHECK_TIMEOUT_S), episode_timeout_s=CHECK_TIMEOUT_S,
        max_attempts=1, allow_private=bool(get_settings().allow_private_reward_urls),
    )


def _check(config: EnvironmentConfig) -> Check:
    """Read the server's health and schemas, then open a session and ask its state; each failure a DomainError
    naming the `url` field. A session refused for capacity passes: the server spoke the protocol."""
    details = {"field": "url", "url": config.url}
    timeout = min(config.step_timeout_s, CHECK_TIMEOUT_S)
    try:
        result = run_blocking(probe(config.url, keys=config.keys(), headers=dict(config.headers), timeout_s=timeout,
                                    allow_private=config.allow_private))
        try:
            run_blocking(check_session(config))
            session = "ok"
        except EnvironmentBusy:
            session = "at_capacity"
    except UrlRejected as exc:
        raise UrlNotAllowed(exc.message, details={**details, **(exc.details or {})}) from exc
    except (EnvironmentUnavailable, EnvironmentDown) as exc:
        raise EnvironmentUnreachable(f"url: environment server did not answer: {exc}", details=details) from exc
    except (EnvironmentInvalid, EpisodeFailed) as exc:
        raise EnvironmentNotOpenEnv(f"url: not an OpenEnv server: {exc}", details=details) from exc
    return Check(result, session)


def _record(row: Environment, check: Check) -> None:
    row.schemas = check.probe.schemas.model_dump()
    row.health_status = check.probe.status
    row.health_latency_ms = check.probe.latency_ms
    row.session_status = check.session_status
    row.checked_at = utcnow()


def create_environment(session: Session, tenant_id: str, spec: EnvironmentCreate) -> Environment:
    """Register a server: URL policy, then the check (`/health`, `/schema`, a session's state; signed with the new
    secret) before any SQL, so no transaction is open while it answers. Raises UrlNotAllowed,
    EnvironmentUnreachable, EnvironmentNotOpenEnv."""
    url = check_registration_url(spec.url, allow_private=bool(get_settings().allow_private_reward_urls))
    secret, env_id = new_signing_secret(), new_id("env")
    check = _check(_session_config(env_id, url, (secret, None, None), dict(spec.headers), spec.step_timeout_s))
    now = utcnow()
    row = Environment(
        id=env_id, tenant_id=tenant_id, name=spec.name, url=url,
        max_concurrency=spec.max_concurrency, step_timeout_s=spec.step_timeout_s,
        episode_timeout_s=spec.episode_timeout_s, max_attempts=spec.max_attempts, backoff_s=spec.backoff_s,
        breaker_threshold=spec.breaker_threshold, headers=dict(spec.headers), signing_secret=secret,
        created_at=now, updated_at=now,
    )
    _record(row, check)
    repository.add(session, row)
    return row


def get_environment(session: Session, tenant_id: str, env_id: str) -> Environment:
    row = repository.get(session, tenant_id, env_id)
    if row is None:
        raise NotFound(KIND, env_id)
    return row


def is_live(session: Session, tenant_id: str, env_id: str) -> bool:
    """Whether `env_id` is the tenant's and not deleted (what a job may name)."""
    return repository.get(session, tenant_id, env_id) is not None


def list_environments(
    session: Session, tenant_id: str, *, limit: int, after: str | None
) -> tuple[Sequence[Environment], bool]:
    """A page, newest first, and whether more follow."""
    rows = repository.list_page(session, tenant_id, limit=limit + 1, after=after)
    return page(rows, limit)


def check_environment(session: Session, tenant_id: str, env_id: str) -> Environment:
    """Read `/health` and `/schema` again and record them; a failure changes nothing and names the url."""
    row = get_environment(session, tenant_id, env_id)
    previous = previous_secret_in_overlap(row.previous_signing_secret, row.previous_secret_expires_at, utcnow())
    keys = (row.signing_secret, previous, row.previous_secret_expires_at if previous is not None else None)
    headers = {str(k): str(v) for k, v in row.headers.items()}
    _record(row, _check(_session_config(row.id, row.url, keys, headers, row.step_timeout_s)))
    row.updated_at = utcnow()
    session.flush()
    return row


def delete_environment(session: Session, tenant_id: str, env_id: str) -> None:
    row = repository.get(session, tenant_id, env_id, for_update=True)
    if row is None:
        raise NotFound(KIND, env_id)
    row.deleted_at = utcnow()
    session.flush()


def rotate_secret(session: Session, tenant_id: str, env_id: str) -> Environment:
    """A new signing secret; the replaced one still signs until the overlap ends (as for reward functions)."""
    row = repository.get(session, tenant_id, env_id, for_update=True)
    if row is None:
        raise NotFound(KIND, env_id)
    replace_secret(row)
    session.flush()
    return row
