"""Jobs business logic for API callers (REST and gRPC): create, read, list, cancel, pause, resume, delete, and a
job's checkpoints, usage, estimate and budget (the lower domains answer with what the job hands them); the
worker's claim pauses a job over its budget here too (pause_if_exhausted).

Transport-free: functions take a Session and a tenant id, return ORM rows or pydantic models and
raise service.kit.errors.*. They never commit; enqueueing is registered to run after the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from contract.api.jobs import JobOut, MetricSeries, MetricsOut
from contract.api.usage import Estimate, JobUsage
from contract.spec import BUILTIN_PREFIX, JobBudget, JobSpec
from service.checkpoints import repository as checkpoints_repository
from service.checkpoints import retention
from service.checkpoints.models import Checkpoint
from service.jobs import repository
from service.jobs.events import BUDGET_EXHAUSTED_EVENT, CHECKPOINT_EVALUATED_EVENT, STATUS_EVENT
from service.jobs.models import Job, JobEvent
from service.jobs.references import check_references
from service.jobs.schemas import job_out
from service.jobs.states import TERMINAL, UNFINISHED, JobStatus, transition
from service.kit.config import get_settings
from service.kit.db import on_commit, utcnow
from service.kit.errors import Conflict, IllegalTransition, NotFound, ValidationFailed
from service.kit.ids import new_id
from service.kit.paging import page
from service.kit.queue import JobQueue, queue_name, send_job_logged
from service.kit.reads import Reads
from service.quotas import service as quotas
from service.storage import Storage, job_prefix
from service.usage import budget as budgets
from service.usage import service as usage
from service.usage.budget import Exhausted

log = logging.getLogger(__name__)


# --- create ---------------------------------------------------------------------------------------


def create_job(
    session: Session, tenant_id: str, spec: JobSpec, queue: JobQueue, *, run: JobRun | None = None
) -> Job:
    """Check the job's size, the tenant's quotas and monthly caps and what the spec refers to (jobs.references),
    insert the job `queued`, and enqueue it once committed: each step once, in that order (docs/development.md,
    "Life of a job"). `run`: a job that runs something other than training (an evaluation)."""
    run = run or JobRun()
    check_resources(spec)
    devices = job_devices(spec)
    quotas.check_can_queue(session, tenant_id, devices, repository.job_load)
    budgets.refuse_if_tenant_exhausted(session, tenant_id)
    check_references(session, tenant_id, spec, fields=run.fields)
    now = utcnow()
    job = Job(
        id=run.job_id or new_id("job"),
        kind=run.kind,
        tenant_id=tenant_id,
        name=spec.name,
        status=JobStatus.queued.value,
        spec=spec.model_dump(mode="json"),
        base_model=spec.base_model,
        train_dataset_id=spec.train_dataset,
        eval_dataset_id=spec.eval_dataset,
        queue=queue_for(spec),
        devices=devices,
        priority=spec.priority,
        metadata_=dict(spec.metadata),
        current_step=0,
        total_steps=spec.hyperparameters.max_steps if run.kind == TRAIN else None,
        latest_metrics={},
        pause_requested=False,
        attempt=0,
        max_attempts=get_settings().max_attempts,
        created_at=now,
        updated_at=now,
    )
    session.add(job)
    session.add(
        JobEvent(
            job_id=job.id,
            type=STATUS_EVENT,
            message="created: queued",
            data={"from": None, "to": JobStatus.queued.value, "reason": "created"},
            attempt=0,
            created_at=now,
        )
    )
    session.flush()
    enqueue_after_commit(session, job, queue)
    return job


TRAIN = "train"


@dataclass(frozen=True)
class JobRun:
    """What a job runs: training, or another kind (`evaluation`) with its own id and the names its own spec
    gives the job spec's fields (errors name those)."""

    kind: str = TRAIN
    job_id: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict)


def queue_for(spec: JobSpec) -> str:
    """The builtin: models are small enough for CPU workers; everything else needs a GPU. A job needing N
    devices on each of its nodes goes to the queue of that device count (service.kit.queue), which only
    workers with N or more devices consume (one worker per node)."""
    kind = "cpu" if spec.base_model.startswith(BUILTIN_PREFIX) else "gpu"
    return queue_name(kind, spec.resources.devices_per_node)


