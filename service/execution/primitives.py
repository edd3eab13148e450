"""The primitives worker's side of the primitive training API: which training clients and sampling sessions it
holds, the next request of each in `seq_id` order, and the request's outcome.

A worker serves the base models it has loaded. It takes new training clients and sampling sessions of those
models (`adopt`), runs their requests one at a time in `seq_id` order (`next_requests`), and writes each
outcome once (`finish`, `fail`): the row's status moves from running only to done or failed, and only for the
worker that holds it. Requests of a worker that stopped are failed by `fail_orphaned` as retryable, so clients
resubmit (a training client's state is then restored with load_weights). Saved weights are recorded together
with a checkpoint of their tenant (`record_weights`), so they download and train like a job's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from contract.tinker.paths import weights_path
from service.checkpoints.service import add_tinker_checkpoint
from service.kit.db import session_scope, utcnow
from service.kit.ids import new_id
from service.primitives.models import (
    PrimitiveRequest,
    PrimitiveSession,
    PrimitiveWeights,
    PrimitiveWorker,
    SamplingSession,
    TrainingClient,
)
from service.primitives.repository import close_session, get_weights
from service.storage import get_storage
from service.usage.models import PrimitiveUsage
from service.usage.repository import record_call

# How long a training client's call waits for a missing predecessor (a seq_id that never arrived).
SEQ_GAP_WAIT = timedelta(seconds=5)


@dataclass(frozen=True)
class Target:
    """A training client or sampling session a worker holds."""

    id: str
    tenant_id: str
    kind: str  # "training" | "sampling"
    base_model: str
    lora: dict[str, Any] | None  # training clients
    weights_path: str | None  # sampling sessions over saved weights: their storage path


@dataclass(frozen=True)
class PendingRequest:
    id: str
    tenant_id: str
    target_id: str
    operation: str
    seq_id: int
    body: bytes


@dataclass(frozen=True)
class WeightsRecord:
    """Saved weights a request names (load_weights): where they are and what they fit."""

    storage_path: str
    base_model: str
    lora: dict[str, Any]
    path: str  # tinker://<training client>/<weights|sampler_weights>/<name>


def adopt(worker: str, base_models: Sequence[str]) -> list[Target]:
    """Take the unassigned, open training clients and sampling sessions of `base_models`."""
    with session_scope() as session:
        clients = session.scalars(
            select(TrainingClient)
            .where(
                TrainingClient.worker.is_(None),
                TrainingClient.closed_at.is_(None),
                TrainingClient.base_model.in_(list(base_models)),
            )
            .with_for_update(skip_locked=True)
        ).all()
        samplers = session.scalars(
            select(SamplingSession)
            .where(SamplingSession.worker.is_(None), SamplingSession.base_model.in_(list(base_models)))
            .with_for_update(skip_locked=True)
        ).all()
        targets = [
            Target(row.id, row.tenant_id, "training", row.base_model, dict(row.lora), None) for row in clients
        ]
        for sampler in samplers:
            weights = session.get(PrimitiveWeights, sampler.weights_id) if sampler.weights_id else None
            targets.append(
                Target(sampler.id, sampler.tenant_id, "sampling", sampler.base_model, None,
                       weights.storage_path if weights else None)
            )
        for client in clients:
            client.worker = worker
        for sampler in samplers:
            sampler.worker = worker
        return targets


def closed_targets(worker: str, held: Sequence[str]) -> list[str]:
    """Which of the held targets' sessions have closed (finished, or their heartbeats stopped)."""
    if not held:
        return []
    with session_scope() as session:
        closed_clients = session.scalars(
            select(TrainingClient.id).where(
                TrainingClient.id.in_(list(held)), TrainingClient.closed_at.is_not(None)
            )
        ).all()
        closed_samplers = session.scalars(
            select(SamplingSession.id)
            .join(PrimitiveSession, PrimitiveSession.id == SamplingSession.session_id)
            .where(SamplingSession.id.in_(list(held)), PrimitiveSession.closed_at.is_not(None))
        ).all()
        return [*closed_clients, *closed_samplers]


