"""Routes (thin): parse, call the domain service, render."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query

from contract.api.evaluations import ComparisonOut, EvaluationItemList, EvaluationList, EvaluationOut
from contract.evaluation import EvaluationSpec
from contract.fields import INT32_MAX
from service.evaluations import service
from service.evaluations.schemas import CompareRequest, evaluation_out, item_out
from service.kit.deps import SessionDep
from service.kit.openapi import error_responses, quota_responses
from service.kit.paging import EVENTS, RESOURCES, EventLimit, Limit
from service.kit.params import Cursor, PathId
from service.kit.queue import JobQueue, get_job_queue
from service.tenants.auth import CurrentTenant

router = APIRouter(tags=["evaluations"])

QueueDep = Annotated[JobQueue, Depends(get_job_queue)]

_SPEC_EXAMPLES: dict[str, Any] = {
    "checkpoint": {
        "summary": "A checkpoint, 4 samples per item, exact match",
        "value": EvaluationSpec.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
    },
}


@router.post(
    "/evaluations",
    status_code=201,
    response_model=EvaluationOut,
    summary="Evaluate a model on a dataset",
    responses={**error_responses(401, 422), **quota_responses(409, 429)},
)
def create_evaluation(
    spec: Annotated[EvaluationSpec, Body(openapi_examples=_SPEC_EXAMPLES)],
    tenant: CurrentTenant,
    session: SessionDep,
    queue: QueueDep,
) -> EvaluationOut:
    """The model, dataset and reward functions must be yours (or allowed sources). Runs on the workers like a
    job: counted in your quotas, metered, cancellable."""
    return evaluation_out(service.create_evaluation(session, tenant.tenant_id, spec, queue))


@router.get(
    "/evaluations", response_model=EvaluationList, summary="List evaluations, newest first",
    responses=error_responses(401, 422),
)
def list_evaluations(
    tenant: CurrentTenant, session: SessionDep, limit: Limit = RESOURCES.default, after: Cursor = None
) -> EvaluationList:
    views, has_more = service.list_evaluations(session, tenant.tenant_id, limit=limit, after=after)
    data = [evaluation_out(view) for view in views]
    return EvaluationList(data=data, has_more=has_more, next_after=data[-1].id if has_more else None)


@router.post(
    "/evaluations/compare",
    response_model=ComparisonOut,
    summary="Compare two evaluations of the same dataset",
    responses=error_responses(401, 404, 409, 422),
)
def compare_evaluations(request: CompareRequest, tenant: CurrentTenant, session: SessionDep) -> ComparisonOut:
    """Paired over the items both scored: the difference b - a with its bootstrap interval, a paired test
    (McNemar's exact test for one 0/1 sample per item, else a sign-flip permutation test) and the flipped
    items."""
    return service.compare(session, tenant.tenant_id, request.evaluation_a, request.evaluation_b, seed=request.seed)


@router.get(
    "/evaluations/{evaluation_id}", response_model=EvaluationOut, summary="Get an evaluation",
    responses=error_responses(401, 404),
)
def get_evaluation(evaluation_id: PathId, tenant: CurrentTenant, session: SessionDep) -> EvaluationOut:
    return evaluation_out(service.get_evaluation(session, tenant.tenant_id, evaluation_id))


@router.get(
    "/evaluations/{evaluation_id}/items", response_model=EvaluationItemList,
    summary="An evaluation's items: completions and rewards, in dataset order",
    responses=error_responses(401, 404, 422),
)
def list_items(
    evaluation_id: PathId,
    tenant: CurrentTenant,
    session: SessionDep,
    after: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="Item index to continue after.")] = None,
    limit: EventLimit = EVENTS.default,
) -> EvaluationItemList:
    rows, has_more = service.list_items(session, tenant.tenant_id, evaluation_id, after=after, limit=limit)
    data = [item_out(row) for row in rows]
    return EvaluationItemList(data=data, has_more=has_more, next_after=data[-1].index if has_more else None)


@router.post(
    "/evaluations/{evaluation_id}/cancel", response_model=EvaluationOut, summary="Cancel an evaluation",
    responses=error_responses(401, 404, 409),
)
def cancel_evaluation(evaluation_id: PathId, tenant: CurrentTenant, session: SessionDep) -> EvaluationOut:
    """A queued or paused evaluation is cancelled at once; a running one after its current batch."""
    return evaluation_out(service.cancel_evaluation(session, tenant.tenant_id, evaluation_id))


@router.post(
    "/evaluations/{evaluation_id}/resume", response_model=EvaluationOut, summary="Resume a paused evaluation",
    responses={**error_responses(401, 404, 409), **quota_responses(429)},
)
def resume_evaluation(
    evaluation_id: PathId, tenant: CurrentTenant, session: SessionDep, queue: QueueDep
) -> EvaluationOut:
    """It continues after the last item recorded."""
    return evaluation_out(service.resume_evaluation(session, tenant.tenant_id, evaluation_id, queue))