def job_devices(spec: JobSpec) -> int:
    """Devices the job occupies while it runs: what the max_devices quota counts."""
    return spec.resources.devices


def check_resources(spec: JobSpec) -> None:
    """`resources.nodes` and `resources.devices` within the deployment's bounds (settings max_job_nodes and
    max_job_devices): ValidationFailed (422) naming the field and the bound."""
    settings = get_settings()
    errors = [
        {"field": f"resources.{name}", "message": f"must be at most {bound} (this service's limit), got {value}",
         "type": "less_than_equal", "limit": bound}
        for name, value, bound in (
            ("nodes", spec.resources.nodes, settings.max_job_nodes),
            ("devices", spec.resources.devices, settings.max_job_devices),
        )
        if value > bound
    ]
    if errors:
        raise ValidationFailed(f"{errors[0]['field']}: {errors[0]['message']}", details=errors)


def enqueue_after_commit(session: Session, job: Job, queue: JobQueue) -> None:
    on_commit(session, partial(send_job_logged, queue, job.id, job.queue))


def enqueue_waiting(session: Session, tenant_id: str, queue: JobQueue) -> None:
    """Once committed, send one delivery to every queue where the tenant has a queued job (naming its oldest).

    For when the tenant's running jobs or devices go down, or its quota goes up: a job held back by that quota
    had its own message consumed by a claim that could not start it. A delivery that finds nothing it may
    start returns at once (service/execution/lease.py)."""
    for name, job_id in repository.oldest_queued_per_queue(session, tenant_id).items():
        on_commit(session, partial(send_job_logged, queue, job_id, name))


# --- read -----------------------------------------------------------------------------------------


def get_job(session: Session, tenant_id: str, job_id: str, *, for_update: bool = False) -> Job:
    job = repository.get_job(session, tenant_id, job_id, for_update=for_update)
    if job is None:
        raise NotFound("job", job_id)
    return job


async def read_job(reads: Reads, tenant_id: str, job_id: str) -> JobOut:
    """A job as the API renders it (REST GET /v1/jobs/{id} and its stream, gRPC GetJob and WatchJob): one
    SELECT, no ORM entity. For state changes use `get_job`, which returns the entity (and can lock its row)."""
    row = await repository.get_job_row(reads, tenant_id, job_id)
    if row is None:
        raise NotFound("job", job_id)
    return job_out(row)


async def list_jobs(
    reads: Reads, tenant_id: str, *, status: JobStatus | None, limit: int, after: str | None
) -> tuple[list[JobOut], bool]:
    """Newest first; `after` is the id of the last job of the previous page. Returns (page, has_more).

    One SELECT of plain rows, rendered (no ORM entities), like `read_job`."""
    rows = await repository.list_jobs(
        reads, tenant_id, status=status.value if status else None, limit=limit + 1, before_id=after
    )
    jobs, has_more = page(rows, limit)
    return [job_out(row) for row in jobs], has_more


def checkpoint_evaluations(session: Session, tenant_id: str, job_id: str) -> dict[str, MetricSeries]:
    """The results of the evaluations of the job's checkpoints (`checkpoint_evaluated` events) as series by the
    checkpoint's step, named `checkpoint_eval/<result>`."""
    get_job(session, tenant_id, job_id)
    series: dict[str, MetricSeries] = {}
    for event in repository.events_of_type(session, job_id, CHECKPOINT_EVALUATED_EVENT):
        for name, value in event.data.items():
            if name not in ("step", "evaluation_id") and isinstance(value, int | float) and event.step is not None:
                points = series.setdefault(f"checkpoint_eval/{name}", MetricSeries(steps=[], values=[]))
                points.steps.append(event.step)
                points.values.append(float(value))
    return series


def list_events(
    session: Session,
    tenant_id: str,
    job_id: str,
    *,
    after: int | None,
    limit: int,
    types: Sequence[str] | None,
    include_superseded: bool = False,
) -> tuple[Sequence[JobEvent], bool]:
    get_job(session, tenant_id, job_id)
    rows = repository.list_events(
        session, job_id, after_id=after, limit=limit + 1, types=types, include_superseded=include_superseded
    )
    return page(rows, limit)


