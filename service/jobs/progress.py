"""What the worker reports while it runs a job: events, metrics, samples, checkpoints, state changes.

Transport-free domain functions (the worker calls them through service/execution/reporting.py). Every call carries the
`attempt` the worker claimed: it is a fencing token. A worker whose lease was lost (the job was
re-queued and maybe claimed again with attempt + 1) gets StaleAttempt and must stop, so a zombie
can never overwrite the progress of the attempt that replaced it.

Each call locks the job row first: on PostgreSQL that also orders the job's event ids by commit
time, which the SSE stream relies on (it reads `id > last seen id`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from contract.fields import storable_json, storable_text
from contract.spec import JobSpec
from service.checkpoints import retention
from service.checkpoints import service as checkpoints
from service.checkpoints.models import Checkpoint
from service.jobs import repository
from service.jobs.events import CHECKPOINT_EVENT, EVAL_PREFIX, METRICS_EVENT, SAMPLES_EVENT, STATUS_EVENT
from service.jobs.models import Job, JobEvent, JobSample
from service.jobs.schemas import SampleIn, sample_out
from service.jobs.states import WORKER_OWNED, JobStatus, flush_job, transition
from service.kit.db import utcnow
from service.kit.errors import Conflict, NotFound, ValidationFailed
from service.storage import Storage

CHECKPOINTS_PRUNED_EVENT = "checkpoints_pruned"


class StaleAttempt(Conflict):
    """The caller's attempt no longer owns the job: stop working on it."""

    code = "stale_attempt"


def load_owned_job(session: Session, job_id: str, attempt: int) -> Job:
    """Lock the job row and check that `attempt` still owns it (status running or cancelling)."""
    job = repository.get_job_any_tenant(session, job_id, for_update=True)
    if job is None:
        raise NotFound("job", job_id)
    if job.attempt != attempt or job.status not in WORKER_OWNED:
        raise StaleAttempt(
            f"job {job_id!r} is {job.status} at attempt {job.attempt}; attempt {attempt} no longer owns it",
            details={"current_status": job.status, "current_attempt": job.attempt},
        )
    return job


def record_event(
    session: Session,
    job_id: str,
    attempt: int,
    type: str,
    message: str,
    data: Mapping[str, Any] | None = None,
) -> JobEvent:
    """Append a free-form event (type e.g. "log", "warning", "eval"). Status events come from transitions."""
    if type == STATUS_EVENT:
        raise ValidationFailed("type: 'status' events are written by state transitions only")
    job = load_owned_job(session, job_id, attempt)
    return _append(session, job, type, message, dict(data or {}))


def record_metrics(
    session: Session, job_id: str, attempt: int, step: int, metrics: Mapping[str, float]
) -> JobEvent:
    """Store one step's metrics (replacing a re-run step's), advance progress, emit a "metrics" event."""
    if step < 0:
        raise ValidationFailed(f"step: must be >= 0, got {step}")
    bad = sorted(name for name, value in metrics.items() if not math.isfinite(value))
    if bad:
        raise ValidationFailed(f"metrics: non-finite values for {', '.join(bad)}", details={"names": bad})
    job = load_owned_job(session, job_id, attempt)
    values = {name: float(value) for name, value in metrics.items()}
    repository.replace_metrics(session, job.id, step, values, attempt)
    job.current_step = step
    # Evaluations run every eval_every steps: the latest one stays visible between them.
    latest = dict(values)
    if not any(name.startswith(EVAL_PREFIX) for name in values):
        latest.update({k: v for k, v in (job.latest_metrics or {}).items() if k.startswith(EVAL_PREFIX)})
    job.latest_metrics = latest
    job.updated_at = utcnow()
    event = _append(session, job, METRICS_EVENT, f"step {step}", {"step": step, "metrics": values})
    flush_job(session, job)
    return event


