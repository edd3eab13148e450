"""The OpenAI-compatible routes under /openai/v1 (thin): OpenAI's shapes over the same domain services.

Files are our datasets, fine-tuning jobs our jobs (visible in /v1/jobs, gRPC, the CLI and SSE), events and
checkpoints theirs. Lists are ``{"object": "list", "data": [...], "has_more": ...}`` paged by ``after`` (an
id) and ``limit``. See docs/openai.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from contract.api.jobs import JobOut
from contract.fields import INT64_MAX
from contract.graders import GraderInvalid, grader_dump, parse_grader
from service.checkpoints import repository as checkpoint_rows
from service.datasets import service as datasets
from service.datasets.multipart import check_content_length, multipart_boundary, read_upload
from service.jobs import service as jobs
from service.jobs.idempotency import request_hash, run_idempotent
from service.jobs.schemas import event_out, job_out
from service.kit.config import get_settings
from service.kit.deps import SessionDep, reads_of
from service.kit.params import Cursor, PathId
from service.kit.queue import JobQueue, get_job_queue
from service.openai import graders
from service.openai.errors import OpenAIInvalid
from service.openai.grading import grading_pool
from service.openai.mapping import (
    JobCreate,
    checkpoint_object,
    dataset_id,
    event_object,
    file_object,
    job_object,
    to_job_spec,
)
from service.openai.mapping import file_id as file_id_of
from service.storage import get_storage
from service.tenants.auth import CurrentTenant

router = APIRouter(tags=["openai"])
QueueDep = Annotated[JobQueue, Depends(get_job_queue)]
Limit = Annotated[int, Query(ge=1, le=100)]


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def _fine_tuned_model(session: Session, job: JobOut) -> str | None:
    """A succeeded job's model: its last checkpoint, usable as `model` (or base_model) of another job."""
    if job.status.value != "succeeded":
        return None
    checkpoint_id = checkpoint_rows.latest_checkpoint_id(session, job.id)
    return f"checkpoint:{checkpoint_id}" if checkpoint_id else None


def _job(session: Session, job: JobOut, tenant_id: str) -> dict[str, Any]:
    return job_object(job, _fine_tuned_model(session, job), tenant_id)


# --- files ---------------------------------------------------------------------------------------------


@router.post("/files", summary="Upload a file (purpose fine-tune): a JSONL dataset, validated line by line")
async def upload_file(request: Request, session: SessionDep, tenant: CurrentTenant) -> JSONResponse:
    check_content_length(request.headers.get("content-length"), get_settings().max_dataset_bytes)
    boundary = multipart_boundary(request.headers.get("content-type"))
    ingest = await run_in_threadpool(datasets.begin_upload)
    try:
        form = await read_upload(request.stream(), boundary, ingest, extra_fields=frozenset({"purpose"}))
        purpose = form.extra.get("purpose")
        if purpose != "fine-tune":
            raise OpenAIInvalid("purpose", f"{purpose!r}: only 'fine-tune' files are accepted")
        name = datasets.clean_name(None, form.filename)
        row = await run_in_threadpool(datasets.create_dataset, session, tenant.tenant_id, name, ingest)
    except BaseException:
        await run_in_threadpool(ingest.abort)
        raise
    return JSONResponse(file_object(row))


@router.get("/files", summary="List files, newest first")
def list_files(
    session: SessionDep, tenant: CurrentTenant, limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    after: Cursor = None, purpose: str | None = None,
) -> dict[str, Any]:
    if purpose not in (None, "fine-tune"):
        return _page([], False)
    rows, has_more = datasets.list_datasets(session, tenant.tenant_id, limit=limit, after=after)
    return _page([file_object(r) for r in rows], has_more)


@router.get("/files/{file_id}", summary="Get a file")
def get_file(file_id: PathId, session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    return file_object(datasets.get_dataset(session, tenant.tenant_id, dataset_id(file_id)))


@router.delete("/files/{file_id}", summary="Delete a file (refused while an unfinished job uses it)")
def delete_file(file_id: PathId, session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    datasets.delete_dataset(session, tenant.tenant_id, dataset_id(file_id), in_use=jobs.dataset_in_use)
    return {"object": "file", "id": file_id_of(dataset_id(file_id)), "deleted": True}


@router.get("/files/{file_id}/content", summary="The file's bytes, as uploaded")
def file_content(file_id: PathId, session: SessionDep, tenant: CurrentTenant) -> StreamingResponse:
    row = datasets.get_dataset(session, tenant.tenant_id, dataset_id(file_id))
    handle = get_storage().open(row.storage_key)

    def chunks() -> Iterator[bytes]:
        with handle:
            while chunk := handle.read(1 << 16):
                yield chunk

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"content-length": str(row.bytes)})


# --- jobs ----------------------------------------------------------------------------------------------


