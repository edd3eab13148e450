"""The primitive training API: sessions, training clients (a LoRA adapter on a resident base model), sampling
sessions and the requests whose results are futures. The Tinker door (service.tinker) speaks it in Tinker's
shapes; the primitives worker (worker.primitives) runs the requests.

Rules:
- Every row belongs to a tenant; another tenant's id reads exactly as an unknown one (404).
- A training client's calls carry `seq_id` 1, 2, ... (0 is its creation) and run in that order: a call whose
  `seq_id` was already used answers the same request (a client's retry), one whose predecessors have already
  run is refused, and one that arrives early waits for them.
- Saved weights are addressed `tinker://<training client>/<weights|sampler_weights>/<name>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.tinker import paths
from contract.tinker.paths import parse_weights_path
from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import DomainError, NotFound, ValidationFailed
from service.kit.ids import new_id
from service.primitives import repository
from service.primitives.models import (
    PrimitiveRequest,
    PrimitiveSession,
    PrimitiveWeights,
    PrimitiveWorker,
    SamplingSession,
    TrainingClient,
)
from service.usage.budget import refuse_if_tenant_exhausted


class SessionGone(DomainError):
    """The session was finished, or closed after its heartbeats stopped."""

    code = "session_closed"
    http_status = 410
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class SequenceConflict(DomainError):
    """A call's seq_id comes after its successors already ran: it cannot be run in order any more."""

    code = "seq_id_out_of_order"
    http_status = 409
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class Future:
    """A request's state as `retrieve_future` answers it."""

    status: str  # pending | running | done | failed
    result: bytes | None
    media: str
    error: dict[str, Any] | None
    operation: str


@dataclass(frozen=True)
class ModelInfo:
    base_model: str
    tokenizer_id: str | None
    arch: str | None
    max_context_length: int | None


# --- sessions ------------------------------------------------------------------------------------------


def start_session(session: Session, tenant_id: str, sdk_version: str, tags: list[str],
                  user_metadata: dict[str, Any]) -> str:
    row = PrimitiveSession(id=new_id("ses"), tenant_id=tenant_id, sdk_version=sdk_version[:64], tags=tags,
                           user_metadata=user_metadata)
    repository.add(session, row)
    return row.id


def heartbeat(session: Session, tenant_id: str, session_id: str) -> None:
    if not repository.touch_session(session, tenant_id, session_id, utcnow()):
        _open_session(session, tenant_id, session_id)  # raises: unknown (404) or closed (410)


def finish_session(session: Session, tenant_id: str, session_id: str) -> None:
    row = repository.get_session(session, tenant_id, session_id)
    if row is None:
        raise NotFound("session", session_id)
    repository.close_session(session, row.id, utcnow())


def _open_session(session: Session, tenant_id: str, session_id: str) -> PrimitiveSession:
    row = repository.get_session(session, tenant_id, session_id)
    if row is None:
        raise NotFound("session", session_id)
    if row.closed_at is not None:
        raise SessionGone(f"session {session_id!r} is closed; create a new one")
    return row


# --- training clients ----------------------------------------------------------------------------------


def supported_models() -> list[str]:
    return list(get_settings().primitives_base_models)


def check_base_model(field: str, base_model: str) -> None:
    served = supported_models()
    if base_model not in served:
        raise ValidationFailed(
            f"{field}: base model {base_model!r} is not served here (served: {', '.join(served) or 'none'})",
            details=[{"field": field, "message": "base model not served"}],
        )