def record_samples(
    session: Session, job_id: str, attempt: int, step: int, samples: Sequence[SampleIn]
) -> int:
    """Log completions of `step` with their total and per-source rewards. Returns how many. Samples with an
    episode (multi-turn jobs) are also announced by a `samples` event, so the job's stream (SSE, WatchJob) carries
    the trajectories as they are logged."""
    job = load_owned_job(session, job_id, attempt)
    now = utcnow()
    rows = [
        JobSample(
            job_id=job.id,
            step=step,
            prompt=s.prompt,
            completion=s.completion,
            reward=s.reward,
            rewards=s.rewards,
            policy_version=s.policy_version,
            episode=None if s.episode is None else s.episode.model_dump(),
            attempt=attempt,
            created_at=now,
        )
        for s in samples
    ]
    session.add_all(rows)
    session.flush()
    episodes = [sample_out(row).model_dump(mode="json") for row in rows if row.episode is not None]
    if episodes:
        _append(session, job, SAMPLES_EVENT, f"step {step}: {len(episodes)} episode(s)",
                {"step": step, "samples": episodes})
    return len(samples)


def set_total_steps(session: Session, job_id: str, attempt: int, total_steps: int) -> None:
    """Once the worker knows the plan (num_epochs x dataset size), progress can show it."""
    if total_steps < 1:
        raise ValidationFailed(f"total_steps: must be >= 1, got {total_steps}")
    job = load_owned_job(session, job_id, attempt)
    job.total_steps = total_steps
    flush_job(session, job)


def record_checkpoint(
    session: Session,
    storage: Storage,
    job_id: str,
    attempt: int,
    *,
    checkpoint_id: str,
    step: int,
    files: Mapping[str, Mapping[str, Any]],
    metrics: Mapping[str, float] | None = None,
) -> Checkpoint:
    """Register a checkpoint whose files the worker has uploaded under checkpoint_prefix(job, id).

    `files` is the engine manifest's `files` mapping, checked by service.checkpoints.service.add_checkpoint.
    `metrics` defaults to the job's recorded metrics at `step`. Fenced by `attempt` (StaleAttempt otherwise).
    Emits a "checkpoint" event and makes this the job's resume point, then applies the job's retention
    (`service.checkpoints.retention`; a "checkpoints_pruned" event names what it deleted).
    """
    job = load_owned_job(session, job_id, attempt)
    checkpoint = checkpoints.add_checkpoint(
        session,
        storage,
        job_id,
        job.tenant_id,
        attempt,
        checkpoint_id=checkpoint_id,
        step=step,
        files=files,
        metrics=metrics if metrics is not None else repository.metrics_at_step(session, job_id, step),
    )
    job.resume_checkpoint_id = checkpoint_id
    _append(
        session,
        job,
        CHECKPOINT_EVENT,
        f"checkpoint at step {step}",
        {
            "checkpoint_id": checkpoint_id,
            "step": step,
            "files": len(checkpoint.manifest),
            "total_bytes": checkpoint.total_bytes,
        },
    )
    hyper = JobSpec.model_validate(job.spec).hyperparameters
    pruned = retention.apply_retention(
        session, storage, job.id, hyper, partial(repository.base_model_uses, session)
    )
    if pruned:
        _append(
            session,
            job,
            CHECKPOINTS_PRUNED_EVENT,
            f"deleted {len(pruned)} checkpoint(s) beyond save_total_limit",
            {"checkpoint_ids": [c.id for c in pruned], "steps": sorted(c.step for c in pruned)},
        )
    return checkpoint


def worker_transition(
    session: Session,
    job_id: str,
    attempt: int,
    to: JobStatus,
    *,
    reason: str,
    error_code: str | None = None,
    error_message: str | None = None,
) -> Job:
    """A fenced state change by the worker: succeeded, failed (with error), paused or cancelled."""
    job = load_owned_job(session, job_id, attempt)
    reason = storable_text(reason)  # may quote a reward endpoint's or a library's error text
    if to is JobStatus.failed:
        job.error_code = error_code or "internal_error"
        job.error_message = storable_text(error_message or reason)
    transition(session, job, to, reason=reason)
    return job


def append_locked_event(
    session: Session, job: Job, type: str, message: str, data: dict[str, Any]
) -> JobEvent:
    """For callers that already hold the owned, locked job row (the worker's step report)."""
    return _append(session, job, type, message, data)


def _append(session: Session, job: Job, type: str, message: str, data: dict[str, Any]) -> JobEvent:
    step = data.get("step")
    event = JobEvent(
        job_id=job.id,
        type=type,
        # Worker events quote what the service never validated (an endpoint's error text, a completion).
        message=storable_text(message),
        data=storable_json(data),
        attempt=job.attempt,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        created_at=utcnow(),
    )
    session.add(event)
    session.flush()
    return event
