"""Budgets: a job's own limits (spec.budget) and its tenant's monthly caps (settings default, per-tenant value).

Checked at three points, so that no step runs past a limit that is already reached:

- submission (`refuse_if_tenant_exhausted`, from jobs.create_job: REST, gRPC and the OpenAI-compatible door):
  a tenant at or over a monthly cap gets 409 `budget_exhausted` naming the cap, and no job is created;
- claim (`service.jobs.service.pause_if_exhausted`, from the worker's claim): a job whose budget or tenant cap is
  reached is paused with `budget_exhausted` instead of starting an attempt, as the step check below would have
  paused it;
- every step (`exhausted`, evaluated by the worker in the transaction that records a step's usage), so the
  step that reaches a limit is the one that pauses the job. The API calls it before resuming a job, so a job
  paused with `budget_exhausted` only resumes once the limit was raised.

Budgets read a job (`BudgetedJob`) and never change it: pausing it is the jobs domain's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy.orm import Session

from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import Conflict
from service.usage import repository

# The error code, and the type of the job event that a reached limit writes (service.jobs.events names it).
BUDGET_EXHAUSTED = "budget_exhausted"


class BudgetedJob(Protocol):
    """What budgets read of a job (a service.jobs.models.Job)."""

    @property
    def id(self) -> str: ...

    @property
    def tenant_id(self) -> str: ...

    @property
    def spec(self) -> dict[str, Any]: ...


class BudgetExhausted(Conflict):
    code = BUDGET_EXHAUSTED


@dataclass(frozen=True)
class Exhausted:
    """A limit that is reached: `field` names it as the API does (`budget.max_tokens`...)."""

    field: str
    limit: float
    used: float

    @property
    def message(self) -> str:
        return f"{self.field} {_number(self.limit)} reached (used {_number(self.used)})"

    def as_data(self) -> dict[str, object]:
        return {"field": self.field, "limit": self.limit, "used": self.used}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


def month_start(now: datetime | None = None) -> datetime:
    now = now or utcnow()
    return datetime(now.year, now.month, 1, tzinfo=UTC)


@dataclass(frozen=True)
class TenantCaps:
    monthly_max_device_seconds: float | None
    monthly_max_tokens: int | None


def tenant_caps(session: Session, tenant_id: str) -> TenantCaps:
    """The tenant's own value where set, else the settings' default (None: no cap)."""
    settings = get_settings()
    row = repository.tenant_budget(session, tenant_id)
    seconds = row.monthly_max_device_seconds if row is not None else None
    tokens = row.monthly_max_tokens if row is not None else None
    return TenantCaps(
        seconds if seconds is not None else settings.monthly_max_device_seconds,
        tokens if tokens is not None else settings.monthly_max_tokens,
    )


def exhausted(session: Session, job: BudgetedJob) -> Exhausted | None:
    """The first limit the job or its tenant has reached, else None."""
    budget = job.spec.get("budget") or {}
    if budget.get("max_tokens") is not None or budget.get("max_device_seconds") is not None:
        sums = repository.job_sums(session, job.id)
        if budget.get("max_tokens") is not None and sums.tokens >= budget["max_tokens"]:
            return Exhausted("budget.max_tokens", budget["max_tokens"], sums.tokens)
        if budget.get("max_device_seconds") is not None and sums.device_seconds >= budget["max_device_seconds"]:
            return Exhausted("budget.max_device_seconds", budget["max_device_seconds"], sums.device_seconds)
    return tenant_exhausted(session, job.tenant_id)


def tenant_exhausted(session: Session, tenant_id: str) -> Exhausted | None:
    """The first monthly cap of the tenant that is reached this UTC month, else None."""
    caps = tenant_caps(session, tenant_id)
    if caps.monthly_max_tokens is None and caps.monthly_max_device_seconds is None:
        return None
    month = repository.tenant_sums(session, tenant_id, month_start(), datetime.max.replace(tzinfo=UTC))
    if caps.monthly_max_tokens is not None and month.tokens >= caps.monthly_max_tokens:
        return Exhausted("tenant.monthly_max_tokens", caps.monthly_max_tokens, month.tokens)
    if caps.monthly_max_device_seconds is not None and month.device_seconds >= caps.monthly_max_device_seconds:
        return Exhausted("tenant.monthly_max_device_seconds", caps.monthly_max_device_seconds, month.device_seconds)
    return None


def refuse_if_exhausted(session: Session, job: BudgetedJob) -> None:
    """Before resuming: 409 `budget_exhausted` naming the limit while it is still reached."""
    reached = exhausted(session, job)
    if reached is not None:
        raise BudgetExhausted(
            f"{reached.message}: raise it before resuming job {job.id!r}",
            details=reached.as_data(),
        )


def refuse_if_tenant_exhausted(session: Session, tenant_id: str) -> None:
    """Before a job is created: 409 `budget_exhausted` naming the monthly cap the tenant has reached."""
    reached = tenant_exhausted(session, tenant_id)
    if reached is not None:
        raise BudgetExhausted(
            f"{reached.message}: no job can start until the cap is raised or the month ends",
            details=reached.as_data(),
        )
