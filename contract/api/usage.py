"""Response shapes of the usage and cost-control API (usage reports, job usage, estimates, tenant caps)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from contract.spec import JobBudget


class UsageTotals(BaseModel):
    steps: int = Field(description="Training steps counted (each once, whatever attempt ran it last).")
    tokens_generated: int = Field(description="Completion tokens sampled (every sampling round).")
    tokens_trained: int = Field(
        description="Prompt + completion tokens (no padding) through the policy's forward and backward, once per "
        "optimisation pass (num_iterations)."
    )
    tokens: int = Field(description="tokens_generated + tokens_trained: what `max_tokens` budgets count.")
    reward_calls: int = Field(description="Completions scored, once per reward source.")
    device_seconds: float = Field(
        description="Seconds a device (one GPU, or the CPU of a cpu-queue worker) was held for the step: from the "
        "end of the previous step's report to the end of this one's (generation, scoring, training, eval, "
        "checkpoint upload)."
    )


class StepUsage(UsageTotals):
    step: int
    attempt: int = Field(description="The attempt whose run of the step counts.")
    recorded_at: datetime


class UsageGroup(UsageTotals):
    key: str = Field(description="The UTC day (YYYY-MM-DD) or the job id.", examples=["2026-11-25"])


class UsageReport(BaseModel):
    object: Literal["usage"] = "usage"
    start: datetime
    end: datetime
    group_by: Literal["day", "job"]
    totals: UsageTotals = Field(description="Exact sums of the per-step records in [start, end).")
    data: list[UsageGroup]


class BudgetState(BaseModel):
    budget: JobBudget | None = Field(description="The job's limits (null: none).")
    exhausted: str | None = Field(
        description="The limit the job has reached (`budget.max_tokens`, `budget.max_device_seconds`, "
        "`tenant.monthly_max_tokens`, `tenant.monthly_max_device_seconds`), else null."
    )


class JobUsage(BaseModel):
    object: Literal["job_usage"] = "job_usage"
    job_id: str
    totals: UsageTotals
    budget: BudgetState
    steps: list[StepUsage] = Field(description="The per-step records, by step.")


class Calibration(BaseModel):
    source: Literal["model", "bucket", "default"] = Field(
        description="`model`: measured on this base model; `bucket`: on models of its parameter-count bucket "
        "(read from its name, e.g. `0.5B`); `default`: nothing measured yet (settings' defaults)."
    )
    bucket: str | None
    steps_observed: int
    seconds_per_token: float = Field(
        description="Device-seconds per token generated or trained, all phases of a step together."
    )
    completion_fill: float = Field(description="Generated tokens / (completions x max_completion_length).")
    trained_per_generated: float = Field(description="tokens_trained / tokens_generated.")


class Estimate(BaseModel):
    object: Literal["estimate"] = "estimate"
    steps: int
    tokens_generated: int
    tokens_trained: int
    tokens: int
    reward_calls: int
    device_seconds: float
    calibration: Calibration


class TenantBudgetOut(BaseModel):
    tenant_id: str
    monthly_max_device_seconds: float | None
    monthly_max_tokens: int | None
