"""The jobs API's responses (shapes in contract.api.jobs) built from rows, and the samples the worker logs.

A job's input is contract.spec.JobSpec, shared with the engine."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Row

from contract.api.jobs import (
    EpisodeOut,
    EventOut,
    JobError,
    JobOut,
    JobStatus,
    Progress,
    SampleOut,
)
from contract.fields import finite_or_none, storable_text
from contract.spec import JobSpec
from service.jobs.models import Job, JobEvent, JobSample


class SampleIn(BaseModel):
    """A completion the worker logs (record_samples)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    completion: str
    reward: float | None = None
    rewards: dict[str, float | None] = Field(default_factory=dict)
    policy_version: int | None = Field(None, ge=0)
    episode: EpisodeOut | None = None

    @field_validator("prompt", "completion")
    @classmethod
    def _storable(cls, value: str) -> str:
        # A model can generate U+0000, which PostgreSQL text cannot hold: logged as U+FFFD instead of failing
        # the step's write.
        return storable_text(value)

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        # JSON has no NaN/inf: a non-finite reward is logged as "no value".
        return finite_or_none(value)

    @field_validator("rewards")
    @classmethod
    def _finite_each(cls, values: dict[str, float | None]) -> dict[str, float | None]:
        return {k: finite_or_none(v) for k, v in values.items()}


def job_out(job: Job | Row[Any]) -> JobOut:
    """From a Job entity or a plain row of its columns under the same names (repository.get_job_row)."""
    error = None
    if job.error_code is not None:
        error = JobError(code=job.error_code, message=job.error_message or "")
    return JobOut(
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


def event_out(event: JobEvent) -> EventOut:
    return EventOut(
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


def sample_out(sample: JobSample) -> SampleOut:
    return SampleOut(
        id=sample.id,
        step=sample.step,
        prompt=sample.prompt,
        completion=sample.completion,
        reward=sample.reward,
        rewards=sample.rewards,
        policy_version=sample.policy_version,
        episode=None if sample.episode is None else EpisodeOut.model_validate(sample.episode),
        created_at=sample.created_at,
    )
