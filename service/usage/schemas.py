"""Request shapes of the usage and cost-control API (responses: contract.api.usage)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contract.spec import JobBudget


class JobPatch(BaseModel):
    """Fields of a job that may change after submission."""

    model_config = ConfigDict(extra="forbid")
    budget: JobBudget | None = Field(
        description="The job's new limits (replacing the old ones; null removes them). A job paused with "
        "`budget_exhausted` can be resumed once they allow more."
    )
