"""The evaluations API's responses (shapes in contract.api.evaluations) built from rows, and the request of a
comparison."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contract.api.evaluations import (
    EvaluationItemOut,
    EvaluationOut,
    EvaluationProgress,
    EvaluationResults,
)
from contract.api.jobs import JobError, JobStatus
from contract.evaluation import EvaluationSpec
from contract.fields import Int64, Text
from service.evaluations.models import EvaluationItem
from service.evaluations.service import EvaluationView


class CompareRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    evaluation_a: Text = Field(min_length=1, max_length=64, description="The baseline evaluation.")
    evaluation_b: Text = Field(min_length=1, max_length=64, description="The evaluation compared with it.")
    seed: Int64 = Field(0, description="Seeds the bootstrap and permutation resamples.")


def evaluation_out(view: EvaluationView) -> EvaluationOut:
    evaluation, job = view.evaluation, view.job
    spec = EvaluationSpec.model_validate(evaluation.spec)
    error = None if job.error_code is None else JobError(code=job.error_code, message=job.error_message or "")
    return EvaluationOut(
        id=evaluation.id,
        name=spec.name,
        status=JobStatus(job.status),
        model=evaluation.model,
        dataset=evaluation.dataset_id,
        samples_per_item=spec.samples_per_item,
        progress=EvaluationProgress(items_done=job.current_step, items_total=job.total_steps),
        results=None if evaluation.summary is None else EvaluationResults.model_validate(evaluation.summary),
        error=error,
        attempt=job.attempt,
        spec=spec,
        metadata=dict(spec.metadata),
        created_at=evaluation.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


def item_out(item: EvaluationItem) -> EvaluationItemOut:
    return EvaluationItemOut(
        index=item.item_index, prompt=item.prompt, completions=list(item.completions),
        rewards=list(item.rewards), sources=[dict(s) for s in item.sources], score=item.score,
    )
