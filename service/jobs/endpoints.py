"""Routes (thin): parse, call the domain service, render."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from sqlalchemy.orm import Session

from contract.api.checkpoints import CheckpointList
from contract.api.jobs import EventList, JobList, JobOut, MetricsOut, SampleList
from contract.api.usage import Estimate, JobUsage
from contract.fields import INT32_MAX, INT64_MAX, Text
from contract.spec import JobSpec
from service.checkpoints.schemas import checkpoint_out
from service.jobs import service
from service.jobs.idempotency import request_hash, run_idempotent
from service.jobs.schemas import event_out, job_out, sample_out
from service.jobs.states import JobStatus
from service.jobs.stream import job_event_stream, parse_last_event_id
from service.kit.deps import SessionDep, reads_of
from service.kit.openapi import error_responses, quota_responses
from service.kit.paging import EVENTS, METRIC_POINTS, RESOURCES, EventLimit, Limit, PointLimit
from service.kit.params import Cursor, PathId
from service.kit.queue import JobQueue, get_job_queue
from service.storage import get_storage
from service.tenants.auth import CurrentTenant, bearer_credentials, reauthenticate
from service.usage.schemas import JobPatch

router = APIRouter(tags=["jobs"])

QueueDep = Annotated[JobQueue, Depends(get_job_queue)]

_SPEC_EXAMPLES: dict[str, Any] = {
    "builtin_and_remote_rewards": {
        "summary": "LoRA on a hub model, a built-in and a remote reward",
        "value": JobSpec.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
    },
    "tiny_cpu": {
        "summary": "The builtin tiny model on a CPU worker",
        "value": {
            "name": "tiny-exact-match",
            "base_model": "builtin:tiny",
            "train_dataset": "ds_01J9Z3K2Q8",
            "rewards": [{"type": "builtin", "name": "exact_match", "weight": 1.0}],
            "hyperparameters": {"max_steps": 20, "num_generations": 4, "prompts_per_step": 2},
        },
    },
}


def _json(model: BaseModel, status_code: int = 200) -> Response:
    """Serialise once. Returning the model would make FastAPI dump it, validate it again, then serialise;
    the route's response_model still documents (and the tests check) the shape."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def _split(csv: str | None) -> list[str] | None:
    if csv is None:
        return None
    return [part.strip() for part in csv.split(",") if part.strip()] or None


@router.post(
    "/jobs",
    status_code=201,
    response_model=JobOut,
    summary="Create a training job",
    responses={**error_responses(401, 422), **quota_responses(409, 429)},
)
def create_job(
    spec: Annotated[JobSpec, Body(openapi_examples=_SPEC_EXAMPLES)],
    tenant: CurrentTenant,
    session: SessionDep,
    queue: QueueDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="Makes retries safe: the same key and body return the original response (kept 24 h "
            "or more); the same key with another body is a 422; while the first request runs, a 409.",
        ),
    ] = None,
) -> JSONResponse:
    """Validate the spec (datasets, reward functions and checkpoints must be yours) and queue the job.

    The job is sent to the workers only once it is committed.
    """

    def work(s: Session) -> tuple[int, dict[str, Any]]:
        job = service.create_job(s, tenant.tenant_id, spec, queue)
        return 201, job_out(job).model_dump(mode="json")

    if idempotency_key is None:
        status_code, body = work(session)
        return JSONResponse(body, status_code=status_code)
    outcome = run_idempotent(
        session, tenant.tenant_id, idempotency_key, request_hash(spec.model_dump(mode="json")), work
    )
    headers = {"Idempotent-Replayed": "true"} if outcome.replayed else None
    return JSONResponse(outcome.body, status_code=outcome.status_code, headers=headers)


@router.get(
    "/jobs",
    response_model=JobList,
    summary="List jobs, newest first",
    responses=error_responses(401, 422, 503),
)
async def list_jobs(
    request: Request,
    tenant: CurrentTenant,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this state.")] = None,
    limit: Limit = RESOURCES.default,
    after: Cursor = None,
) -> Response:
    data, has_more = await service.list_jobs(
        reads_of(request), tenant.tenant_id, status=status, limit=limit, after=after
    )
    return _json(JobList(data=data, has_more=has_more, next_after=data[-1].id if has_more else None))


@router.get(
    "/jobs/{job_id}", response_model=JobOut, summary="Get a job", responses=error_responses(401, 404, 503)
)
async def get_job(job_id: PathId, request: Request, tenant: CurrentTenant) -> Response:
    # The hottest route (clients poll it): async, and on PostgreSQL the read is awaited on the event loop
    # with no thread hop (kit.reads).
    return _json(await service.read_job(reads_of(request), tenant.tenant_id, job_id))


