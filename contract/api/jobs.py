"""Response shapes of the jobs API, and the job states (see service.jobs.states for the machine)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from contract.fields import finite_or_none, storable_text
from contract.spec import JobSpec


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"


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


class ToolCallOut(BaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class TurnOut(BaseModel):
    """One turn of a multi-turn sample: the policy's (`assistant`) or a tool result (`tool`)."""

    role: Literal["assistant", "tool"]
    text: str = Field(description="What the policy wrote, or the tool's result as the policy read it.")
    tokens: int = Field(0, ge=0, description="Tokens in the trajectory (a turn's tool results share one suffix).")
    masked: bool = Field(description="True for the environment's tokens: out of the loss and the KL.")
    tool_calls: list[ToolCallOut] = Field(default_factory=list, description="The calls parsed from a policy turn.")
    name: str | None = Field(None, description="The tool a result comes from.")
    error: str | None = Field(None, description="The tool's own error (the policy read it).")
    reward: float | None = Field(None, description="The environment's reward for this step, when it gave one.")

    @field_validator("text")
    @classmethod
    def _storable(cls, value: str) -> str:
        return storable_text(value)

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return finite_or_none(value)


class EpisodeOut(BaseModel):
    """A multi-turn sample's episode: its turns in order, its failure, the environment's reward for it."""

    turns: list[TurnOut]
    error: str | None = Field(None, description="Why the episode failed (it then has no environment reward).")
    reward: float | None = Field(None, description="The environment's reward (its step rewards summed, or the last).")
    reward_mode: Literal["sum", "final"] = "sum"

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return finite_or_none(value)


class SampleOut(BaseModel):
    id: int
    step: int
    prompt: str
    completion: str
    reward: float | None = Field(description="Weighted total reward.")
    rewards: dict[str, float | None] = Field(description="Reward per source; null where a source abstained.")
    policy_version: int | None = Field(
        None,
        description="Optimiser steps in the weights that sampled it: step - 1 on-policy, older with "
        "async_generation (null for samples logged before it was recorded).",
    )
    episode: EpisodeOut | None = Field(
        None, description="Multi-turn jobs: the episode's turns; `completion` is then the whole trajectory's text."
    )
    created_at: datetime


class SampleList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SampleOut]
    has_more: bool
    next_after: int | None
