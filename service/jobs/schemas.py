"""Pydantic shapes of the jobs API (inputs are contract.spec.JobSpec, shared with the engine)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Row

from contract.spec import JobSpec
from service.jobs.models import Job, JobEvent, JobSample
from service.jobs.states import JobStatus


class Progress(BaseModel):
    step: int = Field(description="Last optimiser step with recorded metrics (0 before the first).")
    total_steps: int | None = Field(description="Planned steps; null until known (num_epochs-based runs).")


class JobError(BaseModel):
    code: str = Field(examples=["reward_endpoint_unavailable"])
    message: str


class JobOut(BaseModel):
    object: Literal["job"] = "job"
    id: str = Field(examples=["job_01JDX3V8Q4M2C6T9W1R5Y7Z0AB"])
    name: str | None
    status: JobStatus
    base_model: str
    train_dataset: str
    eval_dataset: str | None
    queue: str = Field(description="Worker queue: 'gpu', or 'cpu' for the builtin: tiny models.")
    progress: Progress
    metrics: dict[str, float | None] = Field(description="Metrics of the latest recorded step.")
    error: JobError | None = Field(description="Set when the job failed.")
    attempt: int = Field(description="How many times a worker has started this job.")
    max_attempts: int
    pause_requested: bool = Field(
        description="A pause is requested; the worker pauses at its next checkpoint."
    )
    resume_checkpoint_id: str | None = Field(description="Checkpoint the next attempt resumes from.")
    spec: JobSpec
    metadata: dict[str, str]
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, job: Job | Row[Any]) -> JobOut:
        """From a Job entity or a plain row of its columns under the same names (repository.get_job_row)."""
        error = None
        if job.error_code is not None:
            error = JobError(code=job.error_code, message=job.error_message or "")
        return cls(
            id=job.id,
            name=job.name,
            status=JobStatus(job.status),
            base_model=job.base_model,
            train_dataset=job.train_dataset_id,
            eval_dataset=job.eval_dataset_id,
            queue=job.queue,
            progress=Progress(step=job.current_step, total_steps=job.total_steps),
            metrics=job.latest_metrics,
            error=error,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            pause_requested=job.pause_requested,
            resume_checkpoint_id=job.resume_checkpoint_id,
            spec=JobSpec.model_validate(job.spec),
            metadata=job.metadata_,
            created_at=job.created_at,
            updated_at=job.updated_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")


class EventOut(BaseModel):
    id: int = Field(description="Monotonic per job; the SSE event id.")
    job_id: str
    type: str = Field(examples=["status", "metrics", "checkpoint", "log"])
    message: str
    data: dict[str, Any]
    attempt: int
    step: int | None = Field(None, description="The training step the event is about, if any.")
    superseded: bool = Field(
        False,
        description="A later attempt re-ran this step from an earlier checkpoint (after a crash); its own event "
        "for the step is the one that counts. Listed only with include_superseded.",
    )
    created_at: datetime

    @classmethod
    def from_row(cls, event: JobEvent) -> EventOut:
        return cls(
            id=event.id,
            job_id=event.job_id,
            type=event.type,
            message=event.message,
            data=event.data,
            attempt=event.attempt,
            step=event.step,
            superseded=event.superseded,
            created_at=event.created_at,
        )


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventOut]
    has_more: bool
    next_after: int | None = Field(description="Pass as `after` to get the next page.")


class MetricSeries(BaseModel):
    steps: list[int]
    values: list[float]


class MetricsOut(BaseModel):
    job_id: str
    series: dict[str, MetricSeries] = Field(description="One time series per metric name, ordered by step.")
    has_more: bool
    next_since_step: int | None = Field(description="Pass as `since_step` to continue when has_more.")


class SampleOut(BaseModel):
    id: int
    step: int
    prompt: str
    completion: str
    reward: float | None = Field(description="Weighted total reward.")
    rewards: dict[str, float | None] = Field(description="Reward per source; null where a source abstained.")
    created_at: datetime

    @classmethod
    def from_row(cls, sample: JobSample) -> SampleOut:
        return cls(
            id=sample.id,
            step=sample.step,
            prompt=sample.prompt,
            completion=sample.completion,
            reward=sample.reward,
            rewards=sample.rewards,
            created_at=sample.created_at,
        )


class SampleList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SampleOut]
    has_more: bool
    next_after: int | None


class SampleIn(BaseModel):
    """A completion the worker logs (record_samples)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    completion: str
    reward: float | None = None
    rewards: dict[str, float | None] = Field(default_factory=dict)

    @field_validator("prompt", "completion")
    @classmethod
    def _storable(cls, value: str) -> str:
        # A model can generate U+0000, which PostgreSQL text cannot hold: logged as U+FFFD instead of failing
        # the step's write.
        return value.replace("\x00", "\ufffd")

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        # JSON has no NaN/inf: a non-finite reward is logged as "no value".
        return None if value is None or not math.isfinite(value) else value

    @field_validator("rewards")
    @classmethod
    def _finite_each(cls, values: dict[str, float | None]) -> dict[str, float | None]:
        return {k: None if v is None or not math.isfinite(v) else v for k, v in values.items()}
