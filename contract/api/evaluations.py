"""Response shapes of the evaluations API (service.evaluations); the request is contract.evaluation."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from contract.api.jobs import JobError, JobStatus
from contract.evaluation import EvaluationSpec


class Interval(BaseModel):
    low: float
    high: float


class EvaluationResults(BaseModel):
    """The summary of a succeeded evaluation (definitions: docs/evaluations.md)."""

    items: int = Field(description="Items evaluated.")
    samples: int = Field(description="Completions scored (items x samples_per_item).")
    abstained: int = Field(description="Completions every reward source abstained on (not in the means).")
    mean_reward: float | None = Field(description="Mean over items of the item's mean reward.")
    mean_reward_interval: Interval | None = Field(description="Percentile bootstrap 95 % interval over items.")
    binary: bool = Field(description="Every reward was 0 or 1: accuracy and pass@k are defined.")
    accuracy: float | None = Field(description="Binary rewards: the share of correct samples (pass@1).")
    accuracy_interval: Interval | None
    k: int = Field(description="Samples per item.")
    pass_at_k: float | None = Field(description="Binary rewards: the unbiased pass@k estimate, k = samples_per_item.")
    pass_at_k_interval: Interval | None
    tokens_generated: int = Field(description="Completion tokens generated, all attempts.")
    device_seconds: float = Field(description="Device time used, all attempts (as billed).")


class EvaluationProgress(BaseModel):
    items_done: int
    items_total: int | None = Field(description="Items to evaluate; null until the worker read the dataset.")


class EvaluationOut(BaseModel):
    object: Literal["evaluation"] = "evaluation"
    id: str = Field(examples=["eval_01JDX3V8Q4M2C6T9W1R5Y7Z0AB"])
    name: str | None
    status: JobStatus = Field(description="As a job's: queued, running, paused, succeeded, failed, cancelled...")
    model: str
    dataset: str
    samples_per_item: int
    progress: EvaluationProgress
    results: EvaluationResults | None = Field(description="Set once the evaluation succeeded.")
    error: JobError | None
    attempt: int
    spec: EvaluationSpec
    metadata: dict[str, str]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class EvaluationList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EvaluationOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")


class EvaluationItemOut(BaseModel):
    index: int = Field(description="The item's row in the dataset, from 0.")
    prompt: str = Field(description="The prompt as the model saw it (chat template applied).")
    completions: list[str]
    rewards: list[float | None] = Field(description="Total reward per completion; null where every source abstained.")
    sources: list[dict[str, float | None]] = Field(description="Each completion's value of every reward source.")
    score: float | None = Field(description="The item's mean reward.")


class EvaluationItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EvaluationItemOut]
    has_more: bool
    next_after: int | None = Field(description="Pass as `after` (an item index) to get the next page.")


class FlippedItem(BaseModel):
    index: int
    prompt: str
    score_a: float
    score_b: float


class ComparisonOut(BaseModel):
    object: Literal["evaluation.comparison"] = "evaluation.comparison"
    evaluation_a: str
    evaluation_b: str
    metric: Literal["accuracy", "mean_reward"] = Field(description="accuracy when both are binary, else mean_reward.")
    items: int = Field(description="Items scored in both evaluations (paired).")
    mean_a: float
    mean_b: float
    difference: float = Field(description="mean_b - mean_a over the paired items.")
    interval: Interval = Field(description="Paired bootstrap 95 % interval of the difference.")
    test: Literal["mcnemar_exact", "paired_permutation"]
    p_value: float = Field(description="Two-sided p-value of the paired test (no difference).")
    b_better: int = Field(description="Items that score higher in b.")
    a_better: int
    flipped: list[FlippedItem] = Field(
        description="Binary rewards: items whose majority verdict changed between a and b (at most 100)."
    )
