"""The routes the official `tinker` SDK calls, under /tinker/api/v1 (so `TINKER_BASE_URL=https://host/tinker`).

Thin: each route checks the body's shape and hands it to the primitive training API (service.primitives).
Training and sampling calls answer `{"request_id"}` at once; `retrieve_future` holds the poll until the
worker's result is there or GRPO_PRIMITIVES_POLL_SECONDS pass (`try_again`). forward_backward comes in and
its result goes out as protobuf, sampling's result too; everything else is JSON. See docs/tinker.md.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from contract.tinker import requests as wire
from contract.tinker.arrays import WireError, call_identity, decode_forward_backward
from service.kit.config import get_settings
from service.kit.db import run_read, session_scope
from service.kit.deps import SessionDep
from service.kit.errors import DomainError, ValidationFailed
from service.primitives import service as primitives
from service.tinker.auth import TinkerReader, TinkerWriter

router = APIRouter(prefix="/api/v1", tags=["tinker"])
PROTOBUF = "application/x-protobuf"


def _invalid(error: ValueError, default_field: str) -> ValidationFailed:
    field = getattr(error, "field", default_field)
    return ValidationFailed(str(error), details=[{"field": field, "message": str(error)}])


# --- start-up and sessions -----------------------------------------------------------------------------


@router.post("/client/config", summary="SDK start-up: plain API-key auth, uncompressed protobuf, httpx transport")
async def client_config(body: wire.ClientConfig, _tenant: TinkerReader) -> dict[str, Any]:
    return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False}


@router.post("/create_session")
def create_session(body: wire.CreateSession, session: SessionDep, tenant: TinkerWriter) -> dict[str, Any]:
    session_id = primitives.start_session(session, tenant.tenant_id, body.sdk_version, body.tags, body.user_metadata)
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
def session_heartbeat(body: wire.SessionRef, session: SessionDep, tenant: TinkerReader) -> dict[str, Any]:
    primitives.heartbeat(session, tenant.tenant_id, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, session: SessionDep, tenant: TinkerWriter) -> dict[str, Any]:
    primitives.finish_session(session, tenant.tenant_id, session_id)
    return {}


@router.post("/telemetry", summary="The SDK's telemetry: accepted and dropped")
async def telemetry(_tenant: TinkerReader) -> dict[str, str]:
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def server_capabilities(_tenant: TinkerReader) -> dict[str, Any]:
    return {"supported_models": [
        {"model_name": name, "trainable": True, "sampleable": True} for name in primitives.supported_models()
    ]}


# --- training clients ----------------------------------------------------------------------------------


@router.post("/create_model")
def create_model(body: wire.CreateModel, session: SessionDep, tenant: TinkerWriter) -> dict[str, Any]:
    _, request_id = primitives.create_training_client(
        session, tenant.tenant_id, body.session_id, body.model_seq_id, body.base_model,
        body.lora_config.model_dump(),
    )
    return {"request_id": request_id}


@router.post("/get_info")
def get_info(body: wire.ModelRef, session: SessionDep, tenant: TinkerReader) -> dict[str, Any]:
    client = primitives.training_client(session, tenant.tenant_id, body.model_id)
    info = primitives.model_info(session, client.base_model)
    return {
        "type": "get_info", "model_id": client.id, "is_lora": True, "lora_rank": client.lora["rank"],
        "model_data": {"model_name": client.base_model, "tokenizer_id": info.tokenizer_id, "arch": info.arch},
    }


@router.post("/forward_backward", summary="A forward_backward (or forward-only) call, as protobuf")
async def forward_backward(request: Request, tenant: TinkerWriter) -> dict[str, Any]:
    raw = await request.body()
    try:
        call = await run_in_threadpool(decode_forward_backward, raw)
    except WireError as exc:
        if (identity := call_identity(raw)) is not None:
            model_id, seq_id = identity
            await run_in_threadpool(_refuse, tenant.tenant_id, model_id, "forward_backward", seq_id, str(exc))
        raise _invalid(exc, "body") from None
    operation = "forward" if call.forward_only else "forward_backward"
    return await run_in_threadpool(_submit, tenant.tenant_id, call.model_id, operation, call.seq_id, raw)


@router.post("/optim_step")
def optim_step(body: wire.OptimStep, session: SessionDep, tenant: TinkerWriter) -> dict[str, Any]:
    return _submit_in(session, tenant.tenant_id, body.model_id, "optim_step", body.seq_id, body.model_dump_json())


@router.post("/save_weights")
def save_weights(body: wire.SaveWeights, session: SessionDep, tenant: TinkerWriter) -> dict[str, Any]:
    return _submit_in(session, tenant.tenant_id, body.model_id, "save_weights", body.seq_id, body.model_dump_json())


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: wire.SaveWeightsForSampler, session: SessionDep,
                             tenant: TinkerWriter) -> dict[str, Any]:
    if (body.path is None) == (body.sampling_session_seq_id is None):
        message = "path: give a name (path) or sampling_session_seq_id, one of them"
        _refuse(tenant.tenant_id, body.model_id, "save_weights_for_sampler", body.seq_id, message)
        raise ValidationFailed(message, details=[{"field": "path", "message": "path or sampling_session_seq_id"}])
    client = primitives.training_client(session, tenant.tenant_id, body.model_id)
    if body.sampling_session_seq_id is not None:
        body.sampler_id = f"{client.session_id}:sample:{body.sampling_session_seq_id}"
    return _submit_in(session, tenant.tenant_id, body.model_id, "save_weights_for_sampler", body.seq_id,
                      body.model_dump_json())


@router.post("/load_weights")
def load_weights(body: wire.LoadWeights, session: SessionDep, tenant: TinkerWriter) -> dict[str, Any]:
    if body.model_id is None:  # create_training_client_from_state: a new client whose first call loads
        if body.session_id is None or body.model_seq_id is None:
            raise ValidationFailed("model_id: give model_id and seq_id, or session_id and model_seq_id",
                                   details=[{"field": "model_id", "message": "required"}])
        _, request_id = primitives.create_training_client_from_weights(
            session, tenant.tenant_id, body.session_id, body.model_seq_id, body.path, body.optimizer)
        return {"request_id": request_id}
    try:
        primitives.resolve_weights(session, tenant.tenant_id, body.path, "path")
    except DomainError as exc:  # this call's turn passes: the client's next calls need not wait for it
        _refuse(tenant.tenant_id, body.model_id, "load_weights", body.seq_id or 0, exc.message)
        raise
    return _submit_in(session, tenant.tenant_id, body.model_id, "load_weights", body.seq_id or 0,
                      body.model_dump_json())


# --- sampling ------------------------------------------------------------------------------------------


@router.post("/create_sampling_session")
def create_sampling_session(body: wire.CreateSamplingSession, session: SessionDep,
                            tenant: TinkerWriter) -> dict[str, Any]:
    sampler_id = primitives.create_sampling_session(
        session, tenant.tenant_id, body.session_id, body.sampling_session_seq_id,
        base_model=body.base_model, model_path=body.model_path,
    )
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, session: SessionDep, tenant: TinkerReader) -> dict[str, Any]:
    sampler, path = primitives.sampling_session(session, tenant.tenant_id, sampler_id)
    return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": path}


@router.post("/asample")
def asample(body: wire.Sample, session: SessionDep, tenant: TinkerWriter) -> dict[str, Any]:
    try:
        wire.prompt_tokens(body.prompt)
    except ValueError as exc:
        raise _invalid(exc, "prompt") from None
    request_id = primitives.submit_sample(session, tenant.tenant_id, body.sampling_session_id, body.seq_id,
                                          body.model_dump_json().encode())
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(body.num_samples)]}


# --- futures -------------------------------------------------------------------------------------------


@router.post("/retrieve_future", response_model=None, summary="A call's result; held until ready or the poll ends")
async def retrieve_future(body: wire.RetrieveFuture, request: Request, tenant: TinkerReader) -> Response:
    deadline = time.monotonic() + get_settings().primitives_poll_seconds
    delay = 0.01
    while True:
        future = await run_read(_read_future, tenant.tenant_id, body.request_id)
        if future.status == "done":
            media = PROTOBUF if future.media == "protobuf" else "application/json"
            return Response(content=future.result or b"{}", media_type=media)
        if future.status == "failed":
            return JSONResponse(content=future.error)
        if time.monotonic() >= deadline or await request.is_disconnected():
            return JSONResponse(content={"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)


def _read_future(tenant_id: str, request_id: str) -> primitives.Future:
    with session_scope() as session:
        return primitives.future(session, tenant_id, request_id)


def _refuse(tenant_id: str, model_id: str, operation: str, seq_id: int, message: str) -> None:
    """Record a refused training call in its own transaction (the request's is rolled back with the error)."""
    with session_scope() as session:
        primitives.refuse(session, tenant_id, model_id, operation, seq_id, message)


def _submit(tenant_id: str, model_id: str, operation: str, seq_id: int, body: bytes) -> dict[str, Any]:
    with session_scope() as session:
        return {"request_id": primitives.submit(session, tenant_id, model_id, operation, seq_id, body)}


def _submit_in(session: Session, tenant_id: str, model_id: str, operation: str, seq_id: int,
               body: str | bytes) -> dict[str, Any]:
    data = body.encode() if isinstance(body, str) else body
    return {"request_id": primitives.submit(session, tenant_id, model_id, operation, seq_id, data)}
