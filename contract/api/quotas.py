"""Pydantic shapes of the quotas API (the admin routes `/v1/admin/tenants/{id}/quotas`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.fields import INT32_MAX, INT64_MAX

QuotaName = Literal["max_running_jobs", "max_queued_jobs", "max_devices", "max_dataset_storage_bytes"]
QUOTA_NAMES: tuple[QuotaName, ...] = ("max_running_jobs", "max_queued_jobs", "max_devices", "max_dataset_storage_bytes")


class QuotaLimits(BaseModel):
    """One value per quota; null means no limit (in `limits`) or the service default (in `overrides`)."""

    model_config = ConfigDict(extra="forbid")

    max_running_jobs: int | None = Field(
        None, ge=0, le=INT32_MAX, description="Jobs running at once; more wait `queued` (they are not refused)."
    )
    max_queued_jobs: int | None = Field(
        None, ge=0, le=INT32_MAX, description="Jobs waiting, `queued` or `paused`: a new job past it is refused "
        "(429), and so is resuming a job while the queued ones alone reach it."
    )
    max_devices: int | None = Field(
        None, ge=0, le=INT32_MAX, description="Devices the running jobs occupy together; a job waits until its "
        "devices fit."
    )
    max_dataset_storage_bytes: int | None = Field(
        None, ge=0, le=INT64_MAX, description="Total size of the datasets; an upload past it is refused (409)."
    )


class QuotaUsage(BaseModel):
    running_jobs: int
    queued_jobs: int = Field(description="Jobs waiting, `queued` or `paused` (what `max_queued_jobs` counts).")
    devices: int
    dataset_storage_bytes: int


class QuotasOut(BaseModel):
    object: Literal["tenant_quotas"] = "tenant_quotas"
    tenant_id: str
    limits: QuotaLimits = Field(description="What applies: the override where set, else the service default.")
    overrides: QuotaLimits = Field(description="This tenant's overrides (null: the service default applies).")
    usage: QuotaUsage = Field(description="What the tenant uses now, counted as the limits count it.")