def get_metrics(
    session: Session, tenant_id: str, job_id: str, *, names: Sequence[str] | None, since_step: int, limit: int
) -> MetricsOut:
    """Time series from `since_step` on, at most `limit` points; a page never ends mid-step."""
    get_job(session, tenant_id, job_id)
    rows = repository.metric_rows(session, job_id, names=names, since_step=since_step, limit=limit + 1)
    points, has_more = page(rows, limit)
    next_since_step = None
    if has_more:
        # Drop the (possibly partial) last step; the next page starts at it.
        next_since_step = rows[limit][0]
        points = [row for row in points if row[0] < next_since_step]
        if not points:
            raise ValidationFailed(f"limit: {limit} is smaller than the number of metrics in one step")
    series: dict[str, MetricSeries] = {}
    for step, name, value in points:
        entry = series.setdefault(name, MetricSeries(steps=[], values=[]))
        entry.steps.append(step)
        entry.values.append(value)
    return MetricsOut(job_id=job_id, series=series, has_more=has_more, next_since_step=next_since_step)


def list_samples(
    session: Session, tenant_id: str, job_id: str, *, step: int | None, after: int | None, limit: int
) -> tuple[Sequence[Any], bool]:
    get_job(session, tenant_id, job_id)
    rows = repository.list_samples(session, job_id, step=step, after_id=after, limit=limit + 1)
    return page(rows, limit)


def list_job_checkpoints(session: Session, tenant_id: str, job_id: str) -> Sequence[Checkpoint]:
    get_job(session, tenant_id, job_id)
    return checkpoints_repository.list_for_job(session, job_id)


def job_usage(session: Session, tenant_id: str, job_id: str) -> JobUsage:
    """The job's usage per step and its budget's state (service.usage.service.usage_of)."""
    return usage.usage_of(session, get_job(session, tenant_id, job_id))


def estimate(session: Session, tenant_id: str, spec: JobSpec) -> Estimate:
    """Expected usage of `spec` (service.usage.service.estimate_spec), validated like a submission (422 naming
    the field)."""
    train = check_references(session, tenant_id, spec).datasets[spec.train_dataset]
    return usage.estimate_spec(session, spec, train_rows=train.num_rows, train_bytes=train.bytes)


def dataset_in_use(session: Session, tenant_id: str, dataset_id: str) -> bool:
    """True while an unfinished job (not succeeded/failed/cancelled) trains or evaluates on the dataset."""
    return repository.job_uses_dataset(session, tenant_id, dataset_id, [s.value for s in UNFINISHED])


# --- delete ---------------------------------------------------------------------------------------


class JobNotFinished(Conflict):
    code = "job_not_finished"


class CheckpointInUse(Conflict):
    code = "checkpoint_in_use"


def delete_job(session: Session, tenant_id: str, job_id: str, storage: Storage) -> None:
    """Delete a finished job with its events, metrics, samples and checkpoints; its files once committed.

    Refused (409) while the job is not finished (`job_not_finished`, naming its state: cancel it first), and
    while one of its checkpoints is being downloaded or is the base model of an unfinished job
    (`checkpoint_in_use`).
    """
    job = get_job(session, tenant_id, job_id, for_update=True)
    if JobStatus(job.status) not in TERMINAL:
        raise JobNotFinished(
            f"job {job_id!r} is {job.status}; only succeeded, failed or cancelled jobs can be deleted",
            details={"current_status": job.status},
        )
    checkpoint_ids = list(session.scalars(select(Checkpoint.id).where(Checkpoint.job_id == job_id)))
    busy = sorted(retention.pinned(session, checkpoint_ids))
    busy += sorted(repository.base_model_uses(session, checkpoint_ids))
    if busy:
        raise CheckpointInUse(
            f"checkpoint {busy[0]!r} of job {job_id!r} is being downloaded or is the base model of an "
            "unfinished job; try again later",
            details={"checkpoint_ids": busy},
        )
    session.execute(delete(Job).where(Job.id == job_id))  # events, metrics, samples, checkpoints cascade
    on_commit(session, partial(_delete_job_files, storage, job_id))


def _delete_job_files(storage: Storage, job_id: str) -> None:
    try:
        storage.delete(job_prefix(job_id))
    except Exception:
        log.warning("job %s: could not delete its files under %s", job_id, job_prefix(job_id), exc_info=True)


# --- control --------------------------------------------------------------------------------------


