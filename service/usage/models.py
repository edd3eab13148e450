"""Usage records, the calibration that estimates come from, and per-tenant monthly caps.

- `job_usage`: one row per (job, step) a worker trained, written in the transaction that records the step's
  metrics and fenced by the same attempt. A step re-run by a later attempt (after a crash, from an earlier
  checkpoint) replaces the row, and the claim deletes the rows of steps after the checkpoint it resumes
  from, so each step is counted exactly once. `tenant_id` is copied from the job so a tenant's totals are
  one indexed range scan.
- `usage_calibration`: per base model, what finished steps measured (sums), with its parameter-count
  bucket so an estimate for an unseen model of a known size can use its bucket.
- `tenant_budgets`: a tenant's monthly caps, overriding the settings' defaults.
- `primitive_usage`: one row per call of the primitive training API (the Tinker door) a worker ran, written in
  the transaction that settles the call, so each call counts once. It adds to the tenant's totals and caps.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, BigIntId, UTCDateTime, utcnow
from service.tenants import models as tenants_models

# The tenants table must be in the metadata wherever these rows are written (a worker imports no API module):
# flushing resolves every foreign key of the mapped tables. The jobs table is: a step's usage is written for a
# job its writer has loaded.
__all__ = ["JobUsage", "PrimitiveUsage", "TenantBudget", "UsageCalibration", "tenants_models"]


class JobUsage(Base):
    __tablename__ = "job_usage"
    __table_args__ = (
        UniqueConstraint("job_id", "step"),
        Index("ix_job_usage_tenant_id_recorded_at", "tenant_id", "recorded_at"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    tokens_generated: Mapped[int] = mapped_column(BigInteger)
    tokens_trained: Mapped[int] = mapped_column(BigInteger)
    reward_calls: Mapped[int] = mapped_column(BigInteger)
    device_seconds: Mapped[float] = mapped_column(Float)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class UsageCalibration(Base):
    __tablename__ = "usage_calibration"

    base_model: Mapped[str] = mapped_column(String(512), primary_key=True)
    bucket: Mapped[str] = mapped_column(String(16), index=True)
    parameters: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(BigInteger)
    # Completions generated, and the most tokens they could have had (completions x max_completion_length).
    completions: Mapped[int] = mapped_column(BigInteger)
    completion_capacity: Mapped[int] = mapped_column(BigInteger)
    tokens_generated: Mapped[int] = mapped_column(BigInteger)
    tokens_trained: Mapped[int] = mapped_column(BigInteger)
    # tokens_trained / num_iterations: what the prompts and completions weigh, whatever the passes
    tokens_trained_per_pass: Mapped[int] = mapped_column(BigInteger)
    device_seconds: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TenantBudget(Base):
    __tablename__ = "tenant_budgets"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    monthly_max_device_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    monthly_max_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class PrimitiveUsage(Base):
    """A call of the primitive API: tokens sampled (generated), tokens through forward or forward_backward
    (trained), and the seconds the worker's device spent on it. `target_id` is the training client or sampler."""

    __tablename__ = "primitive_usage"
    __table_args__ = (
        Index("ix_primitive_usage_tenant_id_recorded_at", "tenant_id", "recorded_at"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    request_id: Mapped[str] = mapped_column(String(40), unique=True)
    target_id: Mapped[str] = mapped_column(String(80))
    operation: Mapped[str] = mapped_column(String(32))
    tokens_generated: Mapped[int] = mapped_column(BigInteger)
    tokens_trained: Mapped[int] = mapped_column(BigInteger)
    device_seconds: Mapped[float] = mapped_column(Float)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