@router.post("/fine_tuning/jobs", summary="Create a reinforcement fine-tuning job")
def create_job(
    body: JobCreate,
    tenant: CurrentTenant,
    session: SessionDep,
    queue: QueueDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    spec = to_job_spec(body)

    def work(s: Session) -> tuple[int, dict[str, Any]]:
        job = jobs.create_job(s, tenant.tenant_id, spec, queue)
        return 200, _job(s, job_out(job), tenant.tenant_id)

    if idempotency_key is None:
        status_code, content = work(session)
        return JSONResponse(content, status_code=status_code)
    outcome = run_idempotent(
        session, tenant.tenant_id, idempotency_key, request_hash({"openai": body.model_dump(mode="json")}), work
    )
    headers = {"Idempotent-Replayed": "true"} if outcome.replayed else None
    return JSONResponse(outcome.body, status_code=outcome.status_code, headers=headers)


@router.get("/fine_tuning/jobs", summary="List jobs, newest first")
async def list_jobs(
    request: Request, tenant: CurrentTenant, session: SessionDep, limit: Limit = 20, after: Cursor = None,
    metadata: Annotated[str | None, Query(include_in_schema=False)] = None,
) -> dict[str, Any]:
    page, has_more = await jobs.list_jobs(reads_of(request), tenant.tenant_id, status=None, limit=limit, after=after)
    data = await run_in_threadpool(lambda: [_job(session, job, tenant.tenant_id) for job in page])
    return _page(data, has_more)


@router.get("/fine_tuning/jobs/{job_id}", summary="Get a job")
async def get_job(job_id: PathId, request: Request, tenant: CurrentTenant, session: SessionDep) -> dict[str, Any]:
    job = await jobs.read_job(reads_of(request), tenant.tenant_id, job_id)
    return await run_in_threadpool(_job, session, job, tenant.tenant_id)


@router.post("/fine_tuning/jobs/{job_id}/cancel", summary="Cancel a job")
def cancel_job(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> dict[str, Any]:
    return _job(session, job_out(jobs.cancel_job(session, tenant.tenant_id, job_id)), tenant.tenant_id)


@router.post("/fine_tuning/jobs/{job_id}/pause", summary="Pause a job (at its next checkpoint when running)")
def pause_job(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> dict[str, Any]:
    return _job(session, job_out(jobs.pause_job(session, tenant.tenant_id, job_id)), tenant.tenant_id)


@router.post("/fine_tuning/jobs/{job_id}/resume", summary="Resume a paused job from its latest checkpoint")
def resume_job(job_id: PathId, tenant: CurrentTenant, session: SessionDep, queue: QueueDep) -> dict[str, Any]:
    job = jobs.resume_job(session, tenant.tenant_id, job_id, queue)
    return _job(session, job_out(job), tenant.tenant_id)


@router.get("/fine_tuning/jobs/{job_id}/events", summary="A job's events, oldest first")
def list_events(
    job_id: PathId, tenant: CurrentTenant, session: SessionDep, limit: Limit = 20, after: Cursor = None
) -> dict[str, Any]:
    rows, has_more = jobs.list_events(
        session, tenant.tenant_id, job_id, after=_event_cursor(after), limit=limit, types=None
    )
    return _page([event_object(event_out(r)) for r in rows], has_more)


def _event_cursor(after: str | None) -> int | None:
    """An event id from an earlier page: ASCII digits that fit the BIGINT id column (a larger number would make
    PostgreSQL refuse the query instead of finding nothing)."""
    if after is None:
        return None
    if not (after.isascii() and after.isdigit()) or int(after) > INT64_MAX:
        raise OpenAIInvalid("after", "must be an event id from an earlier page")
    return int(after)


@router.get("/fine_tuning/jobs/{job_id}/checkpoints", summary="A job's checkpoints, newest first")
def list_checkpoints(
    job_id: PathId, tenant: CurrentTenant, session: SessionDep, limit: Limit = 10, after: Cursor = None
) -> dict[str, Any]:
    rows = list(reversed(jobs.list_job_checkpoints(session, tenant.tenant_id, job_id)))
    if after is not None:
        ids = [r.id for r in rows]
        rows = rows[ids.index(after) + 1:] if after in ids else []
    return _page([checkpoint_object(r) for r in rows[:limit]], len(rows) > limit)


# --- graders -------------------------------------------------------------------------------------------


class GraderValidate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]


class GraderRun(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]
    model_sample: str
    item: Any = None
    reference_answer: Any = None  # sent by older SDKs; OpenAI reads the item instead


def _parsed(data: dict[str, Any]) -> Any:
    try:
        return parse_grader(data)
    except GraderInvalid as exc:
        raise OpenAIInvalid(exc.param, exc.message) from exc


@router.post("/fine_tuning/alpha/graders/validate", summary="Validate a grader")
def validate_grader(body: GraderValidate, tenant: CurrentTenant, session: SessionDep) -> dict[str, Any]:
    grader = _parsed(body.grader)
    graders.check_endpoints(session, tenant.tenant_id, grader)
    return {"grader": grader_dump(grader)}


@router.post("/fine_tuning/alpha/graders/run", summary="Grade one sample, as training would")
async def run_grader(
    request: Request, body: Annotated[GraderRun, Body()], tenant: CurrentTenant, session: SessionDep
) -> dict[str, Any]:
    grader = _parsed(body.grader)
    if body.item is not None and not isinstance(body.item, dict):
        raise OpenAIInvalid("item", "must be an object (the dataset row the templates read as item.*)")
    chats = await run_in_threadpool(graders.chat_configs, session, tenant.tenant_id, grader)
    return await graders.run(grader, body.item or {}, body.model_sample, chats, grading_pool(request))



