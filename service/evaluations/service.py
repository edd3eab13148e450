"""Evaluations business logic for API callers (REST, gRPC): create, read, list, items, cancel, resume, compare;
and the summary the worker's last report writes (summarize).

An evaluation runs as a job of kind `evaluation` with the evaluation's id (service.jobs.service.create_job):
quotas, monthly caps, model sources, dataset and reward-function references, the queue, leases, usage and
cancellation are the jobs' own. Transport-free; never commits (the boundary does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from contract.api.evaluations import ComparisonOut, FlippedItem
from contract.evaluation import EvaluationSpec
from service.datasets import service as datasets
from service.evaluations import repository, stats
from service.evaluations.models import Evaluation, EvaluationItem
from service.jobs import service as jobs
from service.jobs.models import Job
from service.jobs.states import JobStatus
from service.kit.errors import Conflict, NotFound, ValidationFailed
from service.kit.ids import new_id
from service.kit.paging import page
from service.kit.queue import JobQueue
from service.usage import service as usage

EVALUATION = "evaluation"  # the kind of the job that runs an evaluation
# The job spec's fields as an evaluation spec names them: reference errors name the evaluation's own.
SPEC_FIELDS = {"base_model": "model", "train_dataset": "dataset"}
MAX_FLIPPED = 100


class EvaluationNotFinished(Conflict):
    code = "evaluation_not_finished"


@dataclass(frozen=True)
class EvaluationView:
    """An evaluation with the job that runs it."""

    evaluation: Evaluation
    job: Job


def create_evaluation(
    session: Session, tenant_id: str, spec: EvaluationSpec, queue: JobQueue, *, source: tuple[str, int] | None = None
) -> EvaluationView:
    """`source`: (job id, step) when a job evaluates its own checkpoint of that step (service.evaluations.scheduled)."""
    run = jobs.JobRun(kind=EVALUATION, job_id=new_id("eval"), fields=SPEC_FIELDS)
    job = jobs.create_job(session, tenant_id, spec.as_job_spec(), queue, run=run)
    dataset = datasets.live_datasets(session, tenant_id, [spec.dataset])[spec.dataset]  # checked just above
    job.total_steps = min(dataset.num_rows, spec.max_items or dataset.num_rows)
    evaluation = Evaluation(
        id=job.id, tenant_id=tenant_id, model=spec.model, dataset_id=spec.dataset,
        spec=spec.model_dump(mode="json"), summary=None, created_at=job.created_at,
        source_job_id=source[0] if source else None, source_step=source[1] if source else None,
    )
    session.add(evaluation)
    session.flush()
    return EvaluationView(evaluation, job)


def get_evaluation(session: Session, tenant_id: str, evaluation_id: str) -> EvaluationView:
    found = repository.get(session, tenant_id, evaluation_id)
    if found is None:
        raise NotFound("evaluation", evaluation_id)
    return EvaluationView(*found)


def list_evaluations(
    session: Session, tenant_id: str, *, limit: int, after: str | None
) -> tuple[list[EvaluationView], bool]:
    rows, has_more = page(repository.list_page(session, tenant_id, limit=limit + 1, before_id=after), limit)
    return [EvaluationView(*row) for row in rows], has_more


def list_items(
    session: Session, tenant_id: str, evaluation_id: str, *, after: int | None, limit: int
) -> tuple[Sequence[EvaluationItem], bool]:
    get_evaluation(session, tenant_id, evaluation_id)
    return page(repository.items_page(session, evaluation_id, after=after, limit=limit + 1), limit)


def cancel_evaluation(session: Session, tenant_id: str, evaluation_id: str) -> EvaluationView:
    get_evaluation(session, tenant_id, evaluation_id)
    jobs.cancel_job(session, tenant_id, evaluation_id)
    return get_evaluation(session, tenant_id, evaluation_id)


def resume_evaluation(session: Session, tenant_id: str, evaluation_id: str, queue: JobQueue) -> EvaluationView:
    """A paused evaluation (a reward endpoint that stayed down, a monthly cap) continues after its last item."""
    get_evaluation(session, tenant_id, evaluation_id)
    jobs.resume_job(session, tenant_id, evaluation_id, queue)
    return get_evaluation(session, tenant_id, evaluation_id)


# --- results ------------------------------------------------------------------------------------------


def outcomes(items: Sequence[EvaluationItem]) -> list[stats.ItemOutcome]:
    return [stats.ItemOutcome(rewards=tuple(item.rewards)) for item in items]


def summarize(session: Session, evaluation_id: str) -> dict[str, object]:
    """The summary of every recorded item with the usage of every attempt, stored on the evaluation (the
    worker's last report, in its fenced transaction). Returns it."""
    evaluation = repository.get_any_tenant(session, evaluation_id)
    if evaluation is None:
        raise NotFound("evaluation", evaluation_id)
    spec = EvaluationSpec.model_validate(evaluation.spec)
    items = repository.all_items(session, evaluation_id)
    if not items:
        raise ValueError(f"evaluation {evaluation_id!r} recorded no item")
    summary = stats.summarize(outcomes(items), k=spec.samples_per_item, seed=spec.seed).as_dict()
    spent = usage.job_totals(session, evaluation_id)
    summary.update(tokens_generated=spent.tokens_generated, device_seconds=spent.device_seconds)
    evaluation.summary = summary
    session.flush()
    return summary


def compare(session: Session, tenant_id: str, a_id: str, b_id: str, *, seed: int) -> ComparisonOut:
    """Paired comparison of two succeeded evaluations of the same dataset, over the items both scored."""
    a, b = get_evaluation(session, tenant_id, a_id), get_evaluation(session, tenant_id, b_id)
    for field, view in (("evaluation_a", a), ("evaluation_b", b)):
        if view.job.status != JobStatus.succeeded.value:
            raise EvaluationNotFinished(
                f"{field}: evaluation {view.evaluation.id!r} is {view.job.status}; only succeeded evaluations "
                "can be compared", details={"field": field, "current_status": view.job.status},
            )
    if a.evaluation.dataset_id != b.evaluation.dataset_id:
        raise ValidationFailed(
            f"evaluation_b: evaluates dataset {b.evaluation.dataset_id!r}, evaluation_a {a.evaluation.dataset_id!r}; "
            "a paired comparison needs the same items",
            details=[{"field": "evaluation_b", "message": "not the same dataset as evaluation_a", "type": "value_error"}],
        )
    items_a = {i.item_index: i for i in repository.all_items(session, a_id)}
    items_b = {i.item_index: i for i in repository.all_items(session, b_id)}
    shared = sorted(items_a.keys() & items_b.keys())
    paired_a, paired_b = [items_a[i] for i in shared], [items_b[i] for i in shared]
    try:
        result = stats.compare(outcomes(paired_a), outcomes(paired_b), seed=seed)
    except ValueError as exc:
        raise ValidationFailed(f"evaluation_b: {exc}") from exc
    return ComparisonOut(
        evaluation_a=a_id, evaluation_b=b_id, flipped=_flipped(paired_a, paired_b) if result.metric == "accuracy"
        else [], **result.as_dict(),
    )


def _flipped(a: Sequence[EvaluationItem], b: Sequence[EvaluationItem]) -> list[FlippedItem]:
    """Items whose majority verdict (score >= 0.5 of 0/1 rewards) differs between a and b."""
    flipped = [
        FlippedItem(index=x.item_index, prompt=x.prompt, score_a=x.score, score_b=y.score)
        for x, y in zip(a, b, strict=True)
        if x.score is not None and y.score is not None and (x.score >= 0.5) != (y.score >= 0.5)
    ]
    return flipped[:MAX_FLIPPED]