@router.delete(
    "/jobs/{job_id}",
    status_code=204,
    summary="Delete a finished job and its artifacts",
    responses=error_responses(401, 404, 409),
)
def delete_job(job_id: str, tenant: CurrentTenant, session: SessionDep) -> Response:
    """Only a succeeded, failed or cancelled job (else 409 `job_not_finished` naming its state). Removes its
    events, metrics, samples, checkpoints and their files in storage. 409 `checkpoint_in_use` while one of its
    checkpoints is being downloaded or is the base model of an unfinished job."""
    service.delete_job(session, tenant.tenant_id, job_id, get_storage())
    return Response(status_code=204)


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=JobOut,
    summary="Cancel a job",
    responses=error_responses(401, 404, 409),
)
def cancel_job(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> JobOut:
    """A queued or paused job is cancelled at once; a running one becomes `cancelling` until its worker stops."""
    return job_out(service.cancel_job(session, tenant.tenant_id, job_id))


@router.post(
    "/jobs/{job_id}/pause",
    response_model=JobOut,
    summary="Pause a job",
    responses=error_responses(401, 404, 409),
)
def pause_job(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> JobOut:
    """A queued job pauses at once; a running one gets `pause_requested` and pauses at its next checkpoint."""
    return job_out(service.pause_job(session, tenant.tenant_id, job_id))


@router.post(
    "/jobs/{job_id}/resume",
    response_model=JobOut,
    summary="Resume a job",
    responses={**error_responses(401, 404, 409), **quota_responses(429)},
)
def resume_job(job_id: PathId, tenant: CurrentTenant, session: SessionDep, queue: QueueDep) -> JobOut:
    """A paused job is queued again and resumes from its latest checkpoint; a pending pause is withdrawn."""
    return job_out(service.resume_job(session, tenant.tenant_id, job_id, queue))


@router.get(
    "/jobs/{job_id}/events",
    response_model=EventList,
    summary="List a job's events, oldest first",
    responses=error_responses(401, 404, 422),
)
def list_events(
    job_id: PathId,
    tenant: CurrentTenant,
    session: SessionDep,
    after: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="Event id to continue after.")] = None,
    limit: EventLimit = EVENTS.default,
    types: Annotated[
        Text | None, Query(description="Comma-separated event types, e.g. `status,checkpoint`.")
    ] = None,
    include_superseded: Annotated[
        bool,
        Query(description="Also list events of steps that a later attempt re-ran after a crash (`superseded`)."),
    ] = False,
) -> EventList:
    """Events of steps re-run by a later attempt (after a crash, from the last checkpoint) are left out unless
    `include_superseded`: each step's metrics appear once, from the attempt that produced the final values."""
    rows, has_more = service.list_events(
        session, tenant.tenant_id, job_id, after=after, limit=limit, types=_split(types),
        include_superseded=include_superseded,
    )
    data = [event_out(row) for row in rows]
    return EventList(data=data, has_more=has_more, next_after=data[-1].id if has_more else None)


@router.get(
    "/jobs/{job_id}/metrics",
    response_model=MetricsOut,
    summary="A job's metrics as time series",
    responses=error_responses(401, 404, 422),
)
def get_metrics(
    job_id: PathId,
    tenant: CurrentTenant,
    session: SessionDep,
    names: Annotated[Text | None, Query(description="Comma-separated metric names; all when omitted.")] = None,
    since_step: Annotated[int, Query(ge=0, le=INT32_MAX, description="First step to include.")] = 0,
    limit: PointLimit = METRIC_POINTS.default,
) -> MetricsOut:
    return service.get_metrics(
        session, tenant.tenant_id, job_id, names=_split(names), since_step=since_step, limit=limit
    )


@router.get(
    "/jobs/{job_id}/samples",
    response_model=SampleList,
    summary="Logged completions with per-source rewards",
    responses=error_responses(401, 404, 422),
)
def list_samples(
    job_id: PathId,
    tenant: CurrentTenant,
    session: SessionDep,
    step: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="Only completions logged at this step.")] = None,
    after: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="Sample id to continue after.")] = None,
    limit: EventLimit = EVENTS.default,
) -> SampleList:
    rows, has_more = service.list_samples(
        session, tenant.tenant_id, job_id, step=step, after=after, limit=limit
    )
    data = [sample_out(row) for row in rows]
    return SampleList(data=data, has_more=has_more, next_after=data[-1].id if has_more else None)


