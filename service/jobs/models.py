"""Jobs and what they produce while running: events, per-step metrics, logged samples; idempotency keys.

The job row is the source of truth for a job's state (see service/jobs/states.py for the machine).
The worker columns (attempt, lease_until, worker_id, ...) are written by the worker (service/execution/lease.py):
`attempt` is the fencing token: a worker may only report for the attempt it claimed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.sql.expression import false

from service.kit.db import Base, BigIntId, UTCDateTime, utcnow


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_id_id", "tenant_id", "id"),
        Index("ix_jobs_tenant_id_status_id", "tenant_id", "status", "id"),
        # The fair claim's scan: queued jobs of one queue (service/execution/lease.py).
        Index("ix_jobs_status_queue", "status", "queue"),
        # ... and its "served least recently" per tenant.
        Index("ix_jobs_tenant_id_started_at", "tenant_id", "started_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # "train", or "evaluation" for the job that runs an evaluation (service.evaluations, same id).
    kind: Mapped[str] = mapped_column(String(16), server_default="train")
    status: Mapped[str] = mapped_column(String(16))
    # The submitted JobSpec as validated (model_dump(mode="json")): what the worker runs.
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    base_model: Mapped[str] = mapped_column(String(512))
    train_dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)
    eval_dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"), index=True, nullable=True)
    queue: Mapped[str] = mapped_column(String(16))
    # Devices the job occupies while it runs (service.jobs.service.job_devices): counted against max_devices.
    devices: Mapped[int] = mapped_column(Integer, server_default="1")
    # Among one tenant's queued jobs, higher runs first (then older).
    priority: Mapped[int] = mapped_column(Integer, server_default="0")
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)

    # --- progress ------------------------------------------------------------------------------------
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Metrics of the latest recorded step, denormalised so GET /jobs/{id} is one row read.
    latest_metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)

    # --- worker ownership (service/execution/lease.py) -------------------------------------------------------
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # No foreign key: checkpoints reference jobs, and this is only a hint of where to resume from.
    resume_checkpoint_id: Mapped[str | None] = mapped_column(String(40), nullable=True)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Optimistic concurrency: an UPDATE of a row changed since it was read fails (StaleDataError).
    version: Mapped[int] = mapped_column(Integer, default=1)

    __mapper_args__ = {"version_id_col": version}


class JobEvent(Base):
    """An append-only log entry. `id` orders events and is the SSE event id (Last-Event-ID)."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # The training step the event is about (metrics, checkpoint, reward_degraded...), else null.
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Written by an attempt for a step that a later attempt re-ran from an earlier checkpoint: the later
    # attempt's event for that step is the truth. Hidden from the event log and the stream by default.
    superseded: Mapped[bool] = mapped_column(Boolean, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class JobMetric(Base):
    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "step", "name"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Float)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class JobSample(Base):
    """One logged completion with its total reward and the reward of every source."""

    __tablename__ = "job_samples"
    __table_args__ = (Index("ix_job_samples_job_id_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    # {source name: value or null when the source abstained}
    rewards: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Optimiser steps in the weights that sampled it (step - 1 on-policy; older with async generation).
    policy_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Multi-turn jobs: the episode (contract.api.jobs.EpisodeOut as JSON); null for single turns.
    episode: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class IdempotencyKey(Base):
    """A claimed `Idempotency-Key`. The primary key (tenant, key) lets the database arbitrate races."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (Index("ix_idempotency_keys_created_at", "created_at"),)

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))  # "in_flight" | "completed"
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