def create_training_client(session: Session, tenant_id: str, session_id: str, model_seq_id: int,
                           base_model: str, lora: dict[str, Any]) -> tuple[str, str]:
    """A new training client, named `<session>:train:<model_seq_id>` as the SDK expects; returns its id and the
    id of its creation request (seq 0), which a worker serving `base_model` runs."""
    _open_session(session, tenant_id, session_id)
    check_base_model("base_model", base_model)
    refuse_if_tenant_exhausted(session, tenant_id)
    client_id = f"{session_id}:train:{model_seq_id}"
    existing = repository.get_training_client(session, tenant_id, client_id)
    if existing is not None:  # the SDK's retry of the same creation
        return client_id, _request_at(session, client_id, 0).id
    repository.add(session, TrainingClient(id=client_id, tenant_id=tenant_id, session_id=session_id,
                                           base_model=base_model, lora=lora))
    return client_id, _add_request(session, tenant_id, client_id, "create_model", 0, b"").id


def create_training_client_from_weights(session: Session, tenant_id: str, session_id: str, model_seq_id: int,
                                        path: str, optimizer: bool) -> tuple[str, str]:
    """A new training client whose first request loads saved state (`path`): its base model and LoRA shape
    are the saved ones."""
    _open_session(session, tenant_id, session_id)
    weights = resolve_weights(session, tenant_id, path, "path")
    client_id = f"{session_id}:train:{model_seq_id}"
    if repository.get_training_client(session, tenant_id, client_id) is not None:
        return client_id, _request_at(session, client_id, 0).id
    repository.add(session, TrainingClient(id=client_id, tenant_id=tenant_id, session_id=session_id,
                                           base_model=weights.base_model, lora=dict(weights.lora)))
    body = _json_body({"weights_id": weights.id, "optimizer": optimizer})
    return client_id, _add_request(session, tenant_id, client_id, "create_from_weights", 0, body).id


def training_client(session: Session, tenant_id: str, client_id: str) -> TrainingClient:
    row = repository.get_training_client(session, tenant_id, client_id)
    if row is None:
        raise NotFound("model", client_id)
    return row


def model_info(session: Session, base_model: str) -> ModelInfo:
    """What the live workers serving `base_model` published about it (tokenizer, architecture)."""
    for worker in session.scalars(select(PrimitiveWorker).order_by(PrimitiveWorker.heartbeat_at.desc())).all():
        if base_model in worker.models:
            facts = worker.models[base_model]
            return ModelInfo(base_model, facts.get("tokenizer_id"), facts.get("arch"),
                             facts.get("max_context_length"))
    return ModelInfo(base_model, None, None, None)


def submit(session: Session, tenant_id: str, client_id: str, operation: str, seq_id: int, body: bytes) -> str:
    """Queue a training client's call; returns its request id (the same one for a repeated `seq_id`)."""
    client = repository.get_training_client(session, tenant_id, client_id, for_update=True)
    if client is None:
        raise NotFound("model", client_id)
    if client.closed_at is not None:
        raise SessionGone(f"model {client_id!r} belongs to a closed session; create a new training client")
    if seq_id < 1:
        raise ValidationFailed(f"seq_id: must be at least 1 (got {seq_id})",
                               details=[{"field": "seq_id", "message": "must be at least 1"}])
    existing = _request_at(session, client_id, seq_id, required=False)
    if existing is not None:
        return existing.id
    refuse_if_tenant_exhausted(session, tenant_id)  # the monthly caps count these calls too
    if seq_id <= client.last_seq_id:
        raise SequenceConflict(
            f"seq_id {seq_id} of model {client_id!r} arrived after call {client.last_seq_id} ran; "
            "calls run in seq_id order",
            details={"seq_id": seq_id, "last_run_seq_id": client.last_seq_id},
        )
    return _add_request(session, tenant_id, client_id, operation, seq_id, body).id


def refuse(session: Session, tenant_id: str, client_id: str, operation: str, seq_id: int, message: str) -> None:
    """Record a call the door refused as failed, so that its seq_id's turn passes at once (the client's later
    calls would otherwise wait for it)."""
    client = repository.get_training_client(session, tenant_id, client_id)
    if client is None or seq_id <= client.last_seq_id or _request_at(session, client_id, seq_id, required=False):
        return
    row = _add_request(session, tenant_id, client_id, operation, seq_id, b"")
    row.status, row.error = "failed", {"error": message, "category": "user"}