def cancel_job(session: Session, tenant_id: str, job_id: str) -> Job:
    """queued/paused -> cancelled at once; running -> cancelling (the worker stops and finishes it)."""
    job = get_job(session, tenant_id, job_id, for_update=True)
    target = JobStatus.cancelling if job.status == JobStatus.running else JobStatus.cancelled
    transition(session, job, target, reason="cancel requested")
    return job


def pause_job(session: Session, tenant_id: str, job_id: str) -> Job:
    """queued -> paused at once; running -> pause requested (the worker pauses at a checkpoint)."""
    job = get_job(session, tenant_id, job_id, for_update=True)
    if job.status != JobStatus.running:
        transition(session, job, JobStatus.paused, reason="pause requested")
        return job
    if not job.pause_requested:
        job.pause_requested = True
        job.updated_at = utcnow()
        _event(session, job, "pause_requested", "pause requested; the job pauses at its next checkpoint")
    return job


def resume_job(session: Session, tenant_id: str, job_id: str, queue: JobQueue) -> Job:
    """paused -> queued (re-enqueued, resuming from the latest checkpoint); withdraws a pending pause.
    A job whose budget (or its tenant's monthly cap) is still reached stays paused: 409 `budget_exhausted`."""
    job = get_job(session, tenant_id, job_id, for_update=True)
    if job.status == JobStatus.running and job.pause_requested:
        job.pause_requested = False
        job.updated_at = utcnow()
        _event(session, job, "pause_withdrawn", "pause request withdrawn")
        return job
    if job.status != JobStatus.paused:
        raise IllegalTransition(
            f"job {job.id!r} is {job.status}: only a paused job can be resumed",
            details={"current_status": job.status, "requested_status": JobStatus.queued.value},
        )
    quotas.check_can_queue(session, tenant_id, job.devices, repository.job_load, resuming=True)
    budgets.refuse_if_exhausted(session, job)
    job.resume_checkpoint_id = (
        checkpoints_repository.latest_checkpoint_id(session, job.id) or job.resume_checkpoint_id
    )
    transition(
        session, job, JobStatus.queued, reason="resumed", data={"checkpoint_id": job.resume_checkpoint_id}
    )
    enqueue_after_commit(session, job, queue)
    return job


def _event(session: Session, job: Job, type_: str, message: str) -> None:
    session.add(
        JobEvent(
            job_id=job.id, type=type_, message=message, data={}, attempt=job.attempt, created_at=utcnow()
        )
    )
    session.flush()


# --- budgets (service.usage.budget) --------------------------------------------------------------------


def set_job_budget(session: Session, tenant_id: str, job_id: str, budget: JobBudget | None) -> Job:
    """Replace the job's budget (None removes it). A running job sees it at its next step; a job paused with
    `budget_exhausted` can be resumed once it allows more. Refused (409) for a finished job."""
    job = get_job(session, tenant_id, job_id, for_update=True)
    if JobStatus(job.status) in TERMINAL:
        raise IllegalTransition(
            f"job {job.id!r} is {job.status}: a finished job's budget cannot change",
            details={"current_status": job.status},
        )
    value = None if budget is None else budget.model_dump(mode="json")
    job.spec = {**job.spec, "budget": value}
    job.updated_at = utcnow()
    session.add(JobEvent(
        job_id=job.id, type="budget_changed", message=f"budget set to {value}", data={"budget": value},
        attempt=job.attempt, created_at=utcnow(),
    ))
    session.flush()
    return job


def pause_if_exhausted(session: Session, job: Job) -> Exhausted | None:
    """At claim, before an attempt starts: a job (queued, or running with an expired lease) whose budget or
    tenant cap is reached is paused with `budget_exhausted`, the event and error the step check writes, and no
    step runs. Returns the limit, or None when the job may start. Never commits."""
    reached = budgets.exhausted(session, job)
    if reached is None:
        return None
    message = f"{BUDGET_EXHAUSTED_EVENT} before attempt {job.attempt + 1} started: {reached.message}"
    session.add(JobEvent(
        job_id=job.id, type=BUDGET_EXHAUSTED_EVENT, message=message,
        data={"step": job.current_step, **reached.as_data()}, attempt=job.attempt, step=job.current_step,
        created_at=utcnow(),
    ))
    transition(session, job, JobStatus.paused, reason=message)
    job.error_code = BUDGET_EXHAUSTED_EVENT
    job.error_message = f"{reached.message}; raise it (PATCH /v1/jobs/{job.id}) and resume the job"
    session.flush()
    return reached
