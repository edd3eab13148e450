"""Evaluations a job schedules of its own checkpoints (its spec's `eval_checkpoints`): one evaluation per
recorded checkpoint, announced in the job's events (`checkpoint_evaluation_scheduled`, or
`checkpoint_evaluation_skipped` with the reason when a quota or a reference refuses it), and its results
reported back to the job (`checkpoint_evaluated`), which the job's plot draws at the checkpoint's step.

A refused evaluation never undoes the checkpoint: it is created in a savepoint of the checkpoint's transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from contract.evaluation import EvaluationSpec
from contract.spec import JobSpec
from service.evaluations import repository, service
from service.jobs import progress
from service.jobs import repository as jobs_repository
from service.jobs.events import CHECKPOINT_EVALUATED_EVENT
from service.jobs.models import Job
from service.kit.errors import DomainError
from service.kit.queue import JobQueue

SCHEDULED_EVENT = "checkpoint_evaluation_scheduled"
SKIPPED_EVENT = "checkpoint_evaluation_skipped"
# The results a `checkpoint_evaluated` event carries (and the plot draws).
REPORTED = ("accuracy", "mean_reward", "pass_at_k")


def checkpoint_evaluation(spec: JobSpec, job_id: str, checkpoint_id: str, step: int) -> EvaluationSpec | None:
    """The evaluation of one checkpoint as the job's spec asks for it; None when it asks for none."""
    plan = spec.eval_checkpoints
    if plan is None:
        return None
    return EvaluationSpec(
        name=f"{job_id}-step-{step}", model=f"checkpoint:{checkpoint_id}", dataset=plan.dataset,
        rewards=plan.rewards or spec.rewards, samples_per_item=plan.samples_per_item,
        temperature=plan.sampling_temperature,
        max_tokens=plan.max_tokens or spec.hyperparameters.max_completion_length,
        max_items=plan.max_items, seed=plan.seed, metadata={"job_id": job_id, "step": str(step)},
    )


def evaluate_checkpoint(session: Session, job: Job, checkpoint_id: str, step: int, queue: JobQueue) -> None:
    """In the transaction that records the checkpoint (the job's row locked by it)."""
    spec = checkpoint_evaluation(JobSpec.model_validate(job.spec), job.id, checkpoint_id, step)
    if spec is None:
        return
    data: dict[str, Any] = {"step": step, "checkpoint_id": checkpoint_id}
    try:
        with session.begin_nested():
            view = service.create_evaluation(session, job.tenant_id, spec, queue, source=(job.id, step))
    except DomainError as exc:
        progress.append_locked_event(session, job, SKIPPED_EVENT, f"checkpoint of step {step} not evaluated: "
                                     f"{exc.message}", {**data, "code": exc.code})
        return
    progress.append_locked_event(session, job, SCHEDULED_EVENT, f"evaluation {view.evaluation.id} of the "
                                 f"checkpoint of step {step}", {**data, "evaluation_id": view.evaluation.id})


def summarize_and_report(session: Session, evaluation_id: str) -> None:
    """An evaluation's last report: its summary (service.summarize) and, when a job scheduled it, the results
    as an event of that job (unless the job was deleted)."""
    summary = service.summarize(session, evaluation_id)
    evaluation = repository.get_any_tenant(session, evaluation_id)
    if evaluation is None or evaluation.source_job_id is None:
        return
    job = jobs_repository.get_job_any_tenant(session, evaluation.source_job_id, for_update=True)
    if job is None:
        return
    results = {name: summary[name] for name in REPORTED if summary.get(name) is not None}
    shown = ", ".join(f"{name} {value:.3f}" for name, value in results.items())
    progress.append_locked_event(
        session, job, CHECKPOINT_EVALUATED_EVENT, f"checkpoint of step {evaluation.source_step}: {shown}",
        {"step": evaluation.source_step, "evaluation_id": evaluation.id, **results},
    )