def next_requests(worker: str, held: Sequence[str], *, now: datetime | None = None) -> list[PendingRequest]:
    """The next request of each held target, marked running for `worker`: for a sampler the oldest; for a
    training client the one right after the last that ran, in seq_id order. Calls the door refused (failed rows)
    count as run. A call that arrived early waits for its predecessors, but at most SEQ_GAP_WAIT: a seq_id that
    never comes (its request was lost on the way) must not stall the client for good."""
    if not held:
        return []
    now = now or utcnow()
    with session_scope() as session:
        last_run = dict(
            session.execute(
                select(TrainingClient.id, TrainingClient.last_seq_id).where(TrainingClient.id.in_(list(held)))
            ).tuples().all()
        )
        rows = session.scalars(
            select(PrimitiveRequest)
            .where(
                PrimitiveRequest.target_id.in_(list(held)),
                (PrimitiveRequest.status == "pending")
                | ((PrimitiveRequest.status == "failed") & PrimitiveRequest.worker.is_(None)),  # refused at the door
            )
            .order_by(PrimitiveRequest.target_id, PrimitiveRequest.seq_id)
        ).all()
        chosen: dict[str, PrimitiveRequest] = {}
        for row in rows:
            if row.target_id in chosen:
                continue
            if row.target_id not in last_run:  # a sampler: any order
                if row.status == "pending":
                    chosen[row.target_id] = row
                continue
            expected = last_run[row.target_id] + 1
            if row.seq_id < expected:
                continue
            if row.status == "failed":  # refused by the door: its turn is over
                if row.seq_id == expected:
                    last_run[row.target_id] = row.seq_id
                    _advance(session, row.target_id, row.seq_id)
                continue
            if row.seq_id == expected or row.created_at < now - SEQ_GAP_WAIT:
                chosen[row.target_id] = row
        for row in chosen.values():
            row.status, row.worker = "running", worker
        return [
            PendingRequest(r.id, r.tenant_id, r.target_id, r.operation, r.seq_id, r.body) for r in chosen.values()
        ]


def _advance(session: Session, client_id: str, seq_id: int) -> None:
    session.execute(
        update(TrainingClient)
        .where(TrainingClient.id == client_id, TrainingClient.last_seq_id < seq_id)
        .values(last_seq_id=seq_id)
    )


@dataclass(frozen=True)
class CallUsage:
    """What a call cost: tokens sampled, tokens through the model (forward, forward_backward), device time."""

    tokens_generated: int = 0
    tokens_trained: int = 0
    device_seconds: float = 0.0


def finish(worker: str, request_id: str, result: bytes, media: str, usage: CallUsage | None = None) -> None:
    _settle(worker, request_id, status="done", result=result, media=media, error=None, usage=usage)


def fail(worker: str, request_id: str, message: str, category: str, usage: CallUsage | None = None) -> None:
    """`category` "user" (bad input: resubmitting the same call fails the same way) or "server"."""
    _settle(worker, request_id, status="failed", result=None, media="json",
            error={"error": message, "category": category}, usage=usage)


def _settle(worker: str, request_id: str, *, status: str, result: bytes | None, media: str,
            error: dict[str, Any] | None, usage: CallUsage | None) -> None:
    """Write the call's outcome once (only the worker running it can) and, in the same transaction, its usage."""
    with session_scope() as session:
        settled = session.execute(
            update(PrimitiveRequest)
            .where(
                PrimitiveRequest.id == request_id,
                PrimitiveRequest.worker == worker,
                PrimitiveRequest.status == "running",
            )
            .values(status=status, result=result, media=media, error=error, finished_at=utcnow())
        )
        request = session.get(PrimitiveRequest, request_id)
        if request is None or not settled.rowcount:  # type: ignore[attr-defined]
            return
        _advance(session, request.target_id, request.seq_id)  # a training client's next call may run now
        if usage is not None:
            record_call(session, PrimitiveUsage(
                tenant_id=request.tenant_id, request_id=request.id, target_id=request.target_id,
                operation=request.operation, tokens_generated=usage.tokens_generated,
                tokens_trained=usage.tokens_trained, device_seconds=usage.device_seconds,
            ))


def saved_weights(tenant_id: str, client_id: str, kind: str, name: str) -> WeightsRecord | None:
    """The tenant's saved weights by their path's parts (None for another tenant's, as for unknown ones)."""
    with session_scope() as session:
        row = get_weights(session, tenant_id, client_id, kind, name)
        return None if row is None else _record(row)


def weights_by_id(tenant_id: str, weights_id: str) -> WeightsRecord | None:
    with session_scope() as session:
        row = session.get(PrimitiveWeights, weights_id)
        return None if row is None or row.tenant_id != tenant_id else _record(row)


def _record(row: PrimitiveWeights) -> WeightsRecord:
    return WeightsRecord(row.storage_path, row.base_model, dict(row.lora),
                         weights_path(row.training_client_id, row.kind, row.name))


@dataclass(frozen=True)
class SavedWeights:
    """Recorded weights: the saved weights' row (what tinker:// paths resolve to) and the tenant's checkpoint
    of this save (GET /v1/checkpoints/{id}, `checkpoint:<id>` in jobs and evaluations)."""

    weights_id: str
    checkpoint_id: str
    path: str  # tinker://<training client>/<weights|sampler_weights>/<name>


def weights_base_model(tenant_id: str, client_id: str) -> str:
    """The base model a training client adapts, by the name it was created with (e.g. `builtin:tiny-instruct`):
    what its saved adapters name as their base (adapter_config.json's base_model_name_or_path)."""
    with session_scope() as session:
        client = session.get(TrainingClient, client_id)
        assert client is not None and client.tenant_id == tenant_id
        return client.base_model


