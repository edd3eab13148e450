"""`Idempotency-Key` for POST /v1/jobs: at most one job per (tenant, key), whatever the concurrency.

Protocol (insert-first claim; the database's primary key on (tenant_id, key) arbitrates races on
SQLite and PostgreSQL alike):

1. **claim**: INSERT an `in_flight` row and commit it at once, before any work.
   - The INSERT fails on the key -> read the row that won:
     different request hash -> 422 `idempotency_key_reused`; `in_flight` -> 409
     `idempotency_key_in_flight`; `completed` -> replay the stored status code and body.
   - A row older than settings.idempotency_ttl_hours is expired and may be claimed afresh; an
     `in_flight` row older than IN_FLIGHT_ABANDONED belonged to a process that died mid-request.
2. **work**: create the job and mark the row `completed` with the response in the *same*
   transaction, so the job exists exactly when the stored response does.
3. **release** on failure: delete our `in_flight` row, so the client may retry with that key
   (a request that failed left nothing behind to be idempotent about).

This is boundary code (like session_scope): it commits the caller's session between the steps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.jobs import repository
from service.jobs.models import IdempotencyKey
from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import IdempotencyInFlight, IdempotencyMismatch, ValidationFailed

IN_FLIGHT = "in_flight"
COMPLETED = "completed"
IN_FLIGHT_ABANDONED = timedelta(minutes=10)
MAX_KEY_LENGTH = 255
_CLAIM_TRIES = 5


@dataclass(frozen=True)
class Outcome:
    status_code: int
    body: dict[str, Any]
    replayed: bool


def request_hash(payload: Any) -> str:
    """sha256 of the canonical JSON of the validated request: equal requests hash equal."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_key(key: str) -> str:
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not key.isascii() or not key.isprintable():
        raise ValidationFailed(
            f"Idempotency-Key: must be 1-{MAX_KEY_LENGTH} printable ASCII characters",
            details=[
                {
                    "field": "header.Idempotency-Key",
                    "message": "invalid idempotency key",
                    "type": "value_error",
                }
            ],
        )
    return key


def run_idempotent(
    session: Session,
    tenant_id: str,
    key: str,
    req_hash: str,
    work: Callable[[Session], tuple[int, dict[str, Any]]],
) -> Outcome:
    """Run `work` (returns status code and JSON body) at most once per (tenant, key); commits."""
    check_key(key)
    replay = _claim(session, tenant_id, key, req_hash)
    if replay is not None:
        return replay
    try:
        status_code, body = work(session)
        row = repository.get_idempotency_key(session, tenant_id, key)
        assert row is not None and row.state == IN_FLIGHT  # we hold the claim
        row.state = COMPLETED
        row.status_code = status_code
        row.response = body
        row.completed_at = utcnow()
        session.commit()
    except BaseException:
        session.rollback()
        _release(session, tenant_id, key, req_hash)
        raise
    return Outcome(status_code, body, replayed=False)


def _claim(session: Session, tenant_id: str, key: str, req_hash: str) -> Outcome | None:
    # End the caller's read transaction first: on SQLite an INSERT in a transaction whose snapshot is
    # stale fails at once ("database is locked") instead of waiting for the write lock.
    session.commit()
    for _ in range(_CLAIM_TRIES):
        created_at = utcnow()
        session.add(
            IdempotencyKey(
                tenant_id=tenant_id, key=key, request_hash=req_hash, state=IN_FLIGHT, created_at=created_at
            )
        )
        try:
            session.commit()
            return None
        except IntegrityError:
            session.rollback()
        row = repository.get_idempotency_key(session, tenant_id, key)
        if row is None:
            continue  # released between our INSERT and this read: try again
        if _expired(row, created_at):
            repository.delete_idempotency_key(session, tenant_id, key, created_at=row.created_at)
            session.commit()
            continue
        session.commit()  # end the read transaction; nothing to write
        if row.request_hash != req_hash:
            raise IdempotencyMismatch(
                "Idempotency-Key was already used with a different request body",
                details={"idempotency_key": key},
            )
        if row.state == IN_FLIGHT:
            raise IdempotencyInFlight(
                "a request with this Idempotency-Key is still being processed; retry later",
                details={"idempotency_key": key},
            )
        assert row.status_code is not None and row.response is not None
        return Outcome(row.status_code, row.response, replayed=True)
    raise IdempotencyInFlight("Idempotency-Key is contended; retry later", details={"idempotency_key": key})


def _expired(row: IdempotencyKey, now: datetime) -> bool:
    if row.created_at < now - timedelta(hours=get_settings().idempotency_ttl_hours):
        return True
    return row.state == IN_FLIGHT and row.created_at < now - IN_FLIGHT_ABANDONED


def _release(session: Session, tenant_id: str, key: str, req_hash: str) -> None:
    row = repository.get_idempotency_key(session, tenant_id, key)
    if row is not None and row.state == IN_FLIGHT and row.request_hash == req_hash:
        repository.delete_idempotency_key(session, tenant_id, key, created_at=row.created_at)
    session.commit()


def purge_expired(session: Session, now: datetime) -> int:
    """Delete keys created more than the TTL before `now`; returns how many. Run by the reaper (service/execution/reaper.py);
    claims also expire lazily. Does not commit."""
    cutoff = now - timedelta(hours=get_settings().idempotency_ttl_hours)
    return repository.delete_idempotency_keys_before(session, cutoff)