def resolve_weights(session: Session, tenant_id: str, path: str, field: str) -> PrimitiveWeights:
    """The saved weights `tinker://<model>/<weights|sampler_weights>/<name>` of this tenant (404 otherwise)."""
    address = parse_weights_path(path)
    if address is None:
        raise ValidationFailed(
            f"{field}: {path!r} is not a weights path (tinker://<model_id>/weights/<name> or "
            "tinker://<model_id>/sampler_weights/<name>)",
            details=[{"field": field, "message": "not a tinker:// weights path"}],
        )
    row = repository.get_weights(session, tenant_id, *address)
    if row is None:
        raise NotFound("weights", path)
    return row


def weights_path(row: PrimitiveWeights) -> str:
    return paths.weights_path(row.training_client_id, row.kind, row.name)


# --- sampling sessions ---------------------------------------------------------------------------------


def create_sampling_session(session: Session, tenant_id: str, session_id: str, seq: int, *,
                            base_model: str | None, model_path: str | None) -> str:
    _open_session(session, tenant_id, session_id)
    sampler_id = f"{session_id}:sample:{seq}"
    if repository.get_sampling_session(session, tenant_id, sampler_id) is not None:
        return sampler_id
    weights = resolve_weights(session, tenant_id, model_path, "model_path") if model_path else None
    if weights is None:
        if base_model is None:
            raise ValidationFailed("base_model: give base_model or model_path",
                                   details=[{"field": "base_model", "message": "required without model_path"}])
        check_base_model("base_model", base_model)
    repository.add(session, SamplingSession(
        id=sampler_id, tenant_id=tenant_id, session_id=session_id,
        base_model=weights.base_model if weights else str(base_model), weights_id=weights.id if weights else None,
    ))
    return sampler_id


def sampling_session(session: Session, tenant_id: str, sampler_id: str) -> tuple[SamplingSession, str | None]:
    """The sampler and the tinker:// path of its weights (None for a base model)."""
    row = repository.get_sampling_session(session, tenant_id, sampler_id)
    if row is None:
        raise NotFound("sampler", sampler_id)
    weights = session.get(PrimitiveWeights, row.weights_id) if row.weights_id else None
    return row, weights_path(weights) if weights else None


def submit_sample(session: Session, tenant_id: str, sampler_id: str, seq_id: int, body: bytes) -> str:
    """Queue a sampling request. Samplers run requests as they come: `seq_id` names a request (a repeated one
    answers the same request), it does not order them."""
    sampler, _ = sampling_session(session, tenant_id, sampler_id)
    _open_session(session, tenant_id, sampler.session_id)
    existing = _request_at(session, sampler_id, seq_id, required=False)
    if existing is not None:
        return existing.id
    refuse_if_tenant_exhausted(session, tenant_id)
    return _add_request(session, tenant_id, sampler_id, "sample", seq_id, body).id


# --- futures -------------------------------------------------------------------------------------------


def future(session: Session, tenant_id: str, request_id: str) -> Future:
    row = repository.get_request(session, tenant_id, request_id)
    if row is None:
        raise NotFound("request", request_id)
    return Future(row.status, row.result, row.media, row.error, row.operation)


def _add_request(session: Session, tenant_id: str, target_id: str, operation: str, seq_id: int,
                 body: bytes) -> PrimitiveRequest:
    row = PrimitiveRequest(id=new_id("req"), tenant_id=tenant_id, target_id=target_id, operation=operation,
                           seq_id=seq_id, body=body)
    repository.add(session, row)
    return row


def _request_at(session: Session, target_id: str, seq_id: int, *, required: bool = True) -> Any:
    row = session.scalars(
        select(PrimitiveRequest).where(PrimitiveRequest.target_id == target_id, PrimitiveRequest.seq_id == seq_id)
    ).first()
    if row is None and required:
        raise NotFound("request", f"{target_id}#{seq_id}")
    return row


def _json_body(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()