def record_weights(tenant_id: str, client_id: str, kind: str, name: str, storage_path: str,
                   files: Mapping[str, Mapping[str, Any]]) -> SavedWeights:
    """Record weights a training client saved under `storage_path` (replacing an earlier save under the same
    name), with the tenant's checkpoint of them (`files`: {relative path: {"size", "sha256"}}, every file
    uploaded; service.checkpoints.service.add_tinker_checkpoint), in one transaction."""
    with session_scope() as session:
        client = session.get(TrainingClient, client_id)
        assert client is not None and client.tenant_id == tenant_id
        row = get_weights(session, tenant_id, client_id, kind, name)
        if row is None:
            row = PrimitiveWeights(id=new_id("wts"), tenant_id=tenant_id, training_client_id=client_id,
                                   kind=kind, name=name, base_model=client.base_model, lora=dict(client.lora),
                                   storage_path=storage_path)
            session.add(row)
        else:
            row.storage_path, row.created_at = storage_path, utcnow()
        path = _record(row).path
        checkpoint = add_tinker_checkpoint(session, get_storage(), tenant_id, tinker_path=path,
                                           storage_path=storage_path, files=files)
        return SavedWeights(row.id, checkpoint.id, path)


def open_sampler(worker: str, client_id: str, sampler_id: str, weights_id: str) -> None:
    """A sampling session over weights this worker just saved, held by this worker (which has them loaded)."""
    with session_scope() as session:
        client = session.get(TrainingClient, client_id)
        assert client is not None
        if session.get(SamplingSession, sampler_id) is None:
            session.add(SamplingSession(id=sampler_id, tenant_id=client.tenant_id, session_id=client.session_id,
                                        base_model=client.base_model, weights_id=weights_id, worker=worker))


def close_silent_sessions(timeout: timedelta) -> int:
    """Close the sessions whose heartbeats stopped `timeout` ago (their clients' memory is then freed)."""
    now = utcnow()
    with session_scope() as session:
        silent = session.scalars(
            select(PrimitiveSession.id).where(
                PrimitiveSession.closed_at.is_(None), PrimitiveSession.heartbeat_at < now - timeout
            )
        ).all()
        for session_id in silent:
            close_session(session, session_id, now)
        return len(silent)


def heartbeat(worker: str, models: Mapping[str, Mapping[str, Any]]) -> None:
    """Say this worker is alive, and what it serves (base model -> tokenizer_id, arch, max_context_length,
    vocab_size); called every loop."""
    with session_scope() as session:
        row = session.get(PrimitiveWorker, worker)
        if row is None:
            session.add(PrimitiveWorker(name=worker, models={name: dict(facts) for name, facts in models.items()}))
        else:
            row.heartbeat_at = utcnow()


def release_lapsed_workers(stale_after: timedelta, now: datetime | None = None) -> int:
    """For each worker silent for `stale_after`: fail its running and pending requests as retryable and hand
    its training clients and sampling sessions back, so that another worker (or it, restarted) adopts them
    with fresh state. Returns how many requests were failed."""
    now = now or utcnow()
    error = {"error": "the worker holding this model stopped; its state is lost: load_weights, then resubmit",
             "category": "server"}
    with session_scope() as session:
        lapsed = session.scalars(
            select(PrimitiveWorker.name).where(PrimitiveWorker.heartbeat_at < now - stale_after)
        ).all()
        if not lapsed:
            return 0
        targets = [
            *session.scalars(select(TrainingClient.id).where(TrainingClient.worker.in_(lapsed))).all(),
            *session.scalars(select(SamplingSession.id).where(SamplingSession.worker.in_(lapsed))).all(),
        ]
        failed = session.execute(
            update(PrimitiveRequest)
            .where(PrimitiveRequest.target_id.in_(targets), PrimitiveRequest.status.in_(("pending", "running")))
            .values(status="failed", finished_at=now, error=error)
        )
        last_seq = session.execute(
            select(PrimitiveRequest.target_id, func.max(PrimitiveRequest.seq_id))
            .where(PrimitiveRequest.target_id.in_(targets))
            .group_by(PrimitiveRequest.target_id)
        ).tuples().all()
        for target_id, seq_id in last_seq:  # the failed calls count as run: the client's next ones may go
            session.execute(update(TrainingClient).where(TrainingClient.id == target_id).values(last_seq_id=seq_id))
        session.execute(update(TrainingClient).where(TrainingClient.worker.in_(lapsed)).values(worker=None))
        session.execute(update(SamplingSession).where(SamplingSession.worker.in_(lapsed)).values(worker=None))
        session.execute(delete(PrimitiveWorker).where(PrimitiveWorker.name.in_(lapsed)))
        return int(failed.rowcount)  # type: ignore[attr-defined]