@router.get(
    "/jobs/{job_id}/checkpoints",
    response_model=CheckpointList,
    summary="List a job's checkpoints",
    responses=error_responses(401, 404),
    tags=["checkpoints"],
)
def list_checkpoints(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> CheckpointList:
    rows = service.list_job_checkpoints(session, tenant.tenant_id, job_id)
    return CheckpointList(data=[checkpoint_out(row) for row in rows])


# One SSE message (OpenAPI 3.1: a text/event-stream schema describes each message). The first message
# only sets the client's reconnection delay (`retry:`); every other one is a job event.
SSE_MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "The event id."},
        "event": {"type": "string", "description": "The event type (status, metrics, checkpoint, log...)."},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "The event as JSON (the shape of GET /v1/jobs/{job_id}/events items).",
        },
        "retry": {"type": "integer", "description": "Reconnection delay in milliseconds."},
    },
}


@router.get(
    "/jobs/{job_id}/stream",
    summary="Follow a job live (Server-Sent Events)",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "`text/event-stream`: one message per job event (`id:` = event id, `event:` = type "
            "(status, metrics, checkpoint, ...), `data:` = the event as JSON). Ends after a terminal state, or "
            "with an `error` message (no `id:`; `data:` = the error body) once the API key is revoked or expires "
            "(within `GRPO_AUTH_CACHE_SECONDS`). "
            "Reconnect with `Last-Event-ID` to continue where you left off.",
            "content": {"text/event-stream": {"schema": SSE_MESSAGE_SCHEMA}},
        },
        **error_responses(401, 404, 422),
    },
)
async def stream_job(
    job_id: PathId,
    request: Request,
    tenant: CurrentTenant,
    last_event_id: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            description="Resume after this event id (the `id:` of the last message received). A value that is "
            "not an event id (not a non-negative decimal integer up to 2^63-1) is ignored: the stream starts "
            "from the first event.",
        ),
    ] = None,
) -> StreamingResponse:
    after = parse_last_event_id(last_event_id)
    await service.read_job(reads_of(request), tenant.tenant_id, job_id)  # 404 before the stream starts
    token = bearer_credentials(request.headers.get("authorization"))
    return StreamingResponse(
        job_event_stream(job_id, after, request.is_disconnected, partial(reauthenticate, token)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


PLOTTED_METRICS = [
    "reward/mean", "reward/std", "kl", "completion_length/mean", "eval/accuracy", "eval/reward/mean",
]


@router.get(
    "/jobs/{job_id}/plot.png",
    summary="Training curves as a PNG",
    response_class=Response,
    responses={
        200: {
            "content": {"image/png": {}},
            "description": "Reward mean ± std, KL, completion length and held-out evaluations (of checkpoints "
            "too: eval_checkpoints) over steps.",
        },
        **error_responses(401, 404),
    },
)
def plot_job(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> Response:
    from service.plots import render_metrics_png  # matplotlib: loaded on first use, not at start-up

    metrics = service.get_metrics(
        session, tenant.tenant_id, job_id, names=PLOTTED_METRICS, since_step=0, limit=50_000
    )
    series = {**metrics.series, **service.checkpoint_evaluations(session, tenant.tenant_id, job_id)}
    png = render_metrics_png(series, title=f"{job_id} (steps {_steps(metrics)})")
    return Response(content=png, media_type="image/png", headers={"Cache-Control": "no-cache"})


def _steps(metrics: MetricsOut) -> str:
    steps = [step for series in metrics.series.values() for step in series.steps]
    return f"{min(steps)}-{max(steps)}" if steps else "none yet"


# --- a job's usage, estimate and budget (the API reference lists them under usage) ----------------------


@router.get(
    "/jobs/{job_id}/usage",
    response_model=JobUsage,
    summary="A job's usage, per step, and its budget",
    responses=error_responses(401, 404),
    tags=["usage"],
)
def get_job_usage(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> JobUsage:
    return service.job_usage(session, tenant.tenant_id, job_id)


@router.post(
    "/jobs/estimate",
    response_model=Estimate,
    summary="Expected tokens and device-seconds of a spec",
    responses=error_responses(401, 422),
    tags=["usage"],
)
def estimate_job(spec: Annotated[JobSpec, Body()], tenant: CurrentTenant, session: SessionDep) -> Estimate:
    """Validated like a submission; nothing is created. From what workers measured on the same base model (or
    models of its size), else the documented defaults (`calibration.source` says which)."""
    return service.estimate(session, tenant.tenant_id, spec)


@router.patch(
    "/jobs/{job_id}",
    response_model=JobOut,
    summary="Change a job's budget",
    responses=error_responses(401, 404, 409, 422),
    tags=["usage"],
)
def patch_job(job_id: PathId, patch: JobPatch, tenant: CurrentTenant, session: SessionDep) -> JobOut:
    """Replace the budget of an unfinished job; resume a job paused with `budget_exhausted` afterwards."""
    return job_out(service.set_job_budget(session, tenant.tenant_id, job_id, patch.budget))
