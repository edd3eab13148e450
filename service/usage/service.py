"""Usage metering and cost control for API callers (REST and gRPC) and the worker.

- The worker records each step's usage (`record_step`) in the transaction that records its metrics, after
  the attempt fence; the same transaction adds the step to its model's calibration and tells whether a
  budget is now reached (service.usage.budget).
- Tenants read exact sums of the per-step records (`report`, and `usage_of` a job), and estimate a spec before
  running it (`estimate_spec`). The jobs domain finds the job or checks the spec first
  (service.jobs.service.job_usage, estimate) and changes a job's budget (set_job_budget).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol

from sqlalchemy.orm import Session

from contract.api.usage import (
    BudgetState,
    Calibration,
    Estimate,
    JobUsage,
    StepUsage,
    UsageGroup,
    UsageReport,
    UsageTotals,
)
from contract.spec import JobBudget, JobSpec
from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import ValidationFailed
from service.usage import repository
from service.usage.budget import BudgetedJob, Exhausted, exhausted, month_start
from service.usage.models import UsageCalibration
from service.usage.repository import Sums

GroupBy = Literal["day", "job"]
# Parameter-count buckets (upper bound exclusive, name): models of one bucket share a calibration.
SIZE_BUCKETS = ((10**7, "<10M"), (10**8, "10M-100M"), (10**9, "100M-1B"), (10**10, "1B-10B"))
LARGEST_BUCKET = "10B+"
# A size written in a hub id ("Qwen2.5-0.5B-Instruct", "SmolLM2-135M"): digits, M or B, not inside a word.
_SIZE_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([MmBb])(?![A-Za-z0-9])")
# With no calibration: a prompt's tokens are guessed from the dataset's bytes per row.
BYTES_PER_TOKEN = 4


def size_bucket(parameters: int) -> str:
    for bound, name in SIZE_BUCKETS:
        if parameters < bound:
            return name
    return LARGEST_BUCKET


def bucket_from_name(base_model: str) -> str | None:
    """The size bucket a model's name states, e.g. `0.5B` -> 100M-1B; None when it states none."""
    match = _SIZE_IN_NAME.search(base_model.rsplit("/", 1)[-1])
    if match is None:
        return None
    scale = 10**6 if match.group(2).lower() == "m" else 10**9
    return size_bucket(int(float(match.group(1)) * scale))


# --- recording (worker) -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepUsageIn:
    """One step's usage as the worker measured it."""

    tokens_generated: int
    tokens_trained: int
    reward_calls: int
    device_seconds: float
    # For the calibration: completions generated and their most possible tokens; the model's size.
    completions: int
    completion_capacity: int
    num_iterations: int
    parameters: int

    def __post_init__(self) -> None:
        counts = (self.tokens_generated, self.tokens_trained, self.reward_calls, self.completions)
        if min(counts) < 0 or not math.isfinite(self.device_seconds) or self.device_seconds < 0:
            raise ValidationFailed(f"usage: counts and device_seconds must be finite and >= 0, got {self}")


class MeteredJob(BudgetedJob, Protocol):
    """What recording a step reads of its job (a service.jobs.models.Job)."""

    @property
    def base_model(self) -> str: ...


def record_step(
    session: Session, job: MeteredJob, step: int, attempt: int, usage: StepUsageIn
) -> Exhausted | None:
    """Record `step`'s usage for `job` (locked and fenced by the caller), add it to the calibration of the job's
    base model, and return the budget the job has now reached, if any."""
    repository.replace_step(
        session, job_id=job.id, tenant_id=job.tenant_id, step=step, attempt=attempt,
        tokens_generated=usage.tokens_generated, tokens_trained=usage.tokens_trained,
        reward_calls=usage.reward_calls, device_seconds=usage.device_seconds,
    )
    if usage.completions > 0:
        repository.add_calibration(
            session, base_model=job.base_model, bucket=size_bucket(usage.parameters), parameters=usage.parameters,
            completions=usage.completions, completion_capacity=usage.completion_capacity,
            tokens_generated=usage.tokens_generated, tokens_trained=usage.tokens_trained,
            tokens_trained_per_pass=usage.tokens_trained // max(usage.num_iterations, 1),
            device_seconds=usage.device_seconds,
        )
    return exhausted(session, job)


# --- reading ------------------------------------------------------------------------------------------


def job_totals(session: Session, job_id: str) -> Sums:
    """What a job used, all attempts."""
    return repository.job_sums(session, job_id)


