"""EvaluationService: the same domain functions as /v1/evaluations (service.evaluations.service)."""

from __future__ import annotations

from typing import Any

import grpc
from pydantic import ValidationError
from sqlalchemy.orm import Session

from contract.api.evaluations import EvaluationItemOut, EvaluationOut
from contract.gen.grpo.v1 import evaluations_pb2, evaluations_pb2_grpc
from service.evaluations import service
from service.evaluations.schemas import CompareRequest, evaluation_out, item_out
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.convert import (
    comparison_to_proto,
    evaluation_item_to_proto,
    evaluation_spec_from_proto,
    evaluation_to_proto,
)
from service.grpc.errors import from_validation_error, prefix_fields
from service.kit.errors import ValidationFailed
from service.kit.paging import EVENTS, RESOURCES, page_size
from service.kit.queue import get_job_queue

Context = grpc.aio.ServicerContext[Any, Any]


def _after_index(request: evaluations_pb2.ListEvaluationItemsRequest) -> int | None:
    """REST's `after` query parameter (an item index, >= 0); unset = from the first item."""
    if not request.HasField("after_index"):
        return None
    if request.after_index < 0:
        text = "must be 0 or more"
        raise ValidationFailed(f"after_index: {text}", details=[{"field": "after_index", "message": text}])
    return request.after_index


def _compare_request(request: evaluations_pb2.CompareEvaluationsRequest) -> CompareRequest:
    """The REST body of POST /v1/evaluations/compare, validated the same way; errors name the field."""
    values = {"evaluation_a": request.evaluation_a, "evaluation_b": request.evaluation_b, "seed": request.seed}
    try:
        return CompareRequest.model_validate(values)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


class EvaluationServicer(evaluations_pb2_grpc.EvaluationServiceServicer):
    async def CreateEvaluation(
        self, request: evaluations_pb2.CreateEvaluationRequest, context: Context
    ) -> evaluations_pb2.CreateEvaluationResponse:
        tenant = current_tenant()
        spec = evaluation_spec_from_proto(request.spec)
        try:
            evaluation = await in_session(
                lambda s: evaluation_out(service.create_evaluation(s, tenant.tenant_id, spec, get_job_queue()))
            )
        except ValidationFailed as exc:
            raise prefix_fields(exc, "spec") from exc  # reference checks name fields of the spec
        return evaluations_pb2.CreateEvaluationResponse(evaluation=evaluation_to_proto(evaluation))

    async def GetEvaluation(
        self, request: evaluations_pb2.GetEvaluationRequest, context: Context
    ) -> evaluations_pb2.GetEvaluationResponse:
        tenant = current_tenant()
        evaluation = await in_session(
            lambda s: evaluation_out(service.get_evaluation(s, tenant.tenant_id, request.evaluation_id))
        )
        return evaluations_pb2.GetEvaluationResponse(evaluation=evaluation_to_proto(evaluation))

    async def ListEvaluations(
        self, request: evaluations_pb2.ListEvaluationsRequest, context: Context
    ) -> evaluations_pb2.ListEvaluationsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, RESOURCES)

        def work(s: Session) -> tuple[list[EvaluationOut], bool]:
            views, has_more = service.list_evaluations(
                s, tenant.tenant_id, limit=limit, after=request.page_token or None
            )
            return [evaluation_out(view) for view in views], has_more

        evaluations, has_more = await in_session(work)
        return evaluations_pb2.ListEvaluationsResponse(
            evaluations=[evaluation_to_proto(e) for e in evaluations],
            next_page_token=evaluations[-1].id if has_more and evaluations else "",
        )

    async def ListEvaluationItems(
        self, request: evaluations_pb2.ListEvaluationItemsRequest, context: Context
    ) -> evaluations_pb2.ListEvaluationItemsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, EVENTS)
        after = _after_index(request)

        def work(s: Session) -> tuple[list[EvaluationItemOut], bool]:
            rows, has_more = service.list_items(s, tenant.tenant_id, request.evaluation_id, after=after, limit=limit)
            return [item_out(row) for row in rows], has_more

        items, has_more = await in_session(work)
        return evaluations_pb2.ListEvaluationItemsResponse(
            items=[evaluation_item_to_proto(i) for i in items],
            next_after_index=items[-1].index if has_more and items else None,
        )

    async def CancelEvaluation(
        self, request: evaluations_pb2.CancelEvaluationRequest, context: Context
    ) -> evaluations_pb2.CancelEvaluationResponse:
        tenant = current_tenant()
        evaluation = await in_session(
            lambda s: evaluation_out(service.cancel_evaluation(s, tenant.tenant_id, request.evaluation_id))
        )
        return evaluations_pb2.CancelEvaluationResponse(evaluation=evaluation_to_proto(evaluation))

    async def ResumeEvaluation(
        self, request: evaluations_pb2.ResumeEvaluationRequest, context: Context
    ) -> evaluations_pb2.ResumeEvaluationResponse:
        tenant = current_tenant()
        evaluation = await in_session(
            lambda s: evaluation_out(
                service.resume_evaluation(s, tenant.tenant_id, request.evaluation_id, get_job_queue())
            )
        )
        return evaluations_pb2.ResumeEvaluationResponse(evaluation=evaluation_to_proto(evaluation))

    async def CompareEvaluations(
        self, request: evaluations_pb2.CompareEvaluationsRequest, context: Context
    ) -> evaluations_pb2.CompareEvaluationsResponse:
        tenant = current_tenant()
        body = _compare_request(request)
        comparison = await in_session(
            lambda s: service.compare(s, tenant.tenant_id, body.evaluation_a, body.evaluation_b, seed=body.seed)
        )
        return evaluations_pb2.CompareEvaluationsResponse(comparison=comparison_to_proto(comparison))