def _totals(sums: Sums) -> UsageTotals:
    return UsageTotals(
        steps=sums.steps, tokens_generated=sums.tokens_generated, tokens_trained=sums.tokens_trained,
        tokens=sums.tokens, reward_calls=sums.reward_calls, device_seconds=sums.device_seconds,
    )


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def report(
    session: Session, tenant_id: str, *, start: datetime | None, end: datetime | None, group_by: GroupBy
) -> UsageReport:
    """The tenant's usage in [start, end) (default: this UTC month until now), by UTC day or by job."""
    end = _utc(end) if end is not None else utcnow()
    start = _utc(start) if start is not None else month_start(end)
    if start >= end:
        raise ValidationFailed(
            f"end: must be after start ({start.isoformat()})",
            details=[{"field": "end", "message": "must be after start", "type": "value_error"}],
        )
    groups = repository.grouped_sums(session, tenant_id, start, end, group_by)
    totals = repository.tenant_sums(session, tenant_id, start, end)
    return UsageReport(
        start=start, end=end, group_by=group_by, totals=_totals(totals),
        data=[UsageGroup(key=key, **_totals(sums).model_dump()) for key, sums in groups],
    )


def usage_of(session: Session, job: BudgetedJob) -> JobUsage:
    """The job's usage per step, its totals and its budget's state."""
    steps = repository.job_steps(session, job.id)
    budget = job.spec.get("budget")
    reached = exhausted(session, job)
    return JobUsage(
        job_id=job.id,
        totals=_totals(repository.job_sums(session, job.id)),
        budget=BudgetState(
            budget=None if budget is None else JobBudget.model_validate(budget),
            exhausted=None if reached is None else reached.field,
        ),
        steps=[
            StepUsage(
                step=row.step, attempt=row.attempt, recorded_at=row.recorded_at, steps=1,
                tokens_generated=row.tokens_generated, tokens_trained=row.tokens_trained,
                tokens=row.tokens_generated + row.tokens_trained, reward_calls=row.reward_calls,
                device_seconds=row.device_seconds,
            )
            for row in steps
        ],
    )


# --- estimate -----------------------------------------------------------------------------------------


def estimate_spec(session: Session, spec: JobSpec, *, train_rows: int, train_bytes: int) -> Estimate:
    """Expected usage of `spec`, whose train dataset has `train_rows` rows of `train_bytes` bytes, from the
    calibration of its base model, else of its size bucket, else the settings' default.

    Completions are assumed as long as measured runs made them (default: max_completion_length); dynamic
    sampling's extra rounds are not predicted.
    """
    config = spec.hyperparameters
    steps = config.total_steps(train_rows)
    completions = steps * config.prompts_per_step * config.num_generations
    capacity = completions * config.max_completion_length

    calibration, source = repository.calibration_for_model(session, spec.base_model), "model"
    bucket = calibration.bucket if calibration is not None else bucket_from_name(spec.base_model)
    if calibration is None and bucket is not None:
        calibration, source = repository.calibration_for_bucket(session, bucket), "bucket"
    if calibration is not None and _usable(calibration):
        fill = calibration.tokens_generated / calibration.completion_capacity
        trained_per_generated = calibration.tokens_trained_per_pass / calibration.tokens_generated
        seconds_per_token = calibration.device_seconds / (calibration.tokens_generated + calibration.tokens_trained)
        observed = calibration.steps
    else:
        source, observed = "default", 0
        fill = 1.0
        prompt_tokens = train_bytes / max(train_rows, 1) / BYTES_PER_TOKEN
        trained_per_generated = 1.0 + prompt_tokens / config.max_completion_length
        seconds_per_token = get_settings().estimate_seconds_per_token
    generated = round(capacity * fill)
    trained = round(generated * trained_per_generated * config.num_iterations)
    return Estimate(
        steps=steps, tokens_generated=generated, tokens_trained=trained, tokens=generated + trained,
        reward_calls=completions * len(spec.rewards), device_seconds=(generated + trained) * seconds_per_token,
        calibration=Calibration(
            source=source, bucket=bucket, steps_observed=observed, seconds_per_token=seconds_per_token,
            completion_fill=fill, trained_per_generated=trained_per_generated * config.num_iterations,
        ),
    )


def _usable(calibration: UsageCalibration) -> bool:
    return calibration.tokens_generated > 0 and calibration.completion_capacity > 0
